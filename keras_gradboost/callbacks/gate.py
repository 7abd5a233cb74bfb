"""RunGate: tells a callback's function wrapper whether the callback is part
of the running `fit()` / `evaluate()`."""

import keras


class RunGate(keras.callbacks.Callback):
    """The run gate of `CallbackBase` (the base of the callbacks that wrap
    the model's train or test function with
    `keras_gradboost.wrappers.hold_batches`) and of `BackupAndRestore`
    (whose wrapper skips the batches a backup has seen).

    Keras calls `on_train_batch_begin` (`on_test_batch_begin`) right before
    each call of the train (test) function. A wrapper whose callback got no
    such call is not part of the running `fit()`: the run that put it in
    place ended in an exception (raised by another callback, or a
    KeyboardInterrupt between steps), and Keras called no `on_train_end`.
    `self._in_run(function)`, given to `hold_batches` as `is_current`, tells
    the wrapper so, and the wrapper tears the callback down.

    Subclasses that override `on_train_batch_begin` or `on_test_batch_begin`
    call `super()` first.
    """

    def on_train_batch_begin(self, batch, logs=None):
        self._marks().add("train")

    def on_test_batch_begin(self, batch, logs=None):
        self._marks().add("test")

    def _in_run(self, function):
        """Whether Keras announced this call of `function` (uses the mark up)."""
        marks = self._marks()
        announced = function in marks
        marks.discard(function)
        return announced

    def _marks(self):
        return self.__dict__.setdefault("_run_marks", set())
