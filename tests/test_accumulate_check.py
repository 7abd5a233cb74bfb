"""`accumulate_check=True`: the first window against one large-batch step."""

import numpy as np
import pytest

import keras
import keras_gradboost as kgb
from conftest import shared_mirrored_strategy
from keras_gradboost import GradBoostModel
from keras_gradboost import accumulate_check


def model_with(norm=None, dropout=False, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    if norm == "batch":
        h = keras.layers.BatchNormalization(name="bn")(h)
    elif norm == "layer":
        h = keras.layers.LayerNormalization(name="ln")(h)
    if dropout:
        h = keras.layers.Dropout(0.3, name="drop")(h)
    return GradBoostModel(inputs, keras.layers.Dense(3, name="out")(h))


def data(n=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, (0.5 * np.tanh(x[:, :3])).astype("float32")


def trainable(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def fit(model, batch_size=4, epochs=1, **kwargs):
    x, y = data()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **kwargs)
    return model


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_batch_normalization_is_named_and_nothing_is_updated(steps_per_execution):
    model = model_with("batch")
    model.compile(optimizer="sgd", loss="mse", accumulate_steps=4, accumulate_check=True,
                  steps_per_execution=steps_per_execution)
    before = trainable(model)
    with pytest.raises(kgb.AccumulationCheckError) as info:
        fit(model)
    error = info.value
    assert "'bn'" in str(error) and "BatchNormalization" in error.causes[0]
    assert error.variables and error.variables[0][1] > 0
    assert int(model.optimizer.iterations.numpy()) == 0
    for got, want in zip(trainable(model), before):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("norm, dropout", [(None, False), ("layer", False), ("layer", True)],
                         ids=["plain", "layernorm", "layernorm-dropout"])
def test_an_exact_model_passes_and_trains_as_without_the_check(norm, dropout, monkeypatch):
    windows = []
    original = accumulate_check.check
    monkeypatch.setattr(accumulate_check, "check",
                        lambda model, window: windows.append(len(window)) or original(model, window))
    checked = model_with(norm, dropout)
    checked.compile(optimizer="sgd", loss="mse", accumulate_steps=4, accumulate_check=True)
    unchecked = model_with(norm, dropout)
    unchecked.compile(optimizer="sgd", loss="mse", accumulate_steps=4)
    fit(checked, epochs=2)
    fit(unchecked, epochs=2)
    assert windows == [4]  # checked once, on the first window
    for got, want in zip(trainable(checked), trainable(unchecked)):
        np.testing.assert_array_equal(got, want)  # the check changed nothing


class PerBatchMaxLoss(keras.losses.Loss):
    """Divides by the batch's largest error: not a per-sample mean."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        error = keras.ops.square(y_true - y_pred)
        return keras.ops.sum(error) / keras.ops.stop_gradient(keras.ops.max(error))


def test_a_loss_that_normalises_per_batch_is_named():
    model = model_with()
    model.compile(optimizer="sgd", loss=PerBatchMaxLoss(name="per_batch_max"),
                  accumulate_steps=4, accumulate_check=True)
    with pytest.raises(kgb.AccumulationCheckError) as info:
        fit(model)
    assert any("'per_batch_max'" in cause for cause in info.value.causes)


def test_the_check_runs_under_mirrored_strategy():
    with shared_mirrored_strategy().scope():
        model = model_with("layer")
        model.compile(optimizer="sgd", loss="mse", accumulate_steps=4, accumulate_check=True)
    fit(model)
    assert int(model.optimizer.iterations.numpy()) == 2


def test_bad_arguments_name_accumulate_check():
    model = model_with()
    with pytest.raises(ValueError, match="accumulate_check=True.*accumulate_steps"):
        model.compile(optimizer="sgd", loss="mse", accumulate_check=True)
    with pytest.raises(TypeError, match="accumulate_check"):
        model.compile(optimizer="sgd", loss="mse", accumulate_steps=2, accumulate_check="yes")


def test_micro_batches_of_different_shapes_are_named():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)
    model = GradBoostModel(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse", accumulate_steps=2, accumulate_check=True)
    windows = [(np.ones((2, length), "int32"), np.zeros((2, length, 1), "float32"))
               for length in (3, 5)]
    with pytest.raises(ValueError, match="one shape besides the batch size"):
        model.fit((w for w in windows * 2), steps_per_epoch=2, verbose=0)


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_with_a_nan_watcher_the_check_sees_the_window_once_each(steps_per_execution, monkeypatch):
    """A NaNWatcher's train function is made while the check is pending:
    the check saw every batch twice (the window 0, 0, 1, 1). And a window
    holding a NaN says nothing about accumulation: the next one is checked,
    with a warning, instead of raising on NaN differences."""
    from keras_gradboost.callbacks import NaNWatcher

    windows = []
    real = accumulate_check.check

    def recording(model, window, rtol=None):
        windows.append([np.asarray(keras.utils.unpack_x_y_sample_weight(b)[0]) for b in window])
        return real(model, window, rtol)

    monkeypatch.setattr(accumulate_check, "check", recording)
    x, y = data()
    bad = x.copy()
    bad[9, 1] = np.nan  # batch 2, in the first window (0-3)
    model = model_with()
    model.compile(optimizer="sgd", loss="mse", accumulate_steps=4, accumulate_check=True,
                  steps_per_execution=steps_per_execution)
    with pytest.warns(UserWarning, match="first accumulation window holds a non-finite"):
        model.fit(bad, y, batch_size=4, shuffle=False, verbose=0,
                  callbacks=[NaNWatcher(action="skip", verbose=0)])
    assert len(windows) == 2
    for window, first in zip(windows, (0, 4)):
        for i, got in enumerate(window):
            rows = slice(4 * (first + i), 4 * (first + i + 1))
            np.testing.assert_array_equal(got, bad[rows])


class _BatchBalance(keras.layers.Layer):
    """Adds a loss over the whole batch that is not a mean over samples
    (the square of a batch mean, like a mixture of experts' load
    balancing)."""

    def call(self, x):
        self.add_loss(10.0 * keras.ops.sum(keras.ops.square(keras.ops.mean(x, axis=0))))
        return x


def _balanced_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    h = _BatchBalance(name="balance")(h)
    return GradBoostModel(inputs, keras.layers.Dense(3, name="out")(h))


def test_a_layer_loss_over_the_batch_is_named_by_the_check_and_warned():
    """The check ran the model in a `StatelessScope`, which drops the
    losses layers add: both sides left them out and it passed, while the
    windows trained 0.058 away from the large batch (a keras-hub Mixtral's
    load-balancing loss)."""
    model = _balanced_model()
    model.compile(optimizer="sgd", loss="mse", accumulate_steps=4, accumulate_check=True)
    with pytest.warns(UserWarning, match=r"'balance' add losses of their own"):
        with pytest.raises(kgb.AccumulationCheckError) as info:
            fit(model)
    assert any("'balance'" in cause for cause in info.value.causes), info.value.causes
    assert int(model.optimizer.iterations.numpy()) == 0
