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
