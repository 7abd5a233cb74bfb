"""Built-in demo models and synthetic data for the command line and benchmarks.

Models: `mlp`, `residual_mlp`, `cnn`, `transformer` (small enough to train
in seconds on a 2-core CPU at the default sizes). Data: `classification_data`
(features), `image_data` (images), `sequence_data` (token ids); labels come
from a random teacher, so the loss goes down when a model trains.
"""

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
    cls = _model_class(cls)
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
    cls = _model_class(cls)
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,), name="features")
    x = keras.layers.Dense(width, name="project")(inputs)
    for i in range(blocks):
        x = ResidualBlock(width, expansion, name=f"block_{i}")(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="probs")(x)
    return cls(inputs, outputs, name="residual_mlp")


def cnn(
    input_shape=(32, 32, 3), filters=(16, 32), classes=10, cls=None, seed=0
):
    """A small convolutional image classifier: per stage two 3x3 relu
    convolutions and a 2x2 max pooling, then global average pooling and a
    softmax head.

    Args:
        input_shape: `(height, width, channels)` of the images. Defaults to
            `(32, 32, 3)`.
        filters: the convolution width of each stage. Defaults to `(16, 32)`.
        classes: number of classes. Defaults to `10`.
        cls: the model class, `keras.Model` or `GradBoostModel`. Defaults to
            `GradBoostModel`.
        seed: weight initialisation seed. Defaults to `0`.

    Returns:
        An uncompiled functional model.

    Example:

    >>> x, y = image_data(64)
    >>> model = cnn()
    >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    >>> history = model.fit(x, y, batch_size=32, verbose=0)
    """
    cls = _model_class(cls)
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(tuple(input_shape), name="images")
    x = inputs
    for i, width in enumerate(filters):
        for j in range(2):
            x = keras.layers.Conv2D(
                width, 3, padding="same", activation="relu", name=f"conv_{i}_{j}"
            )(x)
        x = keras.layers.MaxPooling2D(2, name=f"pool_{i}")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="probs")(x)
    return cls(inputs, outputs, name="cnn")


@keras.saving.register_keras_serializable(package="keras_gradboost")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a `(batch, length, dim)`
    sequence.

    Args:
        length: the sequence length.
    """

    def __init__(self, length, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=(self.length, input_shape[-1]),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="positions",
        )

    def call(self, x):
        return x + keras.ops.cast(self.positions, x.dtype)

    def get_config(self):
        return {**super().get_config(), "length": self.length}


@keras.saving.register_keras_serializable(package="keras_gradboost")
class EncoderBlock(keras.layers.Layer):
    """Pre-norm transformer encoder block: self-attention, then a two-layer
    feed-forward network, each with a residual connection.

    `x + MHA(LN(x))`, then `x + Dense(Dense(LN(x)))`. It holds its sub-layers
    and builds them in `build()`, so `recompute="auto"` recomputes the block.

    Args:
        dim: the model width (input and output).
        heads: number of attention heads. Defaults to `4`.
        ffn_dim: the feed-forward inner width. Defaults to `4 * dim`.
        dropout: dropout rate after attention and the feed-forward network.
            Defaults to `0.0`.
    """

    def __init__(self, dim, heads=4, ffn_dim=None, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.heads, self.dropout = dim, heads, dropout
        self.ffn_dim = ffn_dim or 4 * dim
        self.norm_1 = keras.layers.LayerNormalization(name="norm_1")
        self.attention = keras.layers.MultiHeadAttention(
            heads, dim // heads, name="attention"
        )
        self.norm_2 = keras.layers.LayerNormalization(name="norm_2")
        self.up = keras.layers.Dense(self.ffn_dim, activation="gelu", name="up")
        self.down = keras.layers.Dense(dim, name="down")
        self.drop = keras.layers.Dropout(dropout, name="drop")

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        self.norm_1.build(input_shape)
        self.attention.build(input_shape, input_shape)
        self.norm_2.build(input_shape)
        self.up.build(input_shape)
        self.down.build(input_shape[:-1] + (self.ffn_dim,))
        self.drop.build(input_shape)

    def call(self, x, training=None):
        h = self.norm_1(x)
        x = x + self.drop(self.attention(h, h), training=training)
        h = self.down(self.up(self.norm_2(x)))
        return x + self.drop(h, training=training)

    def get_config(self):
        return {
            **super().get_config(),
            "dim": self.dim,
            "heads": self.heads,
            "ffn_dim": self.ffn_dim,
            "dropout": self.dropout,
        }


def transformer(
    length=32,
    vocab=512,
    dim=64,
    heads=4,
    blocks=2,
    ffn_dim=None,
    classes=10,
    cls=None,
    seed=0,
):
    """A small transformer-encoder sequence classifier: token and position
    embeddings, `blocks` `EncoderBlock`s, a final LayerNormalization, mean
    pooling over positions and a softmax head.

    Args:
        length: tokens per sequence. Defaults to `32`.
        vocab: vocabulary size (token ids are `0..vocab-1`). Defaults to
            `512`.
        dim: the model width. Defaults to `64`.
        heads: attention heads per block. Defaults to `4`.
        blocks: number of encoder blocks. Defaults to `2`.
        ffn_dim: feed-forward inner width. Defaults to `4 * dim`.
        classes: number of classes. Defaults to `10`.
        cls: the model class, `keras.Model` or `GradBoostModel`. Defaults to
            `GradBoostModel`.
        seed: weight initialisation seed. Defaults to `0`.

    Returns:
        An uncompiled functional model taking int32 token ids of shape
        `(batch, length)`; its blocks are named `encoder_<i>`.

    Example:

    >>> x, y = sequence_data(64)
    >>> model = transformer()
    >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
    ...               recompute="auto")   # recomputes encoder_0, encoder_1
    >>> history = model.fit(x, y, batch_size=32, verbose=0)
    """
    cls = _model_class(cls)
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((length,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, dim, name="embed")(inputs)
    x = PositionEmbedding(length, name="positions")(x)
    for i in range(blocks):
        x = EncoderBlock(dim, heads, ffn_dim, name=f"encoder_{i}")(x)
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="probs")(x)
    return cls(inputs, outputs, name="transformer")


def _model_class(cls):
    if cls is None:
        from keras_gradboost.model import GradBoostModel

        cls = GradBoostModel
    return cls


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


def image_data(samples, shape=(32, 32, 3), classes=10, seed=0):
    """Synthetic, learnable image classification data: labels from a random
    linear teacher on 4x4-average-pooled images.

    Args:
        samples: number of images.
        shape: `(height, width, channels)`, height and width divisible by 4.
            Defaults to `(32, 32, 3)`.
        classes: number of classes. Defaults to `10`.
        seed: random seed. Defaults to `0`.

    Returns:
        `(x, y)`: float32 images of shape `(samples, *shape)` and int32
        labels of shape `(samples,)`.
    """
    h, w, c = shape
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, h, w, c)).astype("float32")
    pooled = x.reshape(samples, h // 4, 4, w // 4, 4, c).mean(axis=(2, 4))
    pooled = pooled.reshape(samples, -1)
    teacher = rng.normal(size=(pooled.shape[1], classes)).astype("float32")
    y = np.argmax(pooled @ teacher, axis=1).astype("int32")
    return x, y


def sequence_data(samples, length=32, vocab=512, classes=10, seed=0):
    """Synthetic, learnable token-sequence classification data: each token
    id votes for one class, and a sequence's label is the class with most
    votes.

    Args:
        samples: number of sequences.
        length: tokens per sequence. Defaults to `32`.
        vocab: vocabulary size. Defaults to `512`.
        classes: number of classes. Defaults to `10`.
        seed: random seed. Defaults to `0`.

    Returns:
        `(x, y)`: int32 token ids of shape `(samples, length)` and int32
        labels of shape `(samples,)`.
    """
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, size=(samples, length)).astype("int32")
    votes = rng.integers(0, classes, size=vocab)
    counts = np.zeros((samples, classes), "int64")
    for k in range(classes):
        counts[:, k] = (votes[x] == k).sum(axis=1)
    y = np.argmax(counts, axis=1).astype("int32")
    return x, y
