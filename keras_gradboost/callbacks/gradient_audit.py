"""GradientAuditor: name the variables without gradients and why, and watch
per-layer gradient norms for dead, vanishing and exploding layers."""

import dataclasses
import statistics
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost import tracing
from keras_gradboost.callbacks import args
from keras_gradboost.callbacks.base import CallbackBase

ON_MISSING = ("warn", "raise", "ignore")

REASONS = {
    "unused": "the layer never ran in the forward pass",
    "cut": (
        "the layer ran, but the path to the loss is cut (stop_gradient, an "
        "integer cast, argmax, a non-differentiable op...)"
    ),
}


class MissingGradientError(ValueError):
    """Raised by `GradientAuditor(on_missing="raise")` when trainable
    variables get no gradient (before the first update is applied).

    Attributes:
        missing: the `MissingGradient` records.
    """

    def __init__(self, message, missing):
        super().__init__(message)
        self.missing = missing


@dataclasses.dataclass(frozen=True)
class MissingGradient:
    """A trainable variable whose gradient is None.

    Attributes:
        variable: the variable's path.
        layer: the name of the (innermost) layer that owns it.
        reason: "unused" (the layer never ran in the forward pass) or "cut"
            (it ran, but the path from it to the loss is cut).
    """

    variable: str
    layer: str
    reason: str


@dataclasses.dataclass
class AuditReport:
    """What a `GradientAuditor` found.

    Attributes:
        missing: `MissingGradient` records, from the first trace.
        non_trainable_used: paths of non-trainable variables the forward
            pass read (filled when `show_non_trainable=True`).
        zero_gradient: `{variable path: layer}` of variables whose gradient
            was exactly zero at `zero_checks` checks in a row.
        vanishing: `{layer: ratio}` of layers whose gradient norm was below
            `vanishing_ratio` times the median layer's at the last check.
        exploding: `{layer: ratio}`, above `exploding_ratio` times the median.
        layer_norms: `{layer: gradient norm}` at the last check.
        checks: how many runtime checks were read.
    """

    missing: list = dataclasses.field(default_factory=list)
    non_trainable_used: list = dataclasses.field(default_factory=list)
    zero_gradient: dict = dataclasses.field(default_factory=dict)
    vanishing: dict = dataclasses.field(default_factory=dict)
    exploding: dict = dataclasses.field(default_factory=dict)
    layer_norms: dict = dataclasses.field(default_factory=dict)
    checks: int = 0

    def summary(self):
        lines = [f"GradientAuditor: {self.checks} gradient checks."]
        if self.missing:
            lines.append("  variables without a gradient (by layer):")
            by_layer = {}
            for m in self.missing:
                by_layer.setdefault((m.layer, m.reason), []).append(m.variable)
            for (layer, reason), names in by_layer.items():
                lines.append(f"    {layer}: {', '.join(names)}: {reason}: {REASONS[reason]}")
        else:
            lines.append("  every trainable variable gets a gradient.")
        if self.non_trainable_used:
            lines.append(
                "  non-trainable variables read by the forward pass: "
                + ", ".join(self.non_trainable_used)
            )
        if self.zero_gradient:
            lines.append(
                "  gradient exactly zero at every recent check (dead units, "
                "masked path): "
                + ", ".join(f"{v} ({l})" for v, l in self.zero_gradient.items())
            )
        for name, table in (("vanishing", self.vanishing), ("exploding", self.exploding)):
            if table:
                lines.append(
                    f"  {name} gradients (norm / median layer norm): "
                    + ", ".join(f"{l} {r:.2e}" for l, r in table.items())
                )
        if self.layer_norms:
            lines.append("  layer gradient norms at the last check:")
            for layer, norm in self.layer_norms.items():
                lines.append(f"    {layer:<32} {norm:.4g}")
        return "\n".join(lines)


class GradientAuditor(CallbackBase):
    """Names the variables that get no gradient, and why; watches per-layer
    gradient norms for dead, vanishing and exploding layers.

    At the first trace of the train step it lists the trainable variables
    whose gradient is None, grouped by layer, with the reason: the layer
    never ran in the forward pass ("unused"), or it ran but the path to the
    loss is cut ("cut": stop_gradient, an integer cast, argmax...). The
    reason comes from tracing (not running) the forward pass and loss once
    and looking at which variables that graph captures.

    At run time, every `every_n_steps` optimizer steps the train step stores
    each variable's gradient sum of squares and max |g| (computed in-graph,
    inside a `tf.cond`), and the auditor reads them once per
    `every_n_steps` steps: one host read per check, none in between. It
    flags variables whose gradient stayed exactly zero for `zero_checks`
    checks in a row, and layers whose gradient norm is far below or above
    the median layer's.

    Works with any compiled Keras model (functional, Sequential, subclassed)
    and with `GradBoostModel` (with accumulation it sees the accumulated
    update), and with custom train steps that call
    `optimizer.apply_gradients` or `optimizer.apply`. It hooks
    `optimizer.apply` (which `apply_gradients` calls) through a trace-time
    wrapper (`keras_gradboost.tracing`), installed once per optimizer; after
    `fit` the in-graph check is switched off (a `tf.cond` per step remains).
    The wrapper stays installed after `fit` by design, so the next `fit`
    that listens does not retrace the train step;
    `keras_gradboost.tracing.uninstall(model)` removes it (and the
    `tf.cond`), after which `apply` is the optimizer's own method again.

    Args:
        on_missing: what to do when some trainable variable has no gradient:
            `"warn"`, `"raise"` (`MissingGradientError`, raised while the
            first step is traced, before any update) or `"ignore"`.
            Defaults to `"warn"`.
        every_n_steps: optimizer steps between runtime checks. Defaults to
            `100`.
        zero_checks: checks in a row with an exactly zero gradient before a
            variable is flagged. Defaults to `3`.
        vanishing_ratio: flag a layer whose gradient norm is below this
            times the median layer norm. Defaults to `1e-4`.
        exploding_ratio: flag a layer above this times the median. Defaults
            to `1e4`.
        show_non_trainable: also list the non-trainable variables that the
            forward pass reads. Defaults to `False`.
        verbose: print findings as they come. Defaults to `1`.

    Attributes:
        missing: the `MissingGradient` records of the last fit.

    Raises:
        ValueError: for a bad argument value.
        TypeError: for an argument of the wrong type.
        MissingGradientError: with `on_missing="raise"`.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_gradboost

    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu", name="body")(inputs)
    side = keras.layers.Dense(1, name="side")(h)
    head = keras.layers.Dense(1, name="head")(h)
    # The path from `side` to the loss is cut: its variables get no gradient.
    model = keras.Model(inputs, head + keras.ops.stop_gradient(side))
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.rand(64, 4).astype("float32")
    y = np.random.rand(64, 1).astype("float32")
    auditor = keras_gradboost.callbacks.GradientAuditor(every_n_steps=4)
    model.fit(x, y, batch_size=8, callbacks=[auditor])  # warns about `side`
    print(auditor.summary())
    ```
    """

    async_safe = True  # no batch-end hook: everything runs in the train call

    def __init__(
        self,
        on_missing="warn",
        every_n_steps=100,
        zero_checks=3,
        vanishing_ratio=1e-4,
        exploding_ratio=1e4,
        show_non_trainable=False,
        verbose=1,
    ):
        super().__init__()
        self.on_missing = args.check_choice("on_missing", on_missing, ON_MISSING)
        self.every_n_steps = args.check_int("every_n_steps", every_n_steps, minimum=1)
        self.zero_checks = args.check_int("zero_checks", zero_checks, minimum=1)
        self.vanishing_ratio = args.check_number(
            "vanishing_ratio", vanishing_ratio, above=0, below=1
        )
        self.exploding_ratio = args.check_number("exploding_ratio", exploding_ratio, above=1)
        self.show_non_trainable = args.check_bool("show_non_trainable", show_non_trainable)
        self.verbose = args.check_verbose(verbose)
        self._tracer = None
        self._reset()

    def _reset(self):
        self.missing = []
        self._report = AuditReport()
        self._streaks = {}
        self._specs = None
        self._analysed = False
        self._steps = 0
        self._last_read = 0
        self._last_at = -1
        self._warned_layers = set()

    # ------------------------------------------------------------ set-up

    def set_model(self, model):
        super().set_model(model)
        # Before fit() makes its train function, so it is made through it.
        if getattr(model, "optimizer", None) is not None:
            self._tracer, _ = tracing.gradient_tracer(model)

    def _install(self):
        model = self.model
        self._tracer, installed = tracing.gradient_tracer(model)
        if installed or model.train_function is None:
            model.make_train_function()
        tracer = self._tracer
        tracer.listeners.append(self._on_trace)
        self._on_teardown(lambda: tracer.listeners.remove(self._on_trace))
        tracer.every.assign(self.every_n_steps)
        self._on_teardown(lambda: tracer.every.assign(tracer.OFF))
        self._last_at = int(tracer.at.numpy())
        self._owners = _variable_owners(model)
        self._hold(self._before_call, self._after_call)

    # ----------------------------------------------------- missing grads

    def _before_call(self, batches):
        if self._specs is None:
            # Under a strategy a batch holds each replica's part: one part
            # has the shapes and dtypes each replica's step traces with.
            local = hooks.first_local_batch(self.model.distribute_strategy, batches[0])
            self._specs = tf.nest.map_structure(_spec, local)

    def _on_trace(self, none_paths):
        if self._analysed:
            return
        self._analysed = True
        self._owners = _variable_owners(self.model)  # built by now
        none_paths = set(none_paths)
        from keras_gradboost.model import GradBoostModel

        if isinstance(self.model, GradBoostModel) and self.model.step_facts:
            none_paths |= set(self.model.step_facts.none_gradient_variables)
        read = self._read_by_forward() if (none_paths or self.show_non_trainable) else set()
        missing = []
        for v in self.model.trainable_variables:
            if v.path in none_paths:
                reason = "cut" if _key(v) in read else "unused"
                missing.append(MissingGradient(v.path, self._owners.get(v.path, "?"), reason))
        self.missing = missing
        self._report.missing = list(missing)
        if self.show_non_trainable:
            self._report.non_trainable_used = [
                v.path for v in self.model.non_trainable_variables if _key(v) in read
            ]
        if missing and self.on_missing != "ignore":
            text = AuditReport(missing=missing).summary().split("\n", 1)[1]
            message = (
                f"GradientAuditor: {len(missing)} trainable variables get no "
                f"gradient; the optimizer silently skips them.\n{text}"
            )
            if self.on_missing == "raise":
                # Keras calls no on_train_end when fit() raises: undo now,
                # so the model trains as before without the auditor.
                self._teardown()
                raise MissingGradientError(message, missing)
            warnings.warn(message, stacklevel=2)

    def _read_by_forward(self):
        """Keys of the variables the forward pass and loss use: those the
        graph of a trace (never run) of them captures."""
        model, specs = self.model, self._specs
        if specs is None:
            return set()

        def forward(data):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            if hooks.call_has_training_arg(model):
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
            if y is None:
                return tf.nest.flatten(y_pred)[0]
            return hooks.compute_loss(model, x, y, y_pred, sample_weight, training=True)

        concrete = tf.function(forward, autograph=False).get_concrete_function(specs)
        return {id(t) for t in concrete.captured_inputs}

    # ------------------------------------------------------ runtime checks

    def _after_call(self, batches, logs):
        if not self._analysed and self._tracer.traced:
            # Traced in an earlier fit: what that trace recorded still holds.
            self._on_trace(self._tracer.none_paths)
        self._steps += len(batches)
        if self._steps - self._last_read >= self.every_n_steps:
            self._last_read = self._steps
            self._check()
        return None

    def _check(self):
        tracer = self._tracer
        if tracer.stats is None:
            return
        at = int(tracer.at.numpy())
        if at == self._last_at:
            return
        self._last_at = at
        if any(p not in self._owners for p in tracer.paths):
            self._owners = _variable_owners(self.model)
        sums, maxes = tracer.stats.numpy()
        report = self._report
        report.checks += 1
        norms = {}
        for path, s, m in zip(tracer.paths, sums, maxes):
            if m < 0:
                continue  # no gradient at all: listed in `missing`
            layer = self._owners.get(path, path)
            norms[layer] = norms.get(layer, 0.0) + float(s)
            streak = self._streaks.get(path, 0) + 1 if m == 0 else 0
            self._streaks[path] = streak
            if streak >= self.zero_checks and path not in report.zero_gradient:
                report.zero_gradient[path] = layer
                self._say(
                    f"GradientAuditor: the gradient of {path} (layer {layer}) "
                    f"was exactly zero at {streak} checks in a row: dead units "
                    "(e.g. ReLU inputs always negative) or a masked path."
                )
        norms = {layer: float(np.sqrt(v)) for layer, v in norms.items()}
        report.layer_norms = norms
        positive = [n for n in norms.values() if n > 0]
        report.vanishing, report.exploding = {}, {}
        if len(positive) >= 2:
            median = statistics.median(positive)
            for layer, n in norms.items():
                if n <= 0:
                    continue
                ratio = n / median
                if ratio < self.vanishing_ratio:
                    report.vanishing[layer] = ratio
                elif ratio > self.exploding_ratio:
                    report.exploding[layer] = ratio
        for table, word in ((report.vanishing, "vanishing"), (report.exploding, "exploding")):
            for layer, ratio in table.items():
                if (word, layer) not in self._warned_layers:
                    self._warned_layers.add((word, layer))
                    self._say(
                        f"GradientAuditor: {word} gradient in layer {layer}: "
                        f"norm {norms[layer]:.3g}, {ratio:.2e} times the median layer's."
                    )

    def _say(self, message):
        if self.verbose:
            print(message, flush=True)

    # ------------------------------------------------------------- results

    def report(self):
        """The findings so far, as an `AuditReport` (a copy)."""
        return dataclasses.replace(
            self._report,
            missing=list(self._report.missing),
            non_trainable_used=list(self._report.non_trainable_used),
            zero_gradient=dict(self._report.zero_gradient),
            vanishing=dict(self._report.vanishing),
            exploding=dict(self._report.exploding),
            layer_norms=dict(self._report.layer_norms),
        )

    def summary(self):
        """`report().summary()`: a readable account."""
        return self.report().summary()


def _spec(value):
    if value is None or not hasattr(value, "shape"):
        return value
    return tf.TensorSpec(value.shape, value.dtype)


def _key(variable):
    """The id of the resource handle behind a (Keras) variable, as a traced
    function's `captured_inputs` holds it."""
    value = getattr(variable, "value", variable)
    return id(getattr(value, "handle", value))


def _variable_owners(model):
    """`{variable path: name of the innermost layer holding it}`."""
    owners = {}
    for layer in hooks.flatten_layers(model, include_self=False):
        for v in layer.variables:
            owners[v.path] = layer.name  # later (inner) layers win
    return owners
