"""`jit_compile="measure"`: time the first training steps with and without
XLA, then keep the faster train function.

Every measured call is a real training call on the batches `fit` draws:
nothing is run twice and nothing is skipped. The first unit of each variant
traces (and, for XLA, compiles) and is not timed; then `TIMED_CALLS` units
of each are timed, interleaved (XLA, no XLA, XLA, ...), each call
synchronised with the host by reading one value of its logs. A unit is one
call, or with `accumulate_steps > 1` whole accumulation windows
(`measure_schedule`): each variant times as many updates, and a window's
Dropout masks come from one random number generator (TensorFlow's under
XLA are not its numbers without), so each window is the large-batch step
under its variant. A window restored with the weights (`checkpoint`:
the file says whether its micro-batches ran under XLA) first runs its
rest under that setting, untimed. The variant with the lower median
wins, and from then on Keras runs only that one: nothing is timed or read
any more. (The untimed first calls are synchronised too, so their tail does
not spill into the first timed call.)

The choice is saved with the weights (`saved_state`, in the model's
training state: `keras_gradboost.checkpoint`), or, while undecided, the
measuring progress, as `precision_measure` saves its own: a loaded model, or
a BackupAndRestore resume, trains on in the choice
(`JitMeasurement.restored`) or goes on with the schedule, call for call, as
the saved run would have (with Dropout, its masks too). A timed call that
traces in the new process is left out of the medians. A record made on
another device kind (CPU or GPU) is not adopted: a warning, and the model
measures again.

`Measurer` is the pure part (schedule, medians, decision) with an injectable
clock; `MeasuringTrainFunction` adapts it to Keras' train function.
"""

import dataclasses
import math
import re
import statistics
import time

import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost import measure_schedule
from keras_gradboost import wrappers

WARMUP_CALLS = measure_schedule.WARMUP_CALLS
TIMED_CALLS = measure_schedule.TIMED_CALLS

_UNSUPPORTED = re.compile(
    r"Detected unsupported operations when trying to compile graph \S+ on "
    r"\S+?: (?P<op>[\w.>-]+).*?\{\{node (?P<node>[^}]+)\}\}",
    re.DOTALL,
)


@dataclasses.dataclass(frozen=True)
class JitMeasurement:
    """What `jit_compile="measure"` found and chose.

    Attributes:
        jit_compile: the choice: True (XLA) or False.
        xla_ms: median time of a timed XLA call, in ms (None when XLA could
            not be used).
        no_xla_ms: median time of a timed call without XLA, in ms (None when
            not measured).
        timed_calls: timed units of each variant.
        calls_per_timing: the fewest train calls in one timed unit (whole
            accumulation windows); the medians are per call.
        reason: one line saying why this choice was made.
        restored: whether it was loaded with the weights (measured by the
            run that saved them).
    """

    jit_compile: bool
    xla_ms: object = None
    no_xla_ms: object = None
    timed_calls: int = 0
    calls_per_timing: int = 1
    reason: str = ""
    restored: bool = False

    @property
    def measured(self):
        """Whether timings made the choice (not XLA off from the start, or
        failing to compile: no median of either)."""
        return not (self.xla_ms is None and self.no_xla_ms is None)

    def message(self):
        """The one-line report printed when the choice is made."""
        choice = "XLA" if self.jit_compile else "no XLA"
        restored = " (restored with the weights, not measured again)" if self.restored else ""
        return f'jit_compile="measure": {choice}; {self.reason}{restored}.'


class XLAUnsupportedOpError(RuntimeError):
    """XLA cannot compile the training step: an op has no XLA kernel."""


class Measurer(measure_schedule.Schedule):
    """The schedule and the decision of `jit_compile="measure"`.

    Args:
        warmup_calls: untimed first units of each variant. Defaults to
            `WARMUP_CALLS`.
        timed_calls: timed units of each variant. Defaults to `TIMED_CALLS`.
        calls_per_timing: the fewest train calls in one unit (see
            `measure_schedule`: a unit is whole accumulation windows).
            Defaults to `1`.

    Raises:
        ValueError: if a count is not an int >= 1.
    """

    def __init__(self, warmup_calls=WARMUP_CALLS, timed_calls=TIMED_CALLS, calls_per_timing=1):
        # XLA first: a step XLA cannot compile is found on the first call.
        super().__init__((True, False), warmup_calls, timed_calls, calls_per_timing)

    def _decide(self):
        left_out = ""
        if any(self.dropped.values()):
            counts = " and ".join(
                f"{n} {'XLA' if jit else 'no-XLA'}" for jit, n in self.dropped.items() if n
            )
            left_out = f"; {counts} timing(s) left out: {measure_schedule.TRACED_NOTE}"
        unit = "; " + self.unit_note() if self.calls_per_timing > 1 else ""
        missing = [name for jit, name in ((True, "XLA"), (False, "no XLA")) if not self.times[jit]]
        if missing:
            # NaN, not None: timings made this choice (`measured`).
            return JitMeasurement(
                jit_compile=False,
                xla_ms=statistics.median(self.times[True]) if self.times[True] else math.nan,
                no_xla_ms=statistics.median(self.times[False]) if self.times[False] else math.nan,
                timed_calls=self.timed_calls,
                calls_per_timing=self.calls_per_timing,
                reason=f"no timing of {' and '.join(missing)} is left (every timed call "
                f"of it traced: {measure_schedule.TRACED_NOTE}): no XLA kept{left_out}",
            )
        xla = statistics.median(self.times[True])
        plain = statistics.median(self.times[False])
        faster = xla < plain
        unit += left_out
        return JitMeasurement(
            jit_compile=faster,
            xla_ms=xla,
            no_xla_ms=plain,
            timed_calls=self.timed_calls,
            calls_per_timing=self.calls_per_timing,
            reason=(
                f"median {min(xla, plain):.2f} ms per train call vs "
                f"{max(xla, plain):.2f} ms with{'out' if faster else ''} "
                f"XLA ({self.timed_calls} timed calls each{unit})"
            ),
        )

    def fail_xla(self, reason):
        """Decides no XLA, because XLA cannot be used (`reason`)."""
        self.units = []
        self.result = JitMeasurement(jit_compile=False, reason=reason)


def unsupported_op(error, model=None):
    """The op (and layer) an XLA compilation error names, if it is one.

    Args:
        error: an exception raised by a call of a `jit_compile=True`
            function.
        model: optional model whose layer names are matched against the
            op's name scope. Defaults to `None`.

    Returns:
        A description such as `"op PyFuncStateless (node
        functional/py_layer/PyFuncStateless, layer 'py_layer') has no XLA
        kernel"`, or None when `error` is not about an unsupported op.
    """
    if not isinstance(error, tf.errors.InvalidArgumentError):
        return None
    found = _UNSUPPORTED.search(str(error))
    if found is None:
        if "Detected unsupported operations" in str(error):
            return "an op has no XLA kernel"
        return None
    op, node = found.group("op"), found.group("node")
    layer = _layer_of(node, model) if model is not None else None
    where = f"node {node}" + (f", layer {layer!r}" if layer else "")
    return f"op {op} ({where}) has no XLA kernel"


def _layer_of(node, model):
    """The innermost layer of `model` named in `node`'s name scope (Keras
    adds `_1`, `_2`, ... to a scope that is used again)."""
    names = {layer.name for layer in hooks.flatten_layers(model, include_self=False)}
    for part in reversed(node.split("/")[:-1]):
        if part in names:
            return part
        base = re.sub(r"_\d+$", "", part)
        if base in names:
            return base
    return None


def unsupported_op_error(description):
    """The error `jit_compile=True` raises when XLA cannot compile the step."""
    return XLAUnsupportedOpError(
        f"jit_compile=True, but XLA cannot compile the training step: "
        f"{description}. Use jit_compile=False, or jit_compile=\"measure\" "
        "(which falls back to no XLA), or replace the op with one XLA "
        "supports."
    )


def perf_counter():
    """The clock `MeasuringTrainFunction` reads by default (looked up at each
    call, so a test can replace it)."""
    return time.perf_counter()


def sync_logs(logs):
    """Waits for the call to finish by reading one value of its logs."""
    values = tf.nest.flatten(logs)
    if values and hasattr(values[0], "numpy"):
        values[0].numpy()


class WindowSetting:
    """Which setting the pending accumulation window's micro-batches ran
    under: kept by a model's measuring train functions (one object for all
    of them, a NaNWatcher's guarded one too), saved with the window and
    set again when one is loaded (`checkpoint`).

    Attributes:
        jit: True (XLA) or False; None where no window is pending, or where
            it mixes settings or began under one not known.
        resume: the setting the rest of a loaded window runs under, untimed,
            before the measuring goes on; None when there is none.
        mixed: whether the pending window ran under both settings, or
            began under one not known.
    """

    def __init__(self):
        self.jit = None
        self.resume = None
        self.mixed = False

    def loaded(self, jit, pending, held=False):
        """A window loaded with the weights: `pending` micro-batches, run
        under `jit` (None: not known). `held`: a loaded schedule's current
        unit holds the window, so its rest runs measured, not resumed."""
        self.jit = jit if pending else None
        self.resume = None if held else self.jit
        self.mixed = bool(pending) and jit is None

    def ran(self, jit, closed, mixed=False):
        """After a call under `jit`: `closed`, whether no window is pending
        now; `mixed`, whether it went on with a window begun under the other
        setting."""
        if closed:
            self.resume = None
        self.mixed = not closed and (self.mixed or mixed)
        self.jit = None if closed or self.mixed else jit


class MeasuringTrainFunction(measure_schedule.EndsUnits):
    """A train function that runs the XLA or the non-XLA one, unit by unit
    (`measure_schedule`), as a `Measurer` says, until it decides.

    Args:
        model: the compiled model.
        functions: `{True: XLA train function, False: non-XLA one}`, both
            made by Keras for the same model and optimizer.
        on_decided: callable `(measurement, function)` called once, with the
            `JitMeasurement` and the chosen function.
        clock: callable returning seconds. Defaults to `None`: this
            module's `perf_counter`.
        measurer: the `Measurer`. Defaults to a new one with the default
            schedule.
        window_closed: callable telling whether no micro-batch of an
            accumulation window is pending (a host read, after each
            measured call and where a unit has its calls: a unit ends only
            then). Defaults to `None`: always.
        window: the model's `WindowSetting`: a window loaded with the
            weights runs its rest under the setting saved with it
            (`resume`), untimed, wherever the measuring is; each call says
            what it ran. Defaults to `None`: one of its own.
        on_mixed_window: callable called when a window begun under XLA (a
            loaded one) goes on without, XLA failing to compile here.
            Defaults to `None`.
    """

    def __init__(
        self, model, functions, on_decided, clock=None, measurer=None, window_closed=None,
        window=None, on_mixed_window=None,
    ):
        self.model = model
        self.functions = functions
        self.on_decided = on_decided
        self.clock = clock
        self.measurer = measurer or Measurer()
        self.window_closed = window_closed or (lambda: True)
        self.window = window or WindowSetting()
        self.on_mixed_window = on_mixed_window
        self._called = set()  # the settings this function has run (traced)
        wrappers.runs_batches(self)

    @property
    def result(self):
        return self.measurer.result

    def chosen(self):
        """The chosen candidate's train function (once decided)."""
        return self.functions[self.result.jit_compile]

    def __call__(self, iterator):
        # The batches are drawn here, so a failed XLA compilation can run
        # the very same batches without XLA.
        batches = wrappers.draw_batches(self.model, iterator)
        if not batches:
            raise StopIteration
        self.end_unit_if_due()  # where an epoch's end flushed its window
        if self.result is not None:  # decided, or a stale reference: the choice
            return wrappers.run_batches(self.model, self.chosen(), batches)
        resume = self._resume()
        began_under_xla = self.window.jit is True  # the pending window's
        jit = self.measurer.next_call()[0] if resume is None else resume
        clock = self.clock or perf_counter
        start = clock()
        try:
            logs = wrappers.run_batches(self.model, self.functions[jit], batches)
            sync_logs(logs)
        except tf.errors.InvalidArgumentError as error:
            found = unsupported_op(error, self.model) if jit else None
            if found is None:
                raise
            self.measurer.fail_xla(f"XLA cannot compile the step: {found}")
            logs = wrappers.run_batches(self.model, self.functions[False], batches)
            # A (loaded) window begun under XLA goes on without.
            self.window.ran(False, self.window_closed(), mixed=began_under_xla)
            if began_under_xla and self.on_mixed_window:
                self.on_mixed_window()
        else:
            closed = self.window_closed()
            traced = jit not in self._called
            self._called.add(jit)
            if resume is None:
                self.measurer.record(clock() - start, traced=traced, window_closed=closed)
            self.window.ran(jit, closed)
        if self.result is not None:
            self.on_decided(self.result, self.chosen())
        return logs

    def _resume(self):
        """The setting of a loaded window's micro-batches while that window
        is pending (its rest runs under it, untimed), else None: measure."""
        if self.window.resume is not None and self.window_closed():
            self.window.resume = None  # closed by an epoch's end
        return self.window.resume


# ------------------------------------------------------------ checkpoints

STATE_FORMAT = 1


def saved_state(measurement, measurer, device):
    """What a checkpoint keeps of `jit_compile="measure"`, as plain values:
    the device kind ("CPU" or "GPU") and either the decision (when
    measured) or the measuring progress (`Schedule.progress`); None when
    there is neither (not started, or XLA off from the start)."""
    return measure_schedule.saved_record(
        {"format": STATE_FORMAT, "device": device},
        measurement,
        measurement is not None and measurement.measured,
        measurer,
    )


def restored_measurement(decision):
    """The `JitMeasurement` of a saved decision, marked restored."""
    return JitMeasurement(**decision, restored=True)


def describe(record):
    """A saved record in a few words, for warnings."""
    if "decision" in record:
        choice = "XLA" if record["decision"]["jit_compile"] else "no XLA"
        return f"a measured jit_compile decision ({choice})"
    progress = record["progress"]
    total = 2 * (progress["warmup_calls"] + progress["timed_calls"])
    return (
        f'jit_compile measuring progress ({progress["units_done"]} of {total} timings '
        f'done, {progress["calls"]} call(s) into the next)'
    )
