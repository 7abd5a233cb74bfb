"""locate_nonfinite: producer vs propagator, nested blocks, non-layer ops."""

import numpy as np
import tensorflow as tf

import keras
from keras_gradboost.locate import locate_nonfinite


class LogBlock(keras.layers.Layer):
    """A block that holds a Dense and takes log() itself."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3, name="inner_dense", kernel_initializer="ones")

    def call(self, x):
        return tf.math.log(self.inner(x))


class SqrtBlock(keras.layers.Layer):
    """sqrt(relu(Dense(x))): finite forward, infinite gradient at 0."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3, name="inner_dense", kernel_initializer="ones")

    def call(self, x):
        return tf.sqrt(tf.nn.relu(self.inner(x)))


def _model(block):
    inputs = keras.Input((2,))
    h = keras.layers.Dense(2, name="first", kernel_initializer="identity")(inputs)
    h = block(name="block")(h)
    outputs = keras.layers.Dense(1, name="out")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def _batch(x):
    return tf.constant(x, tf.float32), tf.ones((len(x), 1))


def test_block_that_computes_log_itself_is_named_not_its_dense():
    finding = locate_nonfinite(_model(LogBlock), _batch([[-1.0, -1.0]]))
    assert (finding.phase, finding.layer) == ("forward", "block")


def test_backward_producer_is_the_innermost_block():
    finding = locate_nonfinite(_model(SqrtBlock), _batch([[-1.0, -1.0]]))
    assert (finding.phase, finding.layer) == ("backward", "block")
    assert "first/kernel" in finding.variables


def test_non_layer_operation_is_not_blamed_on_a_layer():
    inputs = keras.Input((2,))
    h = keras.layers.Dense(2, name="first", kernel_initializer="identity")(inputs)
    outputs = keras.ops.log(h)  # not a layer
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    finding = locate_nonfinite(model, (tf.constant([[-1.0, 1.0]]), tf.ones((1, 2))))
    assert finding.phase == "forward" and finding.layer is None
    assert "not a layer" in finding.detail


def test_finite_batch_and_state_left_as_it_was():
    inputs = keras.Input((2,))
    h = keras.layers.BatchNormalization(name="bn")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse")
    before = [v.numpy().copy() for v in model.non_trainable_variables]
    finding = locate_nonfinite(model, (tf.constant([[5.0, 3.0], [1.0, 2.0]]), tf.ones((2, 1))))
    assert finding.phase is None
    for v, b in zip(model.non_trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


class LogLoss(keras.layers.Layer):
    """Passes its input on and adds the log of its mean as a loss (a
    layer's own loss, as a mixture of experts adds its balancing loss)."""

    def call(self, x):
        self.add_loss(tf.math.log(tf.reduce_mean(x)))
        return x


def test_a_non_finite_loss_a_layer_adds_names_that_layer():
    finding = locate_nonfinite(_model(LogLoss), _batch([[-1.0, -1.0]]))
    assert (finding.phase, finding.layer) == ("loss", "block")
    assert "adds" in finding.detail
    # A finite one is not blamed: the backward is looked at.
    finding = locate_nonfinite(_model(LogLoss), _batch([[1.0, 2.0]]))
    assert finding.phase is None
