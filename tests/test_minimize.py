"""`GradBoostModel.minimize()`: the update as a building block for custom
train steps, with two optimizers (a GAN's pattern), against the large batch
and the unscaled run."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import shared_mirrored_strategy
from keras_gradboost import GradBoostModel


class TwoOptimizers(GradBoostModel):
    """Two heads, each with its own loss and optimizer (as a GAN's
    generator and discriminator), updated by `minimize()`."""

    def __init__(self, counts=True, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(3, name="a")
        self.b = keras.layers.Dense(3, activation="tanh", name="b")
        self.b_optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        self.counts = counts

    def call(self, x):
        return self.a(x) + self.b(x)

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        count = tf.cast(tf.shape(x)[0], tf.float32) if self.counts else None
        with tf.GradientTape() as tape:
            loss_a = keras.ops.mean(keras.ops.square(self.a(x) - y))
        self.minimize(tape, loss_a, self.a.trainable_weights, count=count)
        with tf.GradientTape() as tape:
            loss_b = keras.ops.mean(keras.ops.square(self.b(x) - 0.5 * y))
        self.minimize(tape, loss_b, self.b.trainable_weights, self.b_optimizer, count=count)
        return {"loss_a": loss_a, "loss_b": loss_b}


def two(counts=True, **compile_kwargs):
    keras.utils.set_random_seed(0)
    model = TwoOptimizers(counts=counts)
    model(np.zeros((1, 5), "float32"))
    model.compile(optimizer=keras.optimizers.Adam(0.01), **compile_kwargs)
    return model


def data(n=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, np.tanh(x[:, :3]).astype("float32")


def fit(model, batch_size, n=32, epochs=2):
    x, y = data(n)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def diff(a, b):
    return max(float(np.max(np.abs(va.numpy() - vb.numpy())))
               for va, vb in zip(a.trainable_variables, b.trainable_variables))


def test_both_optimizers_accumulate_exactly():
    accumulated = fit(two(accumulate_steps=4, loss_scale=None), batch_size=4)
    large = fit(two(loss_scale=None), batch_size=16)
    assert accumulated.optimizer.iterations.numpy() == large.optimizer.iterations.numpy() == 4
    assert accumulated.b_optimizer.iterations.numpy() == large.b_optimizer.iterations.numpy() == 4
    assert diff(accumulated, large) < 2e-6
    # Updating every micro-batch instead would be far off: the test can fail.
    assert diff(fit(two(loss_scale=None), batch_size=4), large) > 1e-3


def test_an_uneven_last_window_with_counts():
    # 28 samples in micro-batches of 8: windows (8, 8, 8, 4) at the epoch's end.
    accumulated = fit(two(accumulate_steps=4, loss_scale=None), batch_size=8, n=28)
    large = fit(two(loss_scale=None), batch_size=28, n=28)
    assert accumulated.b_optimizer.iterations.numpy() == 2
    assert diff(accumulated, large) < 2e-6


@pytest.mark.parametrize("loss_scale", [128.0, "dynamic"])
def test_each_optimizer_gets_loss_scaling(loss_scale):
    scaled = fit(two(accumulate_steps=2, loss_scale=loss_scale), batch_size=4)
    unscaled = fit(two(accumulate_steps=2, loss_scale=None), batch_size=4)
    assert diff(scaled, unscaled) < 2e-6  # powers of two: exact in float32
    assert int(scaled.step_facts.read()["checked_steps"]) == 2 * 16  # both updates


def test_a_nan_loss_of_one_optimizer_is_dropped():
    model = two(accumulate_steps=1, loss_scale=128.0)
    x, y = data(8)
    y[5, 0] = np.nan  # batch 1 of 2: loss_a and loss_b are NaN there
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(model.step_facts.read()["nonfinite_steps"]) == 2
    assert model.optimizer.iterations.numpy() == model.b_optimizer.iterations.numpy() == 1
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


def test_another_optimizer_under_mirrored_strategy_is_refused():
    with shared_mirrored_strategy().scope():
        model = two(accumulate_steps=2, loss_scale=None)
    with pytest.raises(ValueError, match="minimize\\(\\) with an optimizer other"):
        fit(model, batch_size=4, epochs=1)


def test_saving_names_the_windows_it_cannot_keep(tmp_path):
    model = two(accumulate_steps=4, loss_scale=None)
    x, y = data(8)
    for i in range(2):  # two micro-batches: a pending window for each optimizer
        model.train_on_batch(x[4 * i:4 * i + 4], y[4 * i:4 * i + 4])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save_weights(str(tmp_path / "two.weights.h5"))
    assert any("pending accumulation window" in str(w.message) for w in caught)


def test_accumulating_without_a_count_is_refused():
    model = two(counts=False, accumulate_steps=2, loss_scale=None)
    with pytest.raises(ValueError, match="needs `count`"):
        fit(model, batch_size=4, epochs=1)


class NormalisedHeads(TwoOptimizers):
    """TwoOptimizers with a BatchNormalization in front of head `b`: its
    forward writes moving statistics, which a dropped update must put back."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.BatchNormalization(name="norm")

    def call(self, x):
        return self.a(x) + self.b(self.norm(x))

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        count = tf.cast(tf.shape(x)[0], tf.float32)
        with tf.GradientTape() as tape:
            loss_a = keras.ops.mean(keras.ops.square(self.a(x) - y))
        self.minimize(tape, loss_a, self.a.trainable_weights, count=count)
        with tf.GradientTape() as tape:
            loss_b = keras.ops.mean(keras.ops.square(self.b(self.norm(x, training=True)) - y))
        self.minimize(tape, loss_b, self.b.trainable_weights, self.b_optimizer, count=count)
        return {"loss_a": loss_a, "loss_b": loss_b}


def test_a_dropped_update_puts_back_the_moving_statistics():
    """A NaN input in batch 1 of 3, NaNWatcher skipping: both updates are
    dropped and the statistics its forward wrote go back, so the model
    equals one trained on batches 0 and 2 alone (before: the statistics
    kept batch 1's NaN)."""
    from keras_gradboost.callbacks import NaNWatcher

    def heads():
        keras.utils.set_random_seed(0)
        model = NormalisedHeads()
        model(np.zeros((1, 5), "float32"))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss_scale=128.0)
        return model

    x, y = data(12)
    bad = x.copy()
    bad[5, 0] = np.nan
    model = heads()
    watcher = NaNWatcher(action="skip", verbose=0)
    model.fit(bad, y, batch_size=4, shuffle=False, verbose=0, callbacks=[watcher])
    assert [e.step for e in watcher.events] == [1]
    good = np.r_[0:4, 8:12]
    expected = heads()
    expected.fit(x[good], y[good], batch_size=4, shuffle=False, verbose=0)
    for v, e in zip(model.weights, expected.weights):
        assert np.isfinite(v.numpy()).all(), v.path
        np.testing.assert_allclose(v.numpy(), e.numpy(), rtol=1e-5, atol=1e-6, err_msg=v.path)
