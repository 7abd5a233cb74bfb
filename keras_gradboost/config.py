"""Validation and normalisation of GradBoostModel's compile keyword arguments."""

import dataclasses
import numbers

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16", "auto")
LOSS_SCALES = ("auto", "dynamic")
_FLOAT32_MAX = 3.4028234663852886e38


def _invalid(name, value, expected, error=ValueError):
    return error(
        f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
        f"Expected {expected}."
    )


@dataclasses.dataclass(frozen=True)
class GradBoostConfig:
    """The gradboost part of `GradBoostModel.compile(...)`, validated.

    Args:
        accumulate_steps: Number of micro-batches whose gradients make one
            optimizer update. Defaults to `1` (no accumulation).
        precision: `None` (leave the model's dtype policies as built),
            `"float32"`, `"mixed_float16"`, `"mixed_bfloat16"` or `"auto"`.
            Defaults to `None`.
        loss_scale: `"auto"` (dynamic loss scaling when the model computes in
            float16), `"dynamic"`, a positive float (a fixed scale) or `None`
            (no loss scaling). Defaults to `"auto"`.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: if an argument has a value outside what is accepted.
    """

    accumulate_steps: int = 1
    precision: object = None
    loss_scale: object = "auto"

    def __post_init__(self):
        steps = self.accumulate_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
            raise _invalid(
                "accumulate_steps", steps, "an int >= 1", error=TypeError
            )
        if steps < 1:
            raise _invalid("accumulate_steps", steps, "an int >= 1")
        object.__setattr__(self, "accumulate_steps", int(steps))

        if self.precision is not None and self.precision not in PRECISIONS:
            raise _invalid(
                "precision",
                self.precision,
                "one of None, " + ", ".join(f'"{p}"' for p in PRECISIONS),
                error=ValueError if isinstance(self.precision, str) else TypeError,
            )

        scale = self.loss_scale
        if scale is None or isinstance(scale, str) and scale in LOSS_SCALES:
            return
        expected = (
            'None, "auto", "dynamic" or a float in (0, 3.4e38] (a fixed scale)'
        )
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise _invalid(
                "loss_scale",
                scale,
                expected,
                error=ValueError if isinstance(scale, str) else TypeError,
            )
        if not 0 < scale <= _FLOAT32_MAX:
            raise _invalid("loss_scale", scale, expected)
        object.__setattr__(self, "loss_scale", float(scale))

    @property
    def active(self):
        """Whether any gradboost feature differs from a plain `keras.Model`."""
        return self != GradBoostConfig()

    def to_dict(self):
        return dataclasses.asdict(self)
