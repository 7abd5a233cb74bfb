"""In-graph guards: the optimizer wrapper skips non-finite updates."""

import numpy as np
import tensorflow as tf

import keras
from keras_gradboost import guard


def test_nonfinite_indicator():
    ok = [tf.ones(3), None]
    assert float(guard.nonfinite_indicator(tf.constant(1.0), ok)) == 0.0
    assert float(guard.nonfinite_indicator(tf.constant(np.nan), ok)) == 1.0
    assert float(guard.nonfinite_indicator(None, [tf.constant([1.0, np.inf])])) == 1.0


def test_guard_optimizer_skips_and_counts_then_undoes():
    var = keras.Variable(np.ones(2, "float32"))
    optimizer = keras.optimizers.SGD(1.0)
    optimizer.build([var])
    counter = tf.Variable(0, dtype=tf.int64)
    undo = guard.guard_optimizer(optimizer, counter)

    @tf.function
    def step(g):
        optimizer.apply_gradients([(g, var)])

    step(tf.constant([np.nan, 1.0]))
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0])
    assert int(counter.numpy()) == 1 and int(optimizer.iterations.numpy()) == 0
    step(tf.constant([0.5, 0.5]))
    np.testing.assert_array_equal(var.numpy(), [0.5, 0.5])
    assert int(counter.numpy()) == 1 and int(optimizer.iterations.numpy()) == 1
    undo()
    assert "apply" not in vars(optimizer)


def test_guard_covers_apply_without_variables_and_keeps_a_previous_wrapper():
    # A custom train step may call `optimizer.apply(grads)` on a built
    # optimizer: guarded too.
    var = keras.Variable(np.ones(2, "float32"))
    optimizer = keras.optimizers.SGD(1.0)
    optimizer.build([var])
    calls = []
    own = optimizer.apply

    def earlier(grads, trainable_variables=None):  # another wrapper, first
        calls.append(1)
        return own(grads, trainable_variables)

    optimizer.apply = earlier
    counter = tf.Variable(0, dtype=tf.int64)
    undo = guard.guard_optimizer(optimizer, counter)

    @tf.function
    def step(g):
        optimizer.apply([g])

    step(tf.constant([np.inf, 1.0]))
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0])
    assert int(counter.numpy()) == 1
    step(tf.constant([0.5, 0.5]))
    np.testing.assert_array_equal(var.numpy(), [0.5, 0.5])
    undo()
    assert vars(optimizer)["apply"] is earlier  # the earlier wrapper stays
