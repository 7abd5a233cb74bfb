"""Validation and normalisation of GradBoostModel's compile keyword arguments."""

import dataclasses
import numbers

from keras_gradboost import depthwise
from keras_gradboost import pointwise

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16", "auto", "measure")
LOSS_SCALES = ("auto", "dynamic")
_FLOAT32_MAX = 3.4028234663852886e38
_INT64_MAX = 2**63 - 1


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
            `"float32"`, `"mixed_float16"`, `"mixed_bfloat16"`, `"auto"` (time
            the first training calls in float32 and in the device's mixed
            policy, keep the faster; a static rule where it cannot measure)
            or `"measure"` (`"auto"` that must measure). Defaults to `None`.
        loss_scale: `"auto"` (dynamic loss scaling when the model computes in
            float16), `"dynamic"`, a positive float (a fixed scale) or `None`
            (no loss scaling). Defaults to `"auto"`.
        recompute: `None` (off), `"auto"`, a list of layer names or glob
            patterns, `{"budget_mb": N}` (optionally with `"batch_size"`),
            or `{"policy": "selective"}` (optionally with `"blocks"`:
            `"auto"` or a list of patterns). Lists are stored as tuples;
            `{"policy": "full", "blocks": b}` is stored as `b`. Defaults to
            `None`.
        recompute_check: whether to compare the gradients with and without
            recompute at the first step. Defaults to `False`.
        accumulate_check: whether to compare the first accumulation window
            with one step on its concatenated micro-batches, before its
            update. Needs `accumulate_steps > 1`. Defaults to `False`.
        depthwise: `None` (grouped convolutions run as Keras runs them;
            with `recompute` on, `"chunked"` where it runs bit for bit),
            `"keras"` (as Keras runs them, always), `"chunked"` (a
            `Conv2D` whose groups equal its input channels runs Keras'
            own grouped convolution on slices of its channels)
            or `"native"` (it runs TensorFlow's depthwise kernel); see
            `depthwise`. Defaults to `None`.
        pointwise: `None` (1x1 convolutions run as Keras runs them) or
            `"matmul"` (a `Conv2D` with a 1x1 kernel runs as a matrix
            product; see `pointwise`). Defaults to `None`.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: if an argument has a value outside what is accepted.
    """

    accumulate_steps: int = 1
    precision: object = None
    loss_scale: object = "auto"
    recompute: object = None
    recompute_check: bool = False
    accumulate_check: bool = False
    depthwise: object = None
    pointwise: object = None

    def __post_init__(self):
        object.__setattr__(self, "recompute", _recompute_setting(self.recompute))
        depthwise.check_setting(self.depthwise)
        pointwise.check_setting(self.pointwise)
        if not isinstance(self.recompute_check, bool):
            raise _invalid(
                "recompute_check", self.recompute_check, "True or False", TypeError
            )
        if self.recompute_check and self.recompute is None:
            raise ValueError(
                "`recompute_check=True` compares gradients with and without "
                "recompute, but `recompute` is None. Set `recompute` too, or "
                "drop `recompute_check`."
            )
        self._check_accumulation_and_scale()
        if not isinstance(self.accumulate_check, bool):
            raise _invalid(
                "accumulate_check", self.accumulate_check, "True or False", TypeError
            )
        if self.accumulate_check and self.accumulate_steps == 1:
            raise ValueError(
                "`accumulate_check=True` compares an accumulation window with "
                "one large-batch step, but `accumulate_steps` is 1. Set "
                "`accumulate_steps` > 1 too, or drop `accumulate_check`."
            )

    def _check_accumulation_and_scale(self):
        steps = self.accumulate_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
            raise _invalid(
                "accumulate_steps", steps, "an int >= 1", error=TypeError
            )
        if steps < 1:
            raise _invalid("accumulate_steps", steps, "an int >= 1")
        if steps > _INT64_MAX:
            raise _invalid(
                "accumulate_steps",
                steps,
                f"an int >= 1 and <= {_INT64_MAX} (the micro-batch counter is an int64)",
            )
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
        config = dataclasses.asdict(self)
        if isinstance(self.recompute, tuple):
            config["recompute"] = list(self.recompute)
        elif isinstance(self.recompute, dict) and isinstance(
            self.recompute.get("blocks"), tuple
        ):
            config["recompute"] = {**self.recompute, "blocks": list(self.recompute["blocks"])}
        return config


_RECOMPUTE_EXPECTED = (
    'None, "auto", a list of layer names or glob patterns (e.g. '
    '["encoder_*", "res_block_3"]), {"budget_mb": N} with N > 0 '
    '(optionally with "batch_size": B), or {"policy": "selective"} '
    '(optionally with "blocks": "auto" or a list of patterns)'
)
RECOMPUTE_POLICIES = ("full", "selective")


def _recompute_setting(value):
    """Normalises `recompute`: None, "auto", a tuple of patterns, or a dict."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        raise _invalid(
            "recompute",
            value,
            _RECOMPUTE_EXPECTED + f"; for one layer write [{value!r}]",
        )
    if isinstance(value, dict) and "policy" in value:
        return _policy_setting(value)
    if isinstance(value, dict):
        unknown = set(value) - {"budget_mb", "batch_size"}
        budget = value.get("budget_mb")
        batch = value.get("batch_size")
        good_budget = (
            not isinstance(budget, bool)
            and isinstance(budget, numbers.Real)
            and budget > 0
        )
        good_batch = batch is None or (
            not isinstance(batch, bool)
            and isinstance(batch, numbers.Integral)
            and batch > 0
        )
        if unknown or not good_budget or not good_batch:
            raise _invalid("recompute", value, _RECOMPUTE_EXPECTED)
        setting = {"budget_mb": float(budget)}
        if batch is not None:
            setting["batch_size"] = int(batch)
        return setting
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) and v for v in value):
            return tuple(value)
        raise _invalid("recompute", value, _RECOMPUTE_EXPECTED)
    raise _invalid("recompute", value, _RECOMPUTE_EXPECTED, TypeError)


def _policy_setting(value):
    """`{"policy": ..., "blocks": ...}`: "full" normalises to its blocks'
    setting, "selective" to `{"policy": "selective", "blocks": b}` with `b`
    "auto" or a tuple of patterns."""
    policy = value["policy"]
    if policy not in RECOMPUTE_POLICIES:
        raise _invalid(
            "recompute",
            value,
            'a "policy" of "full" or "selective"',
            error=ValueError if isinstance(policy, str) else TypeError,
        )
    if "budget_mb" in value and policy == "selective":
        raise ValueError(
            f"Invalid value for argument `recompute`. Received: recompute="
            f"{value!r}. A budget chooses among plans of full recompute; "
            'selective recompute keeps what it needs. Set only one: {"policy": '
            '"selective"} or {"budget_mb": N}.'
        )
    unknown = set(value) - {"policy", "blocks"}
    if unknown:
        raise _invalid(
            "recompute",
            value,
            f'only the keys "policy" and "blocks" with a policy (unknown: '
            f"{sorted(unknown)})",
        )
    blocks = _recompute_setting(value.get("blocks", "auto"))
    if blocks is None or isinstance(blocks, dict):
        raise _invalid(
            "recompute",
            value,
            '"blocks" as "auto" or a list of layer names or glob patterns',
        )
    if policy == "full":
        return blocks
    return {"policy": "selective", "blocks": blocks}


JIT_COMPILE = ("auto", True, False, "measure")


def jit_compile_setting(value):
    """Checks `compile(jit_compile=...)`: Keras' `"auto"`, True or False, or
    gradboost's `"measure"`.

    Returns:
        `value`.

    Raises:
        ValueError: for a string other than `"auto"` and `"measure"`.
        TypeError: for anything else that is not a bool.
    """
    if isinstance(value, bool) or isinstance(value, str) and value in ("auto", "measure"):
        return value
    raise _invalid(
        "jit_compile",
        value,
        'True, False, "auto" (Keras: XLA on a GPU) or "measure" (time the '
        "first steps with and without XLA and keep the faster)",
        error=ValueError if isinstance(value, str) else TypeError,
    )
