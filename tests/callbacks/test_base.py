"""CallbackBase: the conventions every callback shares (teardown, hooks it
overrides, async_safe), and the even public face (report() and summary())."""

import dataclasses

import numpy as np
import pytest

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost.callbacks import AuditReport
from keras_gradboost.callbacks import GradientAuditor
from keras_gradboost.callbacks import NaNReport
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import RetraceCounter
from keras_gradboost.callbacks import RetraceReport
from keras_gradboost.callbacks import StepTimeMonitor
from keras_gradboost.callbacks import StepTimeReport
from keras_gradboost.callbacks.base import CallbackBase
from keras_gradboost.callbacks.gate import RunGate

CALLBACKS = (NaNWatcher, StepTimeMonitor, RetraceCounter, GradientAuditor)
BATCH_END_HOOKS = ("on_batch_end", "on_train_batch_end", "on_test_batch_end", "on_predict_batch_end")


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_every_callback_shares_the_base_and_keeps_keras_async(cls):
    assert issubclass(cls, CallbackBase) and issubclass(cls, RunGate)
    assert cls.async_safe is True
    for hook in BATCH_END_HOOKS:  # overriding one turns off async dispatch
        assert getattr(cls, hook) is getattr(keras.callbacks.Callback, hook), hook


class Counting(CallbackBase):
    def __init__(self):
        super().__init__()
        self.undone = []
        self.released = 0

    def _install(self):
        self._on_teardown(lambda: self.undone.append("first"))
        self._on_teardown(lambda: self.undone.append("second"))

    def _release(self):
        self.released += 1


def test_teardown_undoes_last_first_once():
    callback = Counting()
    callback.on_train_begin()
    callback._teardown()
    callback._teardown()
    assert callback.undone == ["second", "first"]
    # A new run tears down what is left first (nothing here), then starts.
    callback.on_train_begin()
    callback.on_train_end()
    assert callback.undone == ["second", "first"] * 2
    with pytest.raises(NotImplementedError, match="Counting has no report"):
        callback.summary()


def _tiny(cls=keras.Model, poison=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="relu", name="hidden")(inputs)
    model = cls(inputs, keras.layers.Dense(1, name="out")(h))
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    if poison:
        x[9] = np.nan  # batch 2 of 4
    return model, x, np.ones((32, 1), "float32")


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_nan_watcher_report_and_summary(cls):
    model, x, y = _tiny(cls, poison=True)
    watcher = NaNWatcher(action="skip", verbose=0)
    empty = watcher.report()
    assert empty == NaNReport(action="skip") and "no non-finite step" in empty.summary()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[watcher])
    report = watcher.report()
    assert isinstance(report, NaNReport) and dataclasses.is_dataclass(report)
    assert report.nonfinite_steps == 1 and report.actions == {"skipped": 1}
    assert [e.step for e in report.events] == [1]
    text = watcher.summary()
    assert text.startswith("NaNWatcher (action='skip'): 1 non-finite steps, 1 events.")
    assert "actions: skipped 1" in text and report.events[0].report() in text
    report.events.clear()  # a copy
    assert len(watcher.events) == 1


def test_retrace_counter_report_and_summary():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse")
    counter = RetraceCounter()
    assert counter.report() == RetraceReport()
    model.fit(np.ones((8, 5), "int32"), np.ones((8, 1)), batch_size=4, verbose=0,
              callbacks=[counter])
    model.predict(np.ones((4, 5), "int32"), verbose=0, callbacks=[counter])
    model.predict(np.ones((4, 9), "int32"), verbose=0, callbacks=[counter])
    report = counter.report()
    assert isinstance(report, RetraceReport)
    assert (report.retraces, report.recompiles) == (1, 0)
    assert report.per_function == {"predict": {"retraces": 1, "recompiles": 0}}
    assert report.events == counter.events and report.events is not counter.events
    text = counter.summary()
    assert text == report.summary()
    assert text.startswith("RetraceCounter: 1 retraces, 0 XLA recompiles.")
    assert report.events[0].report() in text


def test_step_time_monitor_and_gradient_auditor_reports():
    model, x, y = _tiny()
    monitor = StepTimeMonitor(window=2, split_at=None)
    auditor = GradientAuditor(every_n_steps=2, verbose=0)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor, auditor])
    assert isinstance(monitor.report(), StepTimeReport) and monitor.report().steps == 4
    assert monitor.summary().startswith("StepTimeMonitor")
    assert isinstance(auditor.report(), AuditReport) and auditor.report().checks >= 1
    assert auditor.summary().startswith("GradientAuditor: ")
