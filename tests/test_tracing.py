"""The trace-time wrappers stay after fit by default; uninstall removes them."""

import numpy as np
import pytest
from conftest import max_weight_diff
from conftest import small_model

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost import tracing
from keras_gradboost.callbacks import GradientAuditor
from keras_gradboost.callbacks import RetraceCounter

STEPS = ("train_step", "test_step", "predict_step")


def _callbacks():
    return [RetraceCounter(), GradientAuditor(verbose=0)]


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_wrappers_stay_by_default_and_uninstall_removes_them(cls, regression_data):
    x, y = regression_data
    model, plain = small_model(cls), small_model(cls)
    for m in (model, plain):
        m.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=8, verbose=0, callbacks=_callbacks())
    plain.fit(x, y, batch_size=8, verbose=0)
    # Default: still installed after fit (no retrace at the next listening fit).
    assert all(name in vars(model) for name in STEPS)
    assert "apply" in vars(model.optimizer)

    assert tracing.uninstall(model) is True
    for name in STEPS:
        assert name not in vars(model)
        assert getattr(model, name).__func__ is getattr(type(model), name)
    assert "apply" not in vars(model.optimizer)
    assert model.optimizer.apply.__func__ is type(model.optimizer).apply
    assert model.train_function is None and model.predict_function is None
    assert tracing.uninstall(model) is False  # nothing left

    # Training goes on exactly like the plain model's.
    model.fit(x, y, batch_size=8, verbose=0)
    plain.fit(x, y, batch_size=8, verbose=0)
    assert max_weight_diff(model, plain) == 0.0
    np.testing.assert_array_equal(model.predict(x, verbose=0), plain.predict(x, verbose=0))
    assert all(name not in vars(model) for name in STEPS)

    # A callback that listens installs them again, and still counts.
    counter = RetraceCounter()
    counter.set_model(model)
    counter.on_train_begin()  # as a custom loop does
    assert all(name in vars(model) for name in STEPS)
    model.train_on_batch(x[:10], y[:10])  # traced for (10, 5)
    model.train_on_batch(x[:4], y[:4])  # retraced
    counter.on_train_end()
    assert counter.retraces == 1
    assert counter.events[0].diagnosis == "the last batch is smaller than the others"


def test_uninstall_keeps_an_instance_attribute_that_was_there_before(regression_data):
    x, y = regression_data
    model = small_model()
    model.compile(optimizer="sgd", loss="mse")
    calls = []

    def own_test_step(data):
        calls.append(1)
        return type(model).test_step(model, data)

    model.test_step = own_test_step
    model.fit(x, y, batch_size=8, verbose=0, callbacks=_callbacks())
    tracing.uninstall(model)
    assert model.test_step is own_test_step
    model.evaluate(x, y, verbose=0)
    assert calls  # traced through the user's own step


def test_uninstall_refuses_while_listening_or_when_wrapped_over(regression_data):
    x, y = regression_data
    model = small_model()
    model.compile(optimizer="sgd", loss="mse")

    class Uninstall(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            tracing.uninstall(self.model)

    counter = RetraceCounter()
    with pytest.raises(RuntimeError, match="while a callback listens"):
        model.fit(x, y, verbose=0, callbacks=[counter, Uninstall()])
    model.fit(x, y, verbose=0, callbacks=[counter])  # cleans up its leftovers
    ours = model.train_step
    model.train_step = lambda data: ours(data)
    with pytest.raises(RuntimeError, match="something else wrapped it"):
        tracing.uninstall(model)
    assert model.predict_step is not type(model).predict_step  # nothing touched
    assert "predict_step" in vars(model)


def test_uninstall_under_another_keras_gradboost_wrapper(regression_data):
    from keras_gradboost import wrappers

    x, y = regression_data
    model = small_model()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, verbose=0, callbacks=_callbacks())
    calls = []
    top = wrappers.patch(
        model, "train_step", lambda step, data: calls.append(1) or step(data)
    )
    assert tracing.uninstall(model) is True  # the patch on top calls past it
    assert [p.around for p in wrappers.patches(model, "train_step")] == [top.around]
    model.fit(x, y, batch_size=8, verbose=0)
    assert calls  # traced through the patch, straight to the class method
    top()
    assert "train_step" not in vars(model)
