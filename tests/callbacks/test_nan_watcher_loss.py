"""NaNWatcher judges the loss too, on a plain keras.Model: a NaN
prediction whose gradients are finite (zero) is a bad step."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import shared_mirrored_strategy
from keras_gradboost import GradBoostModel
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import NonFiniteError

BAD_STEP = 5  # of 8 batches of 4


class NaNRows(keras.layers.Layer):
    """Replaces the probabilities of the rows whose last input feature is
    set by NaN, without a gradient: the loss is NaN, every gradient finite
    (what a clipped probability cross-entropy makes of a NaN prediction)."""

    def call(self, inputs):
        x, probs = inputs
        flagged = x[:, -1:] > 0.5
        nan = tf.stop_gradient(tf.fill(tf.shape(probs), np.float32("nan")))
        return tf.where(flagged, nan, probs)


def softmax_model(cls=keras.Model):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    probs = keras.layers.Dense(3, activation="softmax", name="probs")(hidden)
    model = cls(inputs, NaNRows(name="nan_rows")([inputs, probs]))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss="sparse_categorical_crossentropy")
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5)).astype("float32")
    x[:, -1] = 0.0
    x[BAD_STEP * 4 + 1, -1] = 1.0
    return x, rng.integers(0, 3, size=32)


def test_the_planted_nan_has_a_nan_loss_and_finite_gradients():
    model = softmax_model()
    x, y = data()
    rows = slice(BAD_STEP * 4, BAD_STEP * 4 + 4)
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x[rows], y=y[rows], y_pred=model(x[rows]))
    grads = tape.gradient(loss, model.trainable_variables)
    assert not np.isfinite(loss.numpy())
    assert all(np.isfinite(g.numpy()).all() for g in grads)


def reference(x, y, steps):
    """Plain Keras, no watcher, on the batches that must be applied."""
    model = softmax_model()
    for b in steps:
        model.train_on_batch(x[b * 4:b * 4 + 4], y[b * 4:b * 4 + 4])
    return model.get_weights()


def assert_weights(model, expected):
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_stop_on_a_nan_loss_with_finite_gradients(cls):
    model = softmax_model(cls)
    x, y = data()
    watcher = NaNWatcher(action="stop", verbose=0)
    with pytest.raises(NonFiniteError):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[watcher])
    assert [(e.step, e.phase, e.layer) for e in watcher.events] == [
        (BAD_STEP, "forward", "nan_rows")
    ]
    assert_weights(model, reference(x, y, range(BAD_STEP)))


def assert_skips_only_the_bad_step(model):
    x, y = data()
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                        callbacks=[NaNWatcher(action="skip", verbose=0)])
    assert history.history["nonfinite_steps"] == [1.0]
    assert_weights(model, reference(x, y, [b for b in range(8) if b != BAD_STEP]))


def test_skip_drops_the_step_whose_loss_is_nan():
    assert_skips_only_the_bad_step(softmax_model())


def test_mirrored_strategy_each_replica_judges_its_own_loss():
    # Sample 1 of the bad batch is on the first replica; the second one's
    # loss is finite: the step is still bad for both.
    with shared_mirrored_strategy().scope():
        model = softmax_model()
    assert_skips_only_the_bad_step(model)
