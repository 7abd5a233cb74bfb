"""RetraceCounter: count tf.function retraces and XLA recompiles of the step
functions, and say which input changed and how to fix it."""

import collections
import dataclasses
import math
import statistics
import time
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import tracing
from keras_gradboost import wrappers
from keras_gradboost.callbacks import args
from keras_gradboost.callbacks.base import CallbackBase

_ROOTS = ("x", "y", "sample_weight")

# Per train/test/predict function object (it owns its traces, and XLA's
# executables, one per concrete shape): the signatures it was traced for, the
# concrete signatures it has run with, and the last one. A function made
# anew (after `compile()`) starts empty: its first trace is no retrace.
_COMPILED = weakref.WeakKeyDictionary()


class RetraceError(RuntimeError):
    """Raised by `RetraceCounter(strict=True)` past `max_retraces`.

    Attributes:
        event: the `RetraceEvent` that went past the limit.
    """

    def __init__(self, message, event):
        super().__init__(message)
        self.event = event


# ----------------------------------------------------------------- signatures


_SCALARS = (bool, int, float, complex, str, bytes)


def signature(data, local_results=None):
    """The input signature of one step's `data`, as a tuple of leaves.

    Each leaf is `(path, kind, shape_or_value, dtype)`: kind "tensor" for
    anything with a shape and a dtype (tensors, arrays, specs; unknown dims
    are None), "python" for a Python scalar or string (each new value is a
    new trace). `None` leaves are left out.

    Args:
        data: what the step function receives: `x`, or `(x, y)`, or
            `(x, y, sample_weight)`, nested as Keras allows.
        local_results: for a distributed batch, a strategy's
            `experimental_local_results`: the first replica's part stands for
            a distributed value. Defaults to `None`.

    Returns:
        A hashable tuple.
    """
    leaves = []
    for path, leaf in keras.tree.flatten_with_path(data):
        if leaf is None:
            continue
        name = _path_name(path, isinstance(data, tuple) and len(data) <= 3)
        if isinstance(leaf, tf.distribute.DistributedValues) and local_results:
            leaf = local_results(leaf)[0]
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            shape = leaf.shape
            if isinstance(shape, tf.TensorShape):
                dims = None if shape.rank is None else tuple(shape.as_list())
            else:
                dims = tuple(shape)
            if dims is not None:
                dims = tuple(None if d is None else int(d) for d in dims)
            leaves.append((name, "tensor", dims, tf.as_dtype(leaf.dtype).name))
        elif isinstance(leaf, _SCALARS):
            leaves.append((name, "python", leaf, type(leaf).__name__))
        else:  # tf.function keys other objects by identity
            leaves.append((name, "python", f"<{type(leaf).__name__} {id(leaf):#x}>", "object"))
    return tuple(leaves)


def _path_name(path, xy_tuple):
    if xy_tuple and path:
        head, rest = _ROOTS[path[0]], path[1:]
    else:
        head, rest = "x", path
    return head + "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in rest)


def _shape_text(dims):
    if dims is None:
        return "<unknown rank>"
    inner = ", ".join("None" if d is None else str(d) for d in dims)
    return f"({inner},)" if len(dims) == 1 else f"({inner})"


@dataclasses.dataclass(frozen=True)
class Change:
    """One input that differs between two signatures.

    Attributes:
        path: the input, e.g. `x["tokens"]`.
        kind: "shape", "dtype", "python" (a Python value changed, or a
            Python value replaced a tensor or the reverse), or "structure"
            (the input appeared or disappeared).
        old: the previous shape/dtype/value.
        new: the new one.
        dims: for "shape", the indices of the dimensions that changed.
    """

    path: str
    kind: str
    old: object
    new: object
    dims: tuple = ()

    def text(self):
        if self.kind == "shape":
            if self.old is None or self.new is None or len(self.old) != len(self.new):
                return (
                    f"{self.path}: shape {_shape_text(self.old)} -> "
                    f"{_shape_text(self.new)}, rank changed"
                )
            which = ", ".join(str(d) for d in self.dims)
            return (
                f"{self.path}: shape {_shape_text(self.old)} -> "
                f"{_shape_text(self.new)}, dim {which} varies"
            )
        if self.kind == "dtype":
            return f"{self.path}: dtype {self.old} -> {self.new}"
        if self.kind == "python":
            return f"{self.path}: Python value {self.old!r} -> {self.new!r}"
        return f"{self.path}: {self.old} -> {self.new}"


def diff_signatures(old, new):
    """The `Change`s from signature `old` to signature `new`, by input path."""
    before = {leaf[0]: leaf for leaf in old}
    after = {leaf[0]: leaf for leaf in new}
    changes = []
    for path in list(before) + [p for p in after if p not in before]:
        a, b = before.get(path), after.get(path)
        if a is None or b is None:
            changes.append(
                Change(path, "structure", "absent" if a is None else "present",
                       "absent" if b is None else "present")
            )
            continue
        if a[1] == "python" or b[1] == "python":
            if a[1:] != b[1:]:
                old_value = a[2] if a[1] == "python" else f"tensor {_shape_text(a[2])}"
                new_value = b[2] if b[1] == "python" else f"tensor {_shape_text(b[2])}"
                changes.append(Change(path, "python", old_value, new_value))
            continue
        if a[3] != b[3]:
            changes.append(Change(path, "dtype", a[3], b[3]))
        if a[2] != b[2]:
            dims = ()
            if a[2] is not None and b[2] is not None and len(a[2]) == len(b[2]):
                dims = tuple(i for i, (p, q) in enumerate(zip(a[2], b[2])) if p != q)
            changes.append(Change(path, "shape", a[2], b[2], dims))
    return changes


def suggest_buckets(lengths, max_buckets=4, multiple=8):
    """A few padded lengths that cover `lengths`: quantiles rounded up to a
    multiple of `multiple`, the last one covering the longest."""
    values = sorted({int(n) for n in lengths if n is not None})
    if not values:
        return []

    def up(n):
        return int(math.ceil(n / multiple) * multiple)

    rounded = sorted({up(n) for n in values})
    if len(rounded) <= max_buckets:
        return rounded
    qs = [values[min(len(values) - 1, int(round(len(values) * (i + 1) / max_buckets)) - 1)]
          for i in range(max_buckets)]
    buckets = sorted({up(q) for q in qs} | {up(values[-1])})
    return buckets


def diagnose(changes, seen_shapes=None):
    """A named cause and its fix for a list of `Change`s.

    Args:
        changes: from `diff_signatures`.
        seen_shapes: optional `{path: [shape, ...]}` of the concrete shapes
            seen so far (used to propose bucket sizes).

    Returns:
        `(diagnosis, fix)`, two sentences.
    """
    seen_shapes = seen_shapes or {}
    if any(c.kind == "python" for c in changes):
        paths = ", ".join(c.path for c in changes if c.kind == "python")
        return (
            f"a Python value where a tensor was meant ({paths}): every new "
            "value is a new trace",
            "pass it as a tensor (tf.constant, or a column of the dataset), "
            "or keep the Python value constant",
        )
    if any(c.kind == "dtype" for c in changes):
        paths = ", ".join(c.path for c in changes if c.kind == "dtype")
        return (
            f"a new dtype ({paths})",
            "cast the input to one dtype in the pipeline (dataset.map with "
            "tf.cast), or set an input_signature",
        )
    if any(c.kind == "structure" for c in changes):
        return (
            "the structure of the batch changed (an input appeared or went away)",
            "yield the same structure every step (use a placeholder instead "
            "of leaving an input out)",
        )
    shape_changes = [c for c in changes if c.kind == "shape" and c.dims]
    if shape_changes and all(c.dims == (0,) for c in shape_changes):
        if all(c.new[0] is not None and c.old[0] is not None and c.new[0] < c.old[0]
               for c in shape_changes):
            return (
                "the last batch is smaller than the others",
                "use drop_remainder=True in dataset.batch(), or pad the last "
                "batch to the full batch size",
            )
        return (
            "the batch size varies",
            "use a fixed batch size with drop_remainder=True",
        )
    if shape_changes:
        parts, buckets = [], []
        for c in shape_changes:
            for d in c.dims:
                if d == 0:
                    continue
                lengths = [s[d] for s in seen_shapes.get(c.path, []) if s and len(s) > d]
                parts.append(f"dim {d} of {c.path}")
                if lengths:
                    buckets = suggest_buckets(lengths)
        diagnosis = "a varying length: " + ", ".join(parts or ["a dimension"])
        fix = "pad to a fixed length, or to a few buckets"
        if buckets:
            fix += (
                f" (e.g. keras_gradboost.data.bucket_by_length(ds, "
                f"boundaries={buckets}, batch_size=...))"
            )
        fix += (
            "; or tf.ensure_shape in the pipeline, an input_signature with None "
            "for that dimension, or reduce_retracing=True (none of these stops "
            "XLA from compiling once per length: only padding does)"
        )
        return diagnosis, fix
    return ("the input signature changed", "keep input shapes and dtypes fixed")


@dataclasses.dataclass
class RetraceEvent:
    """One retrace or XLA recompilation of a step function.

    Attributes:
        function: "train", "test" or "predict".
        kind: "retrace" (tf.function traced the step again; under XLA that is
            a recompilation too) or "recompile" (XLA compiled the traced step
            for a new concrete shape, without retracing).
        step: the training step (0-based, counted over the fit) at which it
            happened, or None outside training.
        changes: the differences from the previous signature, one string
            per input, e.g. `x: shape (32, 17) -> (32, 23), dim 1 varies`.
        diagnosis: the named cause.
        fix: what to do about it.
        call_seconds: how long the call that retraced/recompiled took, or
            None when not measured. One call runs `steps_per_execution`
            batches, so several events may share it.
        seconds_lost: an estimate of the time lost: that call's duration
            minus the median duration of ordinary calls of the same function
            (per batch, times the call's batches), shared equally among the
            call's events (None until known).
    """

    function: str
    kind: str
    step: object = None
    changes: tuple = ()
    diagnosis: str = ""
    fix: str = ""
    call_seconds: object = None
    seconds_lost: object = None
    # How many batches the call ran, and how many events share it.
    call_batches: int = dataclasses.field(default=1, repr=False)
    call_events: int = dataclasses.field(default=1, repr=False)

    def report(self):
        lost = (
            ""
            if self.seconds_lost is None
            else f" (about {self.seconds_lost * 1000:.0f} ms lost)"
        )
        where = "" if self.step is None else f" at step {self.step}"
        lines = [f"RetraceCounter: {self.function} step {self.kind}{where}{lost}."]
        lines += [f"  {c}" for c in self.changes]
        lines.append(f"  cause: {self.diagnosis}.")
        lines.append(f"  fix: {self.fix}.")
        return "\n".join(lines)


@dataclasses.dataclass
class RetraceReport:
    """What a `RetraceCounter` counted.

    Attributes:
        retraces: retraces of the step functions (see
            `RetraceCounter.retraces`).
        recompiles: XLA recompilations of a step function for a new
            concrete shape beyond the first.
        per_function: `{"train" | "test" | "predict": {"retraces": n,
            "recompiles": m}}` for the functions that had any.
        events: one `RetraceEvent` per retrace/recompile.
        seconds_lost: the events' estimated time lost, summed (None when
            none is known yet).
    """

    retraces: int = 0
    recompiles: int = 0
    per_function: dict = dataclasses.field(default_factory=dict)
    events: list = dataclasses.field(default_factory=list)
    seconds_lost: object = None

    def summary(self):
        lines = [
            f"RetraceCounter: {self.retraces} retraces, {self.recompiles} XLA "
            "recompiles."
        ]
        if self.seconds_lost is not None:
            lines.append(f"  time lost (estimate): {self.seconds_lost:.2f} s")
        for event in self.events:
            lines.append(event.report())
        return "\n".join(lines)


# ------------------------------------------------------------------ callback


class RetraceCounter(CallbackBase):
    """Counts retraces and XLA recompilations of the step functions, and says
    which input changed and how to fix it.

    A tf.function traces its Python code again for each new input signature
    (a shape, a dtype or a Python value it has not seen); with
    `jit_compile=True`, XLA also compiles again for every new concrete shape,
    even when the function does not retrace (a tf.data pipeline's unknown
    dimensions). Both are slow and silent. The counter sees traces of the
    train, test and predict steps through a trace-time hook (nothing runs per
    step), and the concrete shape of every batch of `fit`, `evaluate` (fit's
    own validation included) and `predict` (read from the batch, with no
    device sync), so it sees XLA recompilations of each function too. The
    concrete shapes a function has run with are remembered for as long as
    that function lives (as XLA keeps its executables), so a second
    `evaluate` over the same lengths counts nothing.

    The first trace of a function is not counted, nor is a second trace with
    the same signature (TensorFlow traces twice when the first call creates
    variables; remade functions trace again).

    `logs["retraces"]` and `logs["recompiles"]` (totals over the three
    functions) show in the progress bar and History, and so in the epoch
    scalars of `keras.callbacks.TensorBoard`. While the counter listens (from
    `on_train_begin`, `on_test_begin` or `on_predict_begin` to the matching
    end) the batches go through `keras_gradboost.wrappers.hold_batches`, which
    traces the step for the dataset's `element_spec` as Keras does, so the
    counter adds no trace of its own. Each wrapper is removed at the matching
    end.

    The trace-time hook (`keras_gradboost.tracing`) stays installed on the
    model's `train_step`, `test_step` and `predict_step` after `fit`, so the
    next `fit` that listens does not retrace; without a listener it only
    forwards the call, at trace time. `keras_gradboost.tracing.uninstall(model)`
    removes it.

    Args:
        max_retraces: warn once when there are more than this many events
            (retraces and recompiles; a retrace under XLA is one event), or
            `None` for no limit. Defaults to `None`.
        strict: raise `RetraceError` when the count exceeds `max_retraces`
            (or at the first retrace/recompile when `max_retraces` is None):
            for CI. Defaults to `False`.
        verbose: print each event's report. Defaults to `0`.

    Attributes:
        retraces: retraces of the step functions since the last `fit` began
            (its validation and later `evaluate`/`predict` calls included;
            beyond the first trace of each).
        recompiles: XLA compilations of a step function for a new concrete
            shape beyond the first (a retrace under XLA counts here too).
        events: one `RetraceEvent` per retrace/recompile.
        per_function: `{"train" | "test" | "predict": {"retraces": n,
            "recompiles": m}}` for the functions that had any.

    Raises:
        ValueError: for a bad argument value.
        TypeError: for an argument of the wrong type.
        RetraceError: with `strict=True`, past the limit.

    Example:

    ```python
    import keras
    import numpy as np
    import tensorflow as tf
    import keras_gradboost

    def sequences():  # batches of length 5, then of length 9
        for length in (5, 9):
            for _ in range(8):
                yield np.ones(length, "int32"), np.float32(1.0)

    ds = tf.data.Dataset.from_generator(
        sequences,
        output_signature=(tf.TensorSpec((None,), tf.int32),
                          tf.TensorSpec((), tf.float32)),
    ).padded_batch(4)
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(10, 4)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    counter = keras_gradboost.callbacks.RetraceCounter(max_retraces=2)
    model.fit(ds, epochs=2, callbacks=[counter])
    print(counter.summary())  # one XLA recompile: dim 1 varies
    ```
    """

    async_safe = True  # no batch-end hook: everything runs in the train call

    def __init__(self, max_retraces=None, strict=False, verbose=0):
        super().__init__()
        self.max_retraces = args.check_int(
            "max_retraces", max_retraces, minimum=0, allow_none=True
        )
        self.strict = args.check_bool("strict", strict)
        self.verbose = args.check_verbose(verbose)
        self._tracer = None
        self._call_undo = {}
        self._reset()

    def _reset(self):
        self.retraces = 0
        self.recompiles = 0
        self.events = []
        self._counts = {}
        self._warned = False
        self._step = 0
        self._pending = []
        self._local_compiled = {}
        self._shapes = collections.defaultdict(lambda: collections.defaultdict(list))
        self._durations = collections.defaultdict(lambda: collections.deque(maxlen=64))
        self._in_call = None
        self._outside = False

    # ------------------------------------------------------------ set-up

    def set_model(self, model):
        super().set_model(model)
        # Before fit() makes its functions: they are made through the tracer.
        self._tracer, _ = tracing.step_tracer(model)

    def _attach(self):
        if self._tracer is None:
            self._tracer, _ = tracing.step_tracer(self.model)
        listeners = self._tracer.listeners
        if self._on_trace not in listeners:
            listeners.append(self._on_trace)
            self._on_teardown(lambda: listeners.remove(self._on_trace))

    def _release(self):
        for function in list(self._call_undo):
            self._unwrap(function)

    def _wrap(self, function):
        """Holds the batches of `function`'s calls while the callback listens."""
        self._unwrap(function)
        model = self.model
        if getattr(model, f"{function}_function", None) is None:
            getattr(model, f"make_{function}_function")()
        self._call_undo[function] = self._wrap_function(
            before_call=lambda batches: self._before_call(function, batches),
            after_call=lambda batches, logs: self._after_call(function, batches, logs),
            function=function,
            # predict_on_batch calls the predict function unannounced.
            gated=function != "predict",
        )

    def _unwrap(self, function):
        undo = self._call_undo.pop(function, None)
        if undo is not None:
            undo()

    def _install(self):
        self._attach()
        self._wrap("train")

    def on_train_end(self, logs=None):
        self._settle()
        self._teardown()

    def on_epoch_end(self, epoch, logs=None):
        self._settle()

    def on_test_begin(self, logs=None):
        self._attach_outside_fit()
        self._wrap("test")

    def on_predict_begin(self, logs=None):
        self._attach_outside_fit()
        self._wrap("predict")

    def on_test_end(self, logs=None):
        self._unwrap("test")
        self._settle()
        self._detach_outside_fit()

    def on_predict_end(self, logs=None):
        self._unwrap("predict")
        self._settle()
        self._detach_outside_fit()

    def _attach_outside_fit(self):
        if not self._undo:  # evaluate()/predict() on their own
            self._attach()
            self._outside = True

    def _detach_outside_fit(self):
        if self._outside:
            self._outside = False
            self._teardown()

    # ----------------------------------------------------------- tracing

    def _on_trace(self, kind, data):
        sig = signature(data)
        seen = self._compiled(kind)["traced"]
        if sig in seen:
            return  # the same signature again: not a retrace
        first = not seen
        previous = seen[-1] if seen else None
        seen.append(sig)
        if first:
            return
        if kind == self._in_call:
            self._pending.append((previous, sig))
            return
        changes = diff_signatures(previous, sig)
        diagnosis, fix = diagnose(changes)
        self._count(kind, retraces=1, recompiles=int(self._jit()))
        self._record(
            RetraceEvent(kind, "retrace", None, tuple(c.text() for c in changes),
                         diagnosis, fix)
        )

    def _jit(self):
        return bool(getattr(self.model, "jit_compile", False))

    def _count(self, function, retraces=0, recompiles=0):
        self.retraces += retraces
        self.recompiles += recompiles
        entry = self._counts.setdefault(function, {"retraces": 0, "recompiles": 0})
        entry["retraces"] += retraces
        entry["recompiles"] += recompiles

    def _compiled(self, function):
        """The concrete signatures the model's current `function` has run
        with (XLA keeps one executable per concrete shape for as long as the
        function lives), and the last one."""
        base = wrappers.base_function(self.model, function)
        fresh = {"traced": [], "seen": set(), "last": None}
        try:
            return _COMPILED.setdefault(base, fresh)
        except TypeError:  # not weak-referenceable: remember for this fit
            return self._local_compiled.setdefault(function, fresh)

    def _before_call(self, function, batches):
        self._in_call = function
        self._pending = []
        self._call_compiled = self._compiled(function)
        local = self.model.distribute_strategy.experimental_local_results
        self._call_sigs = [signature(b, local) for b in batches]
        self._start = time.perf_counter()

    def _after_call(self, function, batches, logs):
        self._in_call = None
        compiled = self._call_compiled
        shapes = self._shapes[function]
        new_sigs = []
        for sig in self._call_sigs:
            for name, kind, dims, _ in sig:
                if kind == "tensor" and len(shapes[name]) < 4096:
                    shapes[name].append(dims)
            if sig not in compiled["seen"]:
                new_sigs.append((compiled["last"], sig))
                compiled["seen"].add(sig)
            compiled["last"] = sig
        jit = self._jit()
        events = []
        pairs = [(o, n) for o, n in new_sigs if o is not None]
        if self._pending:
            self._count(function, retraces=len(self._pending), recompiles=int(jit))
            old, new = _concrete_pair(new_sigs, self._pending)
            events.append(self._event(function, "retrace", old, new))
            pairs = [(o, n) for o, n in pairs if n != new]
        if jit and pairs:
            # With steps_per_execution > 1, one call may compile several
            # new shapes: one event each.
            self._count(function, recompiles=len(pairs))
            events += [self._event(function, "recompile", o, n) for o, n in pairs]
        if events:
            # One sync, only for a call that retraced or recompiled.
            _wait(logs)
            seconds = time.perf_counter() - self._start
            for event in events:
                event.call_seconds = seconds
                event.call_batches = len(batches)
                event.call_events = len(events)
            for event in events:
                self._record(event)
        elif not new_sigs:  # a first compile is not an ordinary call either
            self._durations[function].append(
                (time.perf_counter() - self._start) / len(batches)
            )
        self._pending = []
        if function != "train":
            return None
        self._step += len(batches)
        return {"retraces": self.retraces, "recompiles": self.recompiles}

    def _event(self, function, kind, old, new):
        changes = diff_signatures(old, new) if old is not None else []
        diagnosis, fix = diagnose(changes, self._shapes[function])
        step = self._step if function == "train" else None
        return RetraceEvent(
            function, kind, step, tuple(c.text() for c in changes), diagnosis, fix
        )

    @property
    def per_function(self):
        """`{"train" | "test" | "predict": {"retraces": n, "recompiles": m}}`
        for the functions that had any."""
        return {
            function: dict(counts)
            for function, counts in self._counts.items()
            if counts["retraces"] or counts["recompiles"]
        }

    def _record(self, event):
        self.events.append(event)
        if self.verbose:
            print(event.report(), flush=True)
        count = len(self.events)  # a retrace under XLA is one event
        limit = self.max_retraces
        over = count > (limit if limit is not None else 0)
        if self.strict and over:
            self._settle()
            message = (
                f"RetraceCounter(strict=True): {self.retraces} retraces and "
                f"{self.recompiles} recompiles, over the limit "
                f"max_retraces={limit}.\n" + event.report()
            )
            # Keras calls no on_train_end when fit() raises: undo now, so
            # the model trains as before without the counter.
            self._teardown()
            raise RetraceError(message, event)
        if limit is not None and over and not self._warned:
            self._warned = True
            warnings.warn(
                f"RetraceCounter: {self.retraces} retraces and {self.recompiles} "
                f"XLA recompiles, more than max_retraces={limit}.\n"
                + event.report(),
                stacklevel=2,
            )

    def _settle(self):
        """Fills in `seconds_lost` from the median ordinary call of the same
        function."""
        for event in self.events:
            durations = self._durations.get(event.function)
            if event.call_seconds is not None and durations:
                steady = statistics.median(durations) * event.call_batches
                lost = max(0.0, event.call_seconds - steady)
                event.seconds_lost = lost / event.call_events

    def report(self):
        """The counts and events so far, as a `RetraceReport`."""
        lost = [e.seconds_lost for e in self.events if e.seconds_lost is not None]
        return RetraceReport(
            retraces=self.retraces,
            recompiles=self.recompiles,
            per_function=self.per_function,
            events=list(self.events),
            seconds_lost=sum(lost) if lost else None,
        )

    def summary(self):
        """A readable account of the retraces and recompiles
        (`report().summary()`)."""
        return self.report().summary()


def _concrete_pair(new_sigs, pending):
    """The concrete signatures to explain a retrace with: the call's first
    new concrete signature and the one before it; else the traced ones."""
    for old, new in new_sigs:
        if old is not None:
            return old, new
    return pending[0]


def _wait(logs):
    """Waits for the call's steps to finish by reading one value."""
    for value in tf.nest.flatten(logs):
        if tf.is_tensor(value):
            np.asarray(value)
            return
