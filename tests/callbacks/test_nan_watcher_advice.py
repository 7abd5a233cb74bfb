"""NaNWatcher names the `kgb.ops` replacement when the layer at fault
computes a log, sqrt, norm or division (`keras_gradboost.op_advice`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_gradboost import op_advice
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import NonFiniteError


class Log(keras.layers.Layer):
    def call(self, x):
        return tf.math.log(x)  # NaN in the forward pass for x < 0


class ReluSqrt(keras.layers.Layer):
    def call(self, x):
        return tf.sqrt(tf.nn.relu(x))  # finite value, inf gradient at 0


def _fit_until_caught(fault, bad_row):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(3, name="d1")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(fault(name="fault")(hidden)))
    model.layers[1].set_weights([np.eye(3, dtype="float32"), np.ones(3, "float32")])
    x = np.ones((10, 3), "float32")
    x[7] = bad_row
    model.compile(optimizer="sgd", loss="mse")
    watcher = NaNWatcher(verbose=0)
    with pytest.raises(NonFiniteError) as info:
        model.fit(x, np.ones((10, 2), "float32"), batch_size=5, shuffle=False,
                  verbose=0, callbacks=[watcher])
    return info.value.event


def test_a_log_in_the_forward_pass_is_advised_safe_log():
    event = _fit_until_caught(Log, [-100.0, 1.0, 1.0])
    assert (event.phase, event.layer) == ("forward", "fault")
    assert event.advice.startswith("layer 'fault' computes Log; consider kgb.ops.safe_log(x, eps)")
    assert f"  advice: {event.advice}." in event.report()


def test_a_sqrt_in_the_backward_pass_is_advised_safe_sqrt():
    event = _fit_until_caught(ReluSqrt, [-2.0, 1.0, 1.0])  # relu(-1) = 0
    assert (event.phase, event.layer) == ("backward", "fault")
    assert "computes Sqrt; consider kgb.ops.safe_sqrt(x)" in event.advice


@pytest.mark.parametrize(
    "fn, found, op",
    [
        (lambda x: tf.norm(x, axis=-1), "Sqrt", "kgb.ops.safe_norm"),
        (lambda x: tf.math.reduce_euclidean_norm(x, axis=-1), "EuclideanNorm", "kgb.ops.safe_norm"),
        (lambda x: x / tf.reduce_sum(x, -1, keepdims=True), "RealDiv", "kgb.ops.safe_divide"),
        (lambda x: tf.math.log(tf.reduce_sum(tf.exp(x), -1)), "Exp", "kgb.ops.logsumexp"),
    ],
)
def test_the_ops_of_a_layer_suggest_the_stable_op(fn, found, op):
    layer = keras.layers.Lambda(fn, name="custom")
    advice = op_advice.layer_advice(layer, [tf.ones((2, 3))])
    assert advice.startswith("layer 'custom' computes ") and found in advice and op in advice


def test_a_layer_without_risky_ops_gets_no_advice():
    layer = keras.layers.Dense(2, activation="relu")
    assert op_advice.layer_advice(layer, [tf.ones((2, 3))]) == ""
    assert op_advice.advice({"MatMul", "Relu"}) == ([], [])
