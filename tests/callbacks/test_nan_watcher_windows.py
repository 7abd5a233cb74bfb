"""NaNWatcher "stop" / "restore" with accumulate_steps: no update at or after
the bad micro-batch, wherever it sits in its window and chunk."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import max_weight_diff
from keras_gradboost import GradBoostModel
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import NonFiniteError

K = 4  # micro-batches per update
BATCH = 5


class BadLog(keras.layers.Layer):
    def call(self, x):
        return tf.math.log(x)


def _model(cls=keras.Model):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="d1", kernel_initializer="ones")(inputs)
    outputs = keras.layers.Dense(2, name="out")(BadLog(name="fault")(h))
    return cls(inputs, outputs)


def _data(bad_step, batches=16):
    x = np.abs(np.random.default_rng(1).normal(size=(batches * BATCH, 3))).astype("float32") + 1.0
    x[bad_step * BATCH + 2] = -100.0
    y = np.random.default_rng(2).normal(size=(batches * BATCH, 2)).astype("float32")
    return x, y


def _large_batch_reference(x, y, windows):
    """Plain Keras: one step on each whole window's concatenated batches."""
    ref = _model()
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for w in range(windows):
        rows = slice(w * K * BATCH, (w + 1) * K * BATCH)
        ref.train_on_batch(x[rows], y[rows])
    return ref


@pytest.mark.parametrize("steps_per_execution", [1, 2, 4])
@pytest.mark.parametrize("position", [0, 1, 2, 3])
def test_stop_keeps_the_weights_before_the_bad_micro_batch(position, steps_per_execution):
    bad_step = K + position  # in the second window
    x, y = _data(bad_step)
    model = _model(GradBoostModel)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        accumulate_steps=K,
        steps_per_execution=steps_per_execution,
    )
    watcher = NaNWatcher(action="stop", verbose=0)
    with pytest.raises(NonFiniteError) as info:
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watcher])
    assert info.value.event.step == bad_step
    # Only the first window's update; the bad micro-batch's window (its good
    # micro-batches included) is discarded.
    assert int(model.optimizer.iterations.numpy()) == 1
    ref = _large_batch_reference(x, y, windows=1)
    diff = max_weight_diff(model, ref)
    assert diff < 1e-6


@pytest.mark.parametrize("position", [1, 3])
def test_restore_starts_a_fresh_window_after_the_roll_back(position):
    # The bad micro-batch's window is discarded. The watcher reads one call
    # late: the step after the bad one runs halted, then the weights go back
    # to the epoch's start, the learning rate halves and the next update
    # holds only micro-batches drawn after the roll-back.
    bad_step = K + position
    x, y = _data(bad_step)
    model = _model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", accumulate_steps=K)
    model.fit(x[: K * BATCH], y[: K * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    watcher = NaNWatcher(action="restore", verbose=0, lr_factor=0.5)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watcher])
    assert [(e.step, e.action_taken) for e in watcher.events] == [(bad_step, "restored")]

    ref = _large_batch_reference(x, y, windows=1)  # the epoch's start
    ref.optimizer.learning_rate = 0.025
    steps = list(range(bad_step + 2, 16))
    for first in range(0, len(steps), K):
        group = steps[first : first + K]
        rows = slice(group[0] * BATCH, (group[-1] + 1) * BATCH)
        ref.train_on_batch(x[rows], y[rows])
    diff = max_weight_diff(model, ref)
    assert diff < 1e-6


def _restored_and_fresh_adam(make, make_reference, bad_step):
    """Fits `make()` (Adam 0.01) with a restoring watcher over 8 batches, a
    NaN at `bad_step`; returns it and the reference: `make_reference()` with
    a fresh Adam at half the learning rate, trained from the step after the
    one that ran halted."""
    x, y = _data(bad_step, batches=8)
    model = make()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    watcher = NaNWatcher(action="restore", verbose=0, lr_factor=0.5)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watcher])
    assert [(e.step, e.action_taken) for e in watcher.events] == [(bad_step, "restored")]
    ref = make_reference()
    ref.compile(optimizer=keras.optimizers.Adam(0.005), loss="mse")
    for step in range(bad_step + 2, 8):  # the step after the bad one ran halted
        rows = slice(step * BATCH, (step + 1) * BATCH)
        ref.train_on_batch(x[rows], y[rows])
    return model, ref


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_restore_in_the_first_epoch_rolls_back_the_optimizer_too(cls):
    # A NaN in the first epoch (the common case: a learning rate too high):
    # the roll-back must reset Adam's moments and step count as well, so the
    # run goes on exactly like a fresh Adam at half the learning rate.
    bad_step = 2
    model, ref = _restored_and_fresh_adam(lambda: _model(cls), _model, bad_step)
    weight_diff = max_weight_diff(model, ref)
    assert weight_diff < 1e-6
    assert int(model.optimizer.iterations.numpy()) == 8 - bad_step - 2
    for mine, theirs in zip(model.optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), rtol=1e-5, atol=1e-7)


def test_restore_on_a_model_built_by_its_first_step():
    # A Sequential without an Input is built by fit's first trace: the
    # snapshot is taken once it is built, before its first update.
    bad_step = 3
    x, y = _data(bad_step, batches=8)

    def sequential():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.layers.Dense(4, name="d1", kernel_initializer="ones"),
             BadLog(name="fault"), keras.layers.Dense(2, name="out")]
        )

    model, ref = _restored_and_fresh_adam(sequential, sequential, bad_step)
    diff = max_weight_diff(model, ref)
    assert diff < 1e-6
    clean = sequential()  # and a clean fit with the watcher just trains
    clean.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x_clean = np.abs(x) + 1.0
    clean.fit(x_clean, y, batch_size=BATCH, verbose=0, callbacks=[NaNWatcher(action="restore", verbose=0)])
    assert int(clean.optimizer.iterations.numpy()) == 8
