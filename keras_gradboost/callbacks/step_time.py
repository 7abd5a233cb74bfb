"""StepTimeMonitor: steady-state step time, the first step's compile cost,
and one step split into input wait, forward, backward and optimizer."""

import dataclasses
import math
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import cluster
from keras_gradboost import hooks
from keras_gradboost.callbacks import args
from keras_gradboost.callbacks.base import CallbackBase

SPLIT_REPEATS = 7


# ------------------------------------------------------------- pure maths


class WindowTimer:
    """Step time over windows of steps, from clock readings taken only at
    window boundaries (where the caller has synced with the device).

    Args:
        window: steps per window (a window closes at the first call boundary
            at or past it).
    """

    def __init__(self, window):
        self.window = window
        self.ms_per_step = []
        self.examples_per_s = []
        self._start = None
        self._steps = 0
        self._examples = 0

    @property
    def running(self):
        return self._start is not None

    def start(self, now):
        """Opens a window at time `now` (seconds)."""
        self._start = now
        self._steps = 0
        self._examples = 0

    def discard(self):
        """Drops the open window (e.g. at an epoch boundary)."""
        self._start = None

    def add(self, steps, examples):
        self._steps += steps
        self._examples += examples

    def due(self):
        return self._start is not None and self._steps >= self.window

    def close(self, now):
        """Closes the open window at `now`; returns `(ms per step,
        examples per second)` and opens the next window at `now`."""
        elapsed = max(now - self._start, 1e-12)
        ms = 1000.0 * elapsed / self._steps
        eps = self._examples / elapsed
        self.ms_per_step.append(ms)
        self.examples_per_s.append(eps)
        self.start(now)
        return ms, eps

    def median(self):
        return statistics.median(self.ms_per_step) if self.ms_per_step else None

    def p90(self):
        return percentile(self.ms_per_step, 90)


def percentile(values, q):
    """The q-th percentile (linear interpolation), or None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def advice(step_ms, backward_share, input_share=None):
    """The article's rules of thumb for a measured step, as sentences."""
    tips = []
    if backward_share is not None:
        pct = f"{100 * backward_share:.0f}%"
        if backward_share < 0.30:
            tips.append(
                f"backward is {pct} of the step (< 30%): the backward pass is "
                "not the bottleneck; look at the input pipeline (tf.data "
                "prefetch, cache, parallel map) and per-step overhead first"
            )
        elif backward_share > 0.50:
            tips.append(
                f"backward is {pct} of the step (> 50%): the autodiff "
                "techniques pay: XLA (jit_compile=True), mixed precision, "
                "recompute, gradient accumulation"
            )
        else:
            tips.append(
                f"backward is {pct} of the step (30-50%): balanced; profile "
                "(profile_steps=) before optimising one side"
            )
    if input_share is not None and input_share > 0.30:
        tips.append(
            f"input wait and overhead are {100 * input_share:.0f}% of the step: "
            "the input pipeline or Python overhead holds the device back"
        )
    if step_ms is not None and step_ms < 10:
        tips.append(
            f"the step takes {step_ms:.1f} ms (< 10 ms): XLA's compile cost may "
            "not pay; a larger batch or steps_per_execution cuts the per-step "
            "overhead"
        )
    return tuple(tips)


@dataclasses.dataclass
class StepSplit:
    """One step split into parts, in milliseconds.

    Attributes:
        step_ms: the measured steady step time the parts add up to.
        input_ms: input wait and per-step overhead: the step time minus the
            compiled full step (0 when the full step alone took longer).
        forward_ms: compiled forward pass and loss.
        backward_ms: compiled forward+backward minus forward.
        optimizer_ms: compiled full step minus forward+backward.
        backward_share: `backward_ms / step_ms`.
        compile_ms: first-call (trace and compile) time of the three probe
            functions together, not part of the parts.
        at_step: the step whose batch was measured.
    """

    step_ms: float
    input_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    backward_share: float
    compile_ms: float
    at_step: int

    def parts(self):
        return {
            "input wait + overhead": self.input_ms,
            "forward": self.forward_ms,
            "backward": self.backward_ms,
            "optimizer": self.optimizer_ms,
        }


@dataclasses.dataclass
class StepTimeReport:
    """What a `StepTimeMonitor` measured.

    Attributes:
        first_step_ms: the first call of the fit (trace, XLA compile and the
            step itself), in ms; None if not seen.
        median_step_ms: median over windows of the mean step time, in ms.
        p90_step_ms: 90th percentile over windows, in ms.
        examples_per_s: median over windows.
        steps: training steps seen.
        windows: windows measured.
        split: a `StepSplit`, or None if not measured (`split_at=None`, too
            few steps, or a distribution strategy: the probe times one
            device).
        advice: the rules of thumb for this step, as sentences.
        probe_seconds: wall time the split probe took (one-off, outside the
            windows).
        split_note: why `split` is None, or None when it was measured.
    """

    first_step_ms: object = None
    median_step_ms: object = None
    p90_step_ms: object = None
    examples_per_s: object = None
    steps: int = 0
    windows: int = 0
    split: object = None
    advice: tuple = ()
    probe_seconds: object = None
    split_note: object = None

    def summary(self):
        def ms(v):
            return "-" if v is None else f"{v:9.2f} ms"

        lines = ["StepTimeMonitor", f"  {'steps / windows':<28} {self.steps} / {self.windows}"]
        lines.append(f"  {'first step (trace+compile)':<28} {ms(self.first_step_ms)}")
        lines.append(f"  {'steady step, median':<28} {ms(self.median_step_ms)}")
        lines.append(f"  {'steady step, p90':<28} {ms(self.p90_step_ms)}")
        eps = "-" if self.examples_per_s is None else f"{self.examples_per_s:9.1f}"
        lines.append(f"  {'examples/s':<28} {eps}")
        if self.first_step_ms is not None and self.median_step_ms:
            extra = self.first_step_ms - self.median_step_ms
            lines.append(
                f"  {'first-step overhead':<28} {ms(extra)} "
                f"(= {extra / self.median_step_ms:.0f} steady steps)"
            )
        if self.split is not None:
            s = self.split
            lines.append(f"  split of step {s.at_step} (compiled probes, median of {SPLIT_REPEATS}):")
            for name, value in s.parts().items():
                share = value / s.step_ms if s.step_ms else 0.0
                lines.append(f"    {name:<26} {ms(value)} {100 * share:5.1f}%")
            lines.append(f"    {'probe compile (one-off)':<26} {ms(s.compile_ms)}")
            if self.probe_seconds is not None:
                lines.append(f"    {'probe wall time (one-off)':<26} {ms(1000 * self.probe_seconds)}")
        elif self.split_note:
            lines.append(f"  split: {self.split_note}")
        for tip in self.advice:
            lines.append(f"  advice: {tip}.")
        return "\n".join(lines)


# -------------------------------------------------------------- callback


class StepTimeMonitor(CallbackBase):
    """Measures the training step: steady-state time, the first step's
    trace/compile cost, examples/s, and, once, the split of one step into
    input wait, forward, backward and optimizer update.

    Profile first: if backward is under ~30% of the step, the input pipeline
    is the place to look; over ~50%, XLA, mixed precision, recompute and
    accumulation pay. The monitor says which, for this model and batch.

    It reads the clock at window boundaries only (every `window` steps),
    after waiting once for the queued steps to finish, so it adds no host
    sync per batch. The first call of the fit (trace and compile) is timed
    on its own. At `split_at`, it times compiled forward-only,
    forward+backward and full-step functions on the current batch, with the
    same `jit_compile` as the model, without changing the weights or the
    optimizer state (the update goes to throwaway copies; non-trainable and
    metric variables are restored); that one-off cost stays out of the
    windows. Under a distribution strategy the split is not measured.

    Logs `step_ms` and `examples_per_s` (the last window's) from the first
    window on, and `split_forward_ms`, `split_backward_ms`,
    `split_optimizer_ms`, `split_input_ms`, `backward_share` once the split
    is measured: they show in the progress bar and History.

    Args:
        window: steps per timing window. Defaults to `20`.
        split_at: the step after which to measure the split: `"auto"` (at the
            end of the first window), an int >= 1, or `None` (never).
            Defaults to `"auto"`.
        log_dir: a directory for TensorBoard scalars (`step_ms`,
            `examples_per_s` and the split), or `None`. Defaults to `None`.
        profile_steps: `(first, last)` training steps (0-based, inclusive) to
            capture with `tf.profiler` into `log_dir` (TensorBoard's profile
            tab), or `None`. Defaults to `None`. Under several workers only
            the chief writes `log_dir` (scalars and profile); every worker
            measures its own steps in `report()`.
        verbose: print the summary at the end of training. Defaults to `0`.

    Raises:
        ValueError: for a bad argument value, or `profile_steps` without
            `log_dir`.
        TypeError: for an argument of the wrong type (e.g. `log_dir`).

    Example:

    ```python
    import keras
    import numpy as np
    import keras_gradboost

    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.rand(64, 4).astype("float32")
    y = np.random.rand(64, 1).astype("float32")
    monitor = keras_gradboost.callbacks.StepTimeMonitor(window=5)
    model.fit(x, y, batch_size=4, epochs=2, callbacks=[monitor])
    print(monitor.summary())
    monitor.report().median_step_ms
    ```
    """

    async_safe = True  # no batch-end hook: everything runs in the train call

    def __init__(self, window=20, split_at="auto", log_dir=None, profile_steps=None, verbose=0):
        super().__init__()
        self.window = args.check_int("window", window, minimum=1)
        self.split_at = _check_split_at(split_at)
        if profile_steps is not None:
            profile_steps = args.check_int_pair("profile_steps", profile_steps)
            if log_dir is None:
                raise ValueError(
                    "Argument `profile_steps` needs `log_dir`: the profiler "
                    f"writes its trace there. Received: profile_steps={profile_steps!r}, "
                    "log_dir=None."
                )
        self.log_dir = args.check_directory("log_dir", log_dir)
        self.profile_steps = tuple(profile_steps) if profile_steps else None
        self.verbose = args.check_verbose(verbose)
        self._reset()

    def _reset(self):
        self._timer = WindowTimer(self.window)
        self._first_ms = None
        self._first_start = None
        self._steps = 0
        self._split = None
        self._probe_seconds = None
        self._logs = {}
        self._profiling = False
        self._profiled = False
        self._writer = None
        self._writes = False

    # ------------------------------------------------------------ hooks

    def _install(self):
        if self.model.train_function is None:
            self.model.make_train_function()
        # Several workers: each measures its own steps (report(), summary()),
        # only the chief writes log_dir (one set of scalars, one profile).
        self._writes = self.log_dir is not None and cluster.is_chief(
            self.model.distribute_strategy
        )
        if self._writes:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        self._hold(self._before_call, self._after_call)

    def on_epoch_begin(self, epoch, logs=None):
        # The epoch boundary (validation, checkpoints) is not step time.
        self._timer.discard()

    def on_train_end(self, logs=None):
        self._teardown()
        if self.verbose:
            print(self.summary(), flush=True)

    def _release(self):
        self._stop_profiler()
        if self._writer is not None:
            self._writer.close()  # flushes; a later fit opens a new one
            self._writer = None

    # ---------------------------------------------------- per train call

    def _before_call(self, batches):
        if (
            self.profile_steps
            and self._writes
            and not self._profiling
            and not self._profiled
            and self._steps + len(batches) > self.profile_steps[0]
        ):
            tf.profiler.experimental.start(self.log_dir)
            self._profiling = True
            self._timer.discard()
        if self._first_ms is None:
            self._first_start = time.perf_counter()
        elif not self._timer.running:
            self._timer.start(time.perf_counter())

    def _after_call(self, batches, logs):
        n = len(batches)
        self._steps += n
        if self._first_ms is None:
            _wait(logs)
            now = time.perf_counter()
            self._first_ms = 1000.0 * (now - self._first_start)
            self._timer.start(now)
            return self._logs or None
        local = self.model.distribute_strategy.experimental_local_results
        self._timer.add(n, sum(_batch_size(b, local) for b in batches))
        if self._timer.due():
            _wait(logs)
            ms, eps = self._timer.close(time.perf_counter())
            self._logs["step_ms"] = ms
            self._logs["examples_per_s"] = eps
            self._scalars({"step_ms": ms, "examples_per_s": eps})
        if self._profiling and self._steps > self.profile_steps[1]:
            _wait(logs)
            self._stop_profiler()
            self._timer.discard()
        if self._split is None and self._split_due():
            _wait(logs)
            started = time.perf_counter()
            self._measure_split(batches[-1])
            self._probe_seconds = time.perf_counter() - started
            self._timer.discard()
        return dict(self._logs) or None

    def _split_due(self):
        if self.split_at is None or self._profiling:
            return False
        if self.model.distribute_strategy is not tf.distribute.get_strategy():
            # One replica's probe is not a distributed step: not measured.
            return False
        if self.split_at == "auto":
            return bool(self._timer.ms_per_step)
        return self._steps >= self.split_at

    def _stop_profiler(self):
        if self._profiling:
            self._profiling = False
            self._profiled = True
            tf.profiler.experimental.stop()

    def _scalars(self, values):
        if self._writer is None:
            return
        with self._writer.as_default():
            for name, value in values.items():
                write_scalar(name, value, self._steps)

    # ------------------------------------------------------------ split

    def _measure_split(self, batch):
        model = self.model
        times, compile_s = split_times(model, batch)
        step_ms = self._timer.median()
        if step_ms is None:  # no window yet: the full probe is the step
            step_ms = 1000.0 * times["full"]
        forward = 1000.0 * times["forward"]
        backward = max(0.0, 1000.0 * (times["forward_backward"] - times["forward"]))
        optimizer = max(0.0, 1000.0 * (times["full"] - times["forward_backward"]))
        if "accumulate" in times:
            # A micro-batch adds its gradients; the update comes once every
            # accumulate_steps micro-batches.
            adding = max(0.0, 1000.0 * (times["accumulate"] - times["forward_backward"]))
            optimizer = adding + optimizer / accumulate_steps(model)
        compute = forward + backward + optimizer
        input_ms = max(0.0, step_ms - compute)
        total = max(step_ms, compute)
        self._split = StepSplit(
            step_ms=total,
            input_ms=input_ms,
            forward_ms=forward,
            backward_ms=backward,
            optimizer_ms=optimizer,
            backward_share=backward / total,
            compile_ms=1000.0 * compile_s,
            at_step=self._steps - 1,
        )
        values = {
            "split_input_ms": input_ms,
            "split_forward_ms": forward,
            "split_backward_ms": backward,
            "split_optimizer_ms": optimizer,
            "backward_share": backward / total,
        }
        self._logs.update(values)
        self._scalars(values)

    # ------------------------------------------------------------ results

    def report(self):
        """The figures so far, as a `StepTimeReport`."""
        timer = self._timer
        median = timer.median()
        split = self._split
        input_share = None if split is None else split.input_ms / split.step_ms
        return StepTimeReport(
            first_step_ms=self._first_ms,
            median_step_ms=median,
            p90_step_ms=timer.p90(),
            examples_per_s=(
                statistics.median(timer.examples_per_s) if timer.examples_per_s else None
            ),
            steps=self._steps,
            windows=len(timer.ms_per_step),
            split=split,
            advice=advice(
                median, None if split is None else split.backward_share, input_share
            ),
            probe_seconds=self._probe_seconds,
            split_note=None if split is not None else self._split_note(),
        )

    def _split_note(self):
        if self.split_at is None:
            return "not measured (split_at=None)"
        if self.model is not None and (
            self.model.distribute_strategy is not tf.distribute.get_strategy()
        ):
            return (
                "not measured under a distribution strategy (the probe would "
                "time one replica's part, not the distributed step)"
            )
        if self.split_at == "auto":
            return "not measured yet (it runs after the first full window)"
        return f"not measured yet (it runs at step {self.split_at})"

    def summary(self):
        """`report().summary()`: a readable table."""
        return self.report().summary()


def _check_split_at(value):
    """`split_at`: "auto", an int >= 1 or None."""
    expected = '"auto", an int >= 1 or None'
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        raise args.value_error("split_at", value, expected)
    if isinstance(value, bool) or not isinstance(value, int):
        raise args.type_error("split_at", value, expected)
    if value < 1:
        raise args.value_error("split_at", value, expected)
    return value


def write_scalar(name, value, step):
    """A TensorBoard scalar through the default summary writer.

    `tf.summary.scalar` needs the tensorboard package; `tf.summary.write`
    with the scalars plugin's metadata writes the same event without it.
    """
    metadata = tf.compat.v1.SummaryMetadata()
    metadata.plugin_data.plugin_name = "scalars"
    metadata.data_class = 1  # DATA_CLASS_SCALAR
    tf.summary.write(
        name, tf.constant(float(value), tf.float32), step=step, metadata=metadata
    )


# ------------------------------------------------------------- the probe


def split_times(model, batch, repeats=SPLIT_REPEATS):
    """Times compiled forward, forward+backward and full-step functions on
    `batch`, leaving the model's weights, optimizer and metrics unchanged.

    The full step applies the update to throwaway copies of the trainable
    variables with a fresh optimizer of the same configuration (same work,
    separate state). Non-trainable variables (BatchNormalization statistics,
    seed generators, a stateful RNN's states) and metric variables are restored afterwards. A
    `GradBoostModel`'s forward goes through its recompute blocks, as in its
    step (so their second forward counts as backward time); with
    `accumulate_steps > 1`, an `"accumulate"` function adds the gradients to
    throwaway sums, as each micro-batch does.

    Returns:
        `({"forward": s, "forward_backward": s, "full": s[, "accumulate": s]},
        compile_s)`: median seconds over `repeats` interleaved runs after
        one warm-up call each, and the warm-up calls' total (trace and
        compile).
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    saved = [(v, np.array(v.numpy())) for v in hooks.forward_state(model)]
    functions = _probe_functions(model)
    try:
        return _time_interleaved(functions, (x, y, sample_weight), repeats)
    finally:
        for v, value in saved:
            v.assign(value)


def _probe_functions(model):
    """The compiled probes `split_times` times: forward, forward+backward,
    the full step on throwaway copies, and (accumulating) the add."""
    from keras_gradboost.model import GradBoostModel

    trainable = list(model.trainable_variables)
    jit = bool(getattr(model, "jit_compile", False))
    gradboost = isinstance(model, GradBoostModel)

    def forward(x, y, sample_weight):
        if gradboost:  # its recompute blocks, as in its step
            y_pred = model.training_forward(x)
        elif hooks.call_has_training_arg(model):
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        return hooks.compute_loss(model, x, y, y_pred, sample_weight, training=True)

    def forward_backward(x, y, sample_weight):
        with tf.GradientTape() as tape:
            loss = forward(x, y, sample_weight)
        grads = tape.gradient(loss, trainable)
        return loss, grads

    copies, optimizer = [], None
    if model.optimizer is not None:
        optimizer = model.optimizer.__class__.from_config(model.optimizer.get_config())
        copies = [
            keras.Variable(v.numpy(), dtype=v.dtype, trainable=True, name=f"copy_{i}")
            for i, v in enumerate(trainable)
        ]
        optimizer.build(copies)

    def full(x, y, sample_weight):
        loss, grads = forward_backward(x, y, sample_weight)
        if optimizer is not None:
            optimizer.apply_gradients(
                [(g, c) for g, c in zip(grads, copies) if g is not None]
            )
        return loss

    def fwd_bwd_out(x, y, sample_weight):
        loss, grads = forward_backward(x, y, sample_weight)
        return loss, [g for g in grads if g is not None]

    functions = {
        "forward": tf.function(forward, jit_compile=jit, autograph=False),
        "forward_backward": tf.function(fwd_bwd_out, jit_compile=jit, autograph=False),
        "full": tf.function(full, jit_compile=jit, autograph=False),
    }
    if accumulate_steps(model) > 1:
        sums = [keras.Variable(np.zeros(c.shape, c.dtype), trainable=False) for c in copies]

        def accumulate(x, y, sample_weight):
            loss, grads = forward_backward(x, y, sample_weight)
            for g, total in zip(grads, sums):
                if g is not None:
                    total.assign_add(tf.convert_to_tensor(g))
            return loss

        functions["accumulate"] = tf.function(accumulate, jit_compile=jit, autograph=False)
    return functions


def _time_interleaved(functions, args, repeats):
    """`({name: median s}, compile_s)`: one warm-up call of each function
    (their total is the compile time), then `repeats` interleaved rounds."""
    samples = {name: [] for name in functions}
    compile_s = 0.0
    for fn in functions.values():
        start = time.perf_counter()
        _sync(fn(*args))
        compile_s += time.perf_counter() - start
    # Interleaved, so a busy spell of the machine hits all three alike.
    for _ in range(repeats):
        for name, fn in functions.items():
            start = time.perf_counter()
            _sync(fn(*args))
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in samples.items()}, compile_s


def accumulate_steps(model):
    """`GradBoostModel`'s `accumulate_steps`; 1 for other models."""
    config = getattr(model, "gradboost_config", None)
    return 1 if config is None else config.accumulate_steps


def _sync(outputs):
    """Waits for a probe call: reads the loss, then syncs every device."""
    np.asarray(tf.nest.flatten(outputs)[0])
    tf.test.experimental.sync_devices()


def _wait(logs):
    """Waits for the queued steps to finish by reading one logs value."""
    for value in tf.nest.flatten(logs):
        if tf.is_tensor(value):
            np.asarray(value)
            return


def _batch_size(batch, local_results):
    """Examples in a batch, from its first tensor's static shape."""
    for value in tf.nest.flatten(batch):
        if isinstance(value, tf.distribute.DistributedValues):
            return sum(_batch_size(v, None) for v in local_results(value))
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) and shape[0] is not None:
            return int(shape[0])
    return 0
