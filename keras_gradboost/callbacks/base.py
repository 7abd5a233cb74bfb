"""CallbackBase: what the four callbacks share: the run gate, the wrapper
wiring through `keras_gradboost.wrappers.hold_batches`, one idempotent teardown,
and `report()` / `summary()`."""

from keras_gradboost import wrappers
from keras_gradboost.callbacks.gate import RunGate


class CallbackBase(RunGate):
    """Base of the keras_gradboost callbacks.

    A callback puts wrappers in place for the duration of a run (`fit()`,
    or `evaluate()`/`predict()`) and registers how to undo each one with
    `_on_teardown(undo)`; `_teardown()` undoes them all, last first, and is
    idempotent. Keras calls no `on_train_end` when `fit()` raises, so the
    leftovers of such a run are torn down by the wrappers themselves (their
    `teardown`, see `RunGate`) or at the next `on_train_begin`.

    The conventions, as in Keras' `EarlyStopping`: `on_train_begin` tears
    down what a failed run left, calls `_reset()` (the state of one run, so
    one instance can be reused across `fit()` calls) and then `_install()`
    (put the wrappers in place); `on_train_end` tears down. Subclasses
    override only the hooks they need and declare `async_safe` where true;
    none overrides an `on_*_batch_end` hook (that would turn off Keras'
    async dispatch): everything per call runs in the `hold_batches` wrapper.

    Every callback offers `report()` (a plain dataclass) and `summary()`
    (readable text: `report().summary()`).
    """

    def __init__(self):
        super().__init__()
        self._undo = []

    # ------------------------------------------------------------- run

    def on_train_begin(self, logs=None):
        self._teardown()  # leftovers of a fit() that ended in an exception
        self._reset()
        self._install()

    def on_train_end(self, logs=None):
        self._teardown()

    def _reset(self):
        """Resets the state of one run (called at each `on_train_begin`)."""

    def _install(self):
        """Puts this run's wrappers in place (after `_reset()`)."""

    # -------------------------------------------------------- wrappers

    def _on_teardown(self, undo):
        """Registers `undo` (a callable) for `_teardown()`; returns it."""
        self._undo.append(undo)
        return undo

    def _release(self):
        """What a subclass frees at teardown before the undo functions run
        (a profiler, a summary writer); must be idempotent."""

    def _teardown(self):
        """Undoes every registered wrapper, last first. Idempotent: a second
        call finds nothing left to undo."""
        self._release()
        while self._undo:
            self._undo.pop()()

    def _wrap_function(self, before_call=None, after_call=None, function="train", gated=True):
        """`wrappers.hold_batches` on the model's `function`, wired to this
        callback: its gate (`is_current`, unless `gated=False`) and its
        `_teardown`.

        Returns:
            The wrapper's undo function (not registered: see `_hold`).
        """
        _, undo = wrappers.hold_batches(
            self.model,
            before_call=before_call,
            after_call=after_call,
            function=function,
            is_current=(lambda: self._in_run(function)) if gated else None,
            teardown=self._teardown,
        )
        return undo

    def _hold(self, before_call=None, after_call=None):
        """Wraps the train function for this run (`_wrap_function`), undone
        at `_teardown()`."""
        self._on_teardown(self._wrap_function(before_call, after_call))

    # --------------------------------------------------------- results

    def report(self):
        """What the callback found so far, as a plain dataclass."""
        raise NotImplementedError(f"{type(self).__name__} has no report()")

    def summary(self):
        """`report().summary()`: a readable account."""
        return self.report().summary()
