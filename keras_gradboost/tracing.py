"""Trace-time listeners on a model's step methods and its optimizer.

`RetraceCounter` and `GradientAuditor` learn what they need while TensorFlow
traces the train step: which input signature it was traced for, and which
variables got a `None` gradient. Both come from Python code that runs only
while tracing, so they cost nothing per step.

Keras captures `model.train_step` when it makes the train function, and
looks `model.optimizer.apply` up while tracing it. A tracer is
installed once per model (per optimizer), as an instance attribute through
the public methods (a `wrappers.patch`, so it stacks with the other
wrappers of these methods), and stays: without a listener it only forwards the call
(at trace time), so no train function has to be traced again for the next
`fit` that listens. Installing one the first time makes the model's step
functions again (`model.train_function = None`, which Keras remakes), so
the next trace goes through it. `uninstall(model)` removes them.
"""

import weakref

import tensorflow as tf

from keras_gradboost import guard
from keras_gradboost import hooks
from keras_gradboost import wrappers
from keras_gradboost.state import replica_local_variable

STEP_METHODS = ("train_step", "test_step", "predict_step")
_STEP_TRACERS = weakref.WeakKeyDictionary()
_GRADIENT_TRACERS = weakref.WeakKeyDictionary()


def _installed(patch):
    """Whether a tracer's `patch` still sits in its attribute's call chain:
    a call goes through it, or something that is not a `wrappers.patch`
    was put on top of it (and may call it). Undone, or with the chain gone
    (someone deleted the attribute), it is not."""
    return patch.state() != "removed"


class StepTracer:
    """Calls `listener(kind, data)` (kind: "train", "test" or "predict")
    each time a step method is traced, for every registered listener."""

    def __init__(self, model):
        self.listeners = []
        # One `wrappers.patch` per step method, in STEP_METHODS order.
        self.patches = [
            wrappers.patch(model, name, self._wrap(name[: -len("_step")]))
            for name in STEP_METHODS
        ]

    def _wrap(self, kind):
        def traced(step, data):
            if self.listeners and tf.inside_function():
                for listener in list(self.listeners):
                    listener(kind, data)
            return step(data)

        return traced


def step_tracer(model):
    """The model's `StepTracer`, installed on first use.

    Returns:
        `(tracer, installed)`: `installed` is True when it was installed now,
        in which case the model's step functions were reset (Keras makes them
        again, through the tracer, when it next needs them).
    """
    tracer = _STEP_TRACERS.get(model)
    if tracer is not None and _installed(tracer.patches[0]):
        return tracer, False
    tracer = StepTracer(model)
    _STEP_TRACERS[model] = tracer
    model.train_function = None
    model.test_function = None
    model.predict_function = None
    return tracer, True


class GradientTracer:
    """Wraps `optimizer.apply`: at trace time it records the paths
    of variables whose gradient is None; at run time, every `every` optimizer
    steps (a variable, so listeners change it without a retrace; a huge
    value turns it off), it stores each variable's gradient sum of squares
    and max |g| in `stats` (one host read gives both)."""

    OFF = 2**62

    def __init__(self, optimizer, strategy, variables=()):
        self.optimizer = optimizer
        self.strategy = strategy
        self.none_paths = ()
        self.traced = False
        # Called at trace time with the paths of variables whose gradient
        # is None.
        self.listeners = []
        with strategy.scope():
            self.every = tf.Variable(self.OFF, dtype=tf.int64, trainable=False)
            self.at = replica_local_variable(-1, "gradient_stats_at", tf.int64)
        self.paths = ()
        self.stats = None
        if variables:
            # Made here, in cross-replica context: under a distribution
            # strategy the trace runs in replica context, where no variable
            # can be made.
            self._make_stats(tuple(_path(v) for v in variables))

        # `apply`, not `apply_gradients`: Keras' `apply_gradients` calls it,
        # and so does a custom train step that calls `optimizer.apply`.
        def apply(original, grads, trainable_variables=None, *args, **kwargs):
            grads = list(grads)
            if tf.inside_function():
                variables = (
                    hooks.optimizer_trainable_variables(optimizer)
                    if trainable_variables is None
                    else list(trainable_variables)
                )
                self._trace(list(zip(grads, variables)))
            return original(grads, trainable_variables, *args, **kwargs)

        self.patch = wrappers.patch(optimizer, "apply", apply)

    def _make_stats(self, paths):
        with self.strategy.scope():
            self.stats = replica_local_variable(tf.zeros((2, len(paths))), "gradient_stats")
        self.paths = paths

    def _trace(self, pairs):
        self.traced = True
        self.none_paths = tuple(_path(v) for g, v in pairs if g is None)
        for listener in list(self.listeners):
            listener(self.none_paths)
        paths = tuple(_path(v) for _, v in pairs)
        if paths != self.paths:
            if tf.distribute.has_strategy():
                return  # variables changed after set-up: no runtime stats
            with tf.init_scope():
                self._make_stats(paths)
        stats, at = self.stats, self.at
        step = tf.cast(self.optimizer.iterations, tf.int64)

        def record():
            # Per variable: sum of squares and max |g| (-1: no gradient).
            sums, maxes = [], []
            for g, _ in pairs:
                if g is None:
                    sums.append(tf.constant(0.0))
                    maxes.append(tf.constant(-1.0))
                    continue
                g = tf.cast(guard.gradient_values(g), tf.float32)
                sums.append(tf.reduce_sum(tf.square(g)))
                maxes.append(tf.reduce_max(tf.abs(g)))
            stats.assign(tf.stack([tf.stack(sums), tf.stack(maxes)]))
            at.assign(step)

        tf.cond(tf.equal(step % self.every, 0), record, lambda: None)


def gradient_tracer(model):
    """The `GradientTracer` of `model.optimizer`, installed on first use.

    Returns:
        `(tracer, installed)`, as `step_tracer`; installing resets the
        model's train function.
    """
    optimizer = model.optimizer
    tracer = _GRADIENT_TRACERS.get(optimizer)
    if tracer is not None and _installed(tracer.patch):
        return tracer, False
    tracer = GradientTracer(
        optimizer, model.distribute_strategy, model.trainable_variables
    )
    _GRADIENT_TRACERS[optimizer] = tracer
    model.train_function = None
    return tracer, True


def uninstall(model):
    """Removes the trace-time wrappers of `RetraceCounter` and
    `GradientAuditor` from `model`.

    They stay installed after `fit` by design (installing them again would
    retrace every step function at the next `fit` that listens); without a
    listener they only forward the call, at trace time. After `uninstall`,
    `model.train_step`, `test_step`, `predict_step` and
    `model.optimizer.apply` are the class methods again (or what
    was there before), and the model's train/test/predict functions are
    reset, so Keras makes them again without the wrappers. A later callback
    that listens installs them again.

    Args:
        model: a Keras model.

    Returns:
        True when something was removed, False when nothing was installed.

    Raises:
        RuntimeError: while a callback listens (during `fit`, `evaluate` or
            `predict`: call it after), or when something other than a
            keras_gradboost wrapper wrapped one of these methods after the
            tracer (remove that wrapper first).

    Example:

    ```python
    import keras
    import numpy as np
    import keras_gradboost

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.rand(32, 4).astype("float32")
    y = np.random.rand(32, 1).astype("float32")
    model.fit(x, y, callbacks=[keras_gradboost.callbacks.RetraceCounter()])
    keras_gradboost.tracing.uninstall(model)  # True: the wrappers are gone
    ```
    """
    targets = []  # (attribute name, tracer, its patch)
    tracer = _STEP_TRACERS.get(model)
    if tracer is not None:
        targets += [(name, tracer, p) for name, p in zip(STEP_METHODS, tracer.patches)]
    optimizer = getattr(model, "optimizer", None)
    gradients = _GRADIENT_TRACERS.get(optimizer) if optimizer is not None else None
    if gradients is not None:
        targets.append(("apply", gradients, gradients.patch))
    for name, owner_tracer, patch in targets:
        if owner_tracer.listeners:
            raise RuntimeError(
                "keras_gradboost.tracing.uninstall(model) was called while a "
                f"callback listens to `{name}` (during fit, evaluate or "
                "predict). Call it after the call returns (a fit that ended "
                "in an exception leaves its callbacks listening until they "
                "run in a fit again)."
            )
        if patch.state() == "covered":
            current = getattr(patch.owner, name)
            raise RuntimeError(
                f"Cannot uninstall the keras_gradboost tracer from `{name}`: "
                f"something else wrapped it since (received {current!r}). "
                "Remove that wrapper first, then call uninstall(model)."
            )
    for _, _, patch in targets:
        patch()  # under other `wrappers.patch` wrappers: they call past it
    if tracer is not None:
        del _STEP_TRACERS[model]
    if gradients is not None:
        del _GRADIENT_TRACERS[optimizer]
    if targets:
        model.train_function = None
        model.test_function = None
        model.predict_function = None
    return bool(targets)


def _path(variable):
    return getattr(variable, "path", None) or variable.name
