"""Models and helpers shared by the recompute tests."""

import numpy as np
import tensorflow as tf

import keras
from keras_gradboost import GradBoostModel

WIDTH = 8


@keras.saving.register_keras_serializable(package="test_recompute")
class ResBlock(keras.layers.Layer):
    """x + Dense(BN(Dropout(Dense(x)))): random masks and moving statistics."""

    def __init__(self, width=WIDTH, rate=0.3, seed=3, **kwargs):
        super().__init__(**kwargs)
        self.width, self.rate, self.seed = width, rate, seed
        self.up = keras.layers.Dense(2 * width, activation="gelu")
        self.drop = keras.layers.Dropout(rate, seed=seed)
        self.norm = keras.layers.BatchNormalization()
        self.down = keras.layers.Dense(width)

    def build(self, input_shape):
        self.up.build(input_shape)
        inner = tuple(input_shape[:-1]) + (2 * self.width,)
        self.norm.build(inner)
        self.down.build(inner)

    def call(self, x, training=None):
        h = self.drop(self.up(x), training=training)
        return x + self.down(self.norm(h, training=training))

    def get_config(self):
        return {**super().get_config(), "width": self.width, "rate": self.rate, "seed": self.seed}


def residual_model(cls=GradBoostModel, blocks_count=3, shared=False, seed=0, rate=0.3):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(WIDTH, name="stem")(inputs)
    if shared:
        block = ResBlock(rate=rate, name="res_shared")
        h = block(block(h))
    else:
        for i in range(blocks_count):
            h = ResBlock(rate=rate, name=f"res_{i}")(h)
    outputs = keras.layers.Dense(3, name="head")(h)
    return cls(inputs, outputs)


def flat_model(cls=GradBoostModel, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = inputs
    for i in range(4):
        h = keras.layers.Dense(16, activation="gelu", name=f"up_{i}")(h)
        h = keras.layers.Dropout(0.2, seed=i, name=f"drop_{i}")(h)
        h = keras.layers.Dense(WIDTH, name=f"down_{i}")(h)
    outputs = keras.layers.Dense(3, name="head")(h)
    return cls(inputs, outputs)


def wide_model(count=4, width=64):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    h = inputs
    for i in range(count):
        h = ResBlock(width=width, name=f"res_{i}")(h)
    return GradBoostModel(inputs, keras.layers.Dense(3)(h))


def train(model, x, y, epochs=1, **compile_kwargs):
    # SGD: an update proportional to the gradient, so rounding-level
    # differences between two graphs (grappler fuses MatMul+BiasAdd+Gelu
    # only where the backward does not need the intermediates) stay at
    # rounding level. Adam divides by sqrt(v) and can blow a 1e-9 difference
    # in a near-zero gradient up to the learning rate.
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    return model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)


def all_state(model):
    return [np.asarray(v) for v in model.variables]


def assert_same_state(a, b, atol=1e-6):
    for va, vb, var in zip(all_state(a), all_state(b), a.variables):
        np.testing.assert_allclose(va, vb, atol=atol, rtol=0, err_msg=var.path)


class TfRandomBlock(keras.layers.Layer):
    """Scales by `tf.random.uniform`: TensorFlow's stateful random op, whose
    state the recompute cannot put back (its replay draws other numbers)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(WIDTH)

    def call(self, x):
        h = self.dense(x)
        return h * tf.cast(tf.random.uniform(tf.shape(h), 0.5, 1.5), h.dtype)
