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


def test_nonfinite_indicator_is_exact_where_a_sum_is_not():
    # Finite elements whose sum overflows: finite (the exact check decides).
    big = tf.constant([3e38, 3e38], tf.float32)
    assert float(guard.nonfinite_indicator(None, [big])) == 0.0
    half = tf.constant([60000.0, 60000.0], tf.float16)
    assert float(guard.nonfinite_indicator(tf.constant(1.0), [half])) == 0.0
    # +inf and -inf cancel to NaN in a sum, and are caught either way.
    assert float(guard.nonfinite_indicator(None, [tf.constant([np.inf, -np.inf])])) == 1.0
    # In a graph too, next to finite tensors.
    check = tf.function(guard.nonfinite_indicator)
    assert float(check(tf.constant(0.5), [big, tf.constant([np.nan, 1.0])])) == 1.0
    assert float(check(tf.constant(0.5), [big, tf.ones(2)])) == 0.0


def test_nonfinite_indicator_checks_indexed_slices_values():
    def slices(values):
        return tf.IndexedSlices(tf.constant(values), tf.constant([0, 3]), tf.constant([5, 2]))

    assert float(guard.nonfinite_indicator(None, [slices([[1.0, 2.0], [3.0, 4.0]])])) == 0.0
    assert float(guard.nonfinite_indicator(None, [slices([[1.0, np.nan], [3.0, 4.0]])])) == 1.0


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
