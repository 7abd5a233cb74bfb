"""Built-in demo models and synthetic data for the command line and benchmarks."""

import numpy as np

import keras


def mlp(input_dim=784, hidden=(1024, 1024), classes=10, cls=None, seed=0):
    """An MLP classifier `input_dim-hidden...-classes` with a softmax output.

    Args:
        input_dim: number of input features. Defaults to `784`.
        hidden: widths of the relu hidden layers. Defaults to `(1024, 1024)`.
        classes: number of classes. Defaults to `10`.
        cls: the model class to build, `keras.Model` or `GradBoostModel`.
            Defaults to `GradBoostModel`.
        seed: weight initialisation seed. Defaults to `0`.

    Returns:
        An uncompiled functional model.
    """
    if cls is None:
        from keras_gradboost.model import GradBoostModel

        cls = GradBoostModel
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,), name="features")
    x = inputs
    for i, width in enumerate(hidden):
        x = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="probs")(x)
    return cls(inputs, outputs, name="mlp")


@keras.saving.register_keras_serializable(package="keras_gradboost")
class ResidualBlock(keras.layers.Layer):
    """Pre-norm residual MLP block: `x + Dense(Dense(LayerNorm(x)))`.

    Args:
        width: input and output width.
        expansion: the inner layer is `expansion * width` wide, with
            `activation`. Defaults to `4`.
        activation: the inner activation. Defaults to `"gelu"`.
    """

    def __init__(self, width, expansion=4, activation="gelu", **kwargs):
        super().__init__(**kwargs)
        self.width, self.expansion, self.activation = width, expansion, activation
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.up = keras.layers.Dense(expansion * width, activation=activation, name="up")
        self.down = keras.layers.Dense(width, name="down")

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.up.build(input_shape)
        self.down.build(tuple(input_shape[:-1]) + (self.expansion * self.width,))

    def call(self, x):
        return x + self.down(self.up(self.norm(x)))

    def get_config(self):
        return {
            **super().get_config(),
            "width": self.width,
            "expansion": self.expansion,
            "activation": self.activation,
        }


def residual_mlp(
    input_dim=784, width=256, blocks=16, expansion=4, classes=10, cls=None, seed=0
):
    """A deep residual MLP classifier whose training memory is mostly
    activations: `blocks` `ResidualBlock`s between a projection and a
    softmax head.

    Args:
        input_dim: number of input features. Defaults to `784`.
        width: the residual stream's width. Defaults to `256`.
        blocks: number of residual blocks. Defaults to `16`.
        expansion: inner width factor of each block. Defaults to `4`.
        classes: number of classes. Defaults to `10`.
        cls: the model class, `keras.Model` or `GradBoostModel`. Defaults to
            `GradBoostModel`.
        seed: weight initialisation seed. Defaults to `0`.

    Returns:
        An uncompiled functional model; its blocks are named `block_<i>`.
    """
    if cls is None:
        from keras_gradboost.model import GradBoostModel

        cls = GradBoostModel
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,), name="features")
    x = keras.layers.Dense(width, name="project")(inputs)
    for i in range(blocks):
        x = ResidualBlock(width, expansion, name=f"block_{i}")(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="probs")(x)
    return cls(inputs, outputs, name="residual_mlp")


def classification_data(samples, input_dim=784, classes=10, seed=0):
    """Synthetic, learnable classification data: labels from a random linear
    teacher, so a model's loss goes down when it trains.

    Returns:
        `(x, y)`: float32 features of shape `(samples, input_dim)` and int32
        labels of shape `(samples,)`.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, input_dim)).astype("float32")
    teacher = rng.normal(size=(input_dim, classes)).astype("float32")
    y = np.argmax(x @ teacher, axis=1).astype("int32")
    return x, y
