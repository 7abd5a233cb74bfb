"""Ids carried in a float input reach the layers that read them as indices
exactly as given, under every mixed precision.

keras.io text models feed token ids as a float32 `Input`. bfloat16 holds
integers exactly only up to 256 (1366 of the ids 1..1999 change), float16 up
to 2048 (1702 of the ids 1..4999 change). The reference is independent of
keras_gradboost: the ids themselves, the float32 lookup (embedding rows
gathered by the true ids, cast to the compute dtype), the same model fed the
ids as int32 (never cast), and the float32 model.
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_gradboost import boost
from keras_gradboost import hooks
from keras_gradboost import precision as precision_lib

LENGTH = 4
# (precision, vocabulary size): ids 1..size-1 in every case.
CASES = [
    ("mixed_bfloat16", 2000),
    ("mixed_float16", 2000),
    ("mixed_float16", 5000),
]


def _ids(vocab):
    """Ids 1..vocab-1 (padded with 0) in rows of LENGTH, as float32."""
    ids = np.arange(1, vocab, dtype="float32")
    return np.pad(ids, (0, -len(ids) % LENGTH)).reshape(-1, LENGTH)


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras.io "Text classification with Transformer", which feeds it a
    float32 `layers.Input(shape=(maxlen,))`."""

    def __init__(self, vocab, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(vocab, 8, name="tokens")
        self.pos_emb = keras.layers.Embedding(LENGTH, 8)

    def call(self, x):
        positions = self.pos_emb(keras.ops.arange(0, keras.ops.shape(x)[-1]))
        return self.token_emb(x) + positions


class OwnPositionWeight(keras.layers.Layer):
    """A token Embedding plus a position weight of the layer's own, which
    must still be read in the compute dtype."""

    def __init__(self, vocab, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(vocab, 8, name="tokens")

    def build(self, input_shape):
        self.positions = self.add_weight(shape=(LENGTH, 8), name="positions")

    def call(self, x):
        return self.token_emb(x) + self.positions


class Recommender(keras.Model):
    """keras.io "Collaborative filtering": a subclassed model that calls its
    Embedding on a float input (after a Reshape it holds)."""

    def __init__(self, vocab, **kwargs):
        super().__init__(**kwargs)
        self.reshape = keras.layers.Reshape((LENGTH,))
        self.token_emb = keras.layers.Embedding(vocab, 8, name="tokens")
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.pool(self.token_emb(self.reshape(x))))


def _head(x):
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.layers.Dense(3, name="out")(x)


def _functional(vocab, dtype="float32", before=None, embedding=None):
    inputs = keras.Input((LENGTH,), dtype=dtype)
    x = before(inputs) if before is not None else inputs
    layer = embedding or keras.layers.Embedding(vocab, 8, name="tokens")
    return keras.Model(inputs, _head(layer(x)))


def _lookup(layer, vocab):
    inputs = keras.Input((LENGTH,))
    x = keras.layers.Reshape((LENGTH,))(inputs)
    x = layer(x)
    x = keras.layers.Embedding(vocab + 2, 8)(x)
    return keras.Model(inputs, _head(x))


def _subclassed(vocab):
    model = Recommender(vocab)
    model(_ids(vocab)[:1])
    return model


# name -> (builder(vocab), the layer that reads the ids)
FORMS = {
    "functional": (_functional, "tokens"),
    "functional_int32": (lambda v: _functional(v, dtype="int32"), "tokens"),
    "reshape": (lambda v: _functional(v, before=keras.layers.Reshape((LENGTH,))), "tokens"),
    "lambda": (lambda v: _functional(v, before=keras.layers.Lambda(lambda t: t)), "tokens"),
    "token_and_position": (
        lambda v: _functional(v, embedding=TokenAndPositionEmbedding(v)),
        "tokens",
    ),
    "own_position_weight": (
        lambda v: _functional(v, embedding=OwnPositionWeight(v)),
        "tokens",
    ),
    "subclassed": (_subclassed, "tokens"),
    "integer_lookup": (
        lambda v: _lookup(
            keras.layers.IntegerLookup(vocabulary=np.arange(1, v), name="ids"), v
        ),
        "ids",
    ),
    "hashing": (lambda v: _lookup(keras.layers.Hashing(v, name="ids"), v), "ids"),
}
EMBEDDING_FORMS = ["functional", "reshape", "token_and_position", "subclassed"]


def _build(form, vocab, seed=0):
    keras.utils.set_random_seed(seed)
    return FORMS[form][0](vocab)


def _layer(model, name):
    (layer,) = [l for l in hooks.flatten_layers(model) if l.name == name]
    return layer


def _compile(model, precision, **kwargs):
    expected = precision == "mixed_float16"  # slow on a CPU without XLA
    with pytest.warns(UserWarning, match="mixed_float16") if expected else (
        contextlib.nullcontext()
    ):
        model.compile(
            optimizer=keras.optimizers.SGD(1.0),
            loss="mse",
            precision=precision,
            loss_scale=None,
            **kwargs,
        )


def _inputs(model, x):
    return [x] if hooks.is_functional(model) else x


def _spy(monkeypatch, layer):
    """Records what `layer.call` receives and returns (eager calls)."""
    seen = []
    call = layer.call

    def spy(inputs, *args, **kwargs):
        outputs = call(inputs, *args, **kwargs)
        seen.append((inputs, outputs))
        return outputs

    monkeypatch.setattr(layer, "call", spy)
    return seen


def _changed(received, ids):
    return int(np.sum(np.asarray(received, "float64").reshape(ids.shape) != ids))


@pytest.mark.parametrize("precision, vocab", CASES)
@pytest.mark.parametrize("form", list(FORMS))
def test_ids_reach_the_index_layer_as_given(form, precision, vocab, monkeypatch):
    ids = _ids(vocab)
    dtype = "int32" if form.endswith("int32") else "float32"
    reference = boost(_build(form, vocab))  # float32: no policy
    model = boost(_build(form, vocab))
    _compile(model, precision)
    layer = _layer(model, FORMS[form][1])
    seen = _spy(monkeypatch, layer)

    outputs = model(_inputs(model, tf.constant(ids.astype(dtype))))

    received, looked_up = seen[-1]
    assert received.dtype == dtype  # as plain Keras passes them on
    assert _changed(received, ids) == 0
    if isinstance(layer, keras.layers.Embedding):
        table = keras.ops.convert_to_numpy(layer.embeddings)
        rows = tf.cast(table[ids.astype("int64")], layer.compute_dtype)
        np.testing.assert_array_equal(looked_up, rows)  # exact
    else:  # the float32 model's lookup of the true ids
        expected = _layer(reference, FORMS[form][1])(tf.constant(ids))
        assert looked_up.dtype == expected.dtype
        np.testing.assert_array_equal(looked_up, expected)
    fed_as_int = model(_inputs(model, tf.constant(ids.astype("int32"))))
    np.testing.assert_array_equal(outputs, fed_as_int)
    expected = reference(_inputs(reference, tf.constant(ids.astype(dtype))))
    np.testing.assert_allclose(outputs, expected, atol=0.02)


@pytest.mark.parametrize("precision, vocab", [CASES[0], CASES[2]])
@pytest.mark.parametrize("form", EMBEDDING_FORMS)
def test_a_boosted_step_updates_the_rows_of_the_true_ids(form, precision, vocab):
    ids = _ids(vocab)[-8:]  # the highest ids: 1999 becomes 2000 in bfloat16
    model = boost(_build(form, vocab))
    _compile(model, precision)
    table = _layer(model, "tokens").embeddings
    before = keras.ops.convert_to_numpy(table)

    model.fit(
        _inputs(model, ids), np.ones((len(ids), 3), "float32"), batch_size=len(ids), verbose=0
    )

    after = keras.ops.convert_to_numpy(table)
    touched = np.flatnonzero(np.any(after != before, axis=1))
    np.testing.assert_array_equal(touched, np.unique(ids).astype(int))
    assert np.isfinite(after).all()


def test_auto_on_a_bfloat16_cpu_keeps_the_ids(monkeypatch):
    monkeypatch.setattr(precision_lib, "cpu_has_native_bfloat16", lambda: True)
    monkeypatch.setattr(precision_lib, "gpu_available", lambda: False)
    ids = _ids(2000)
    model = boost(_build("token_and_position", 2000))
    model.compile(optimizer="sgd", loss="mse", precision="auto", jit_compile=False)
    assert model.train_plan.policy == "mixed_bfloat16"
    seen = _spy(monkeypatch, _layer(model, "tokens"))
    model([tf.constant(ids)])
    assert _changed(seen[-1][0], ids) == 0


def test_models_without_index_layers_keep_every_input_cast():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(keras.ops.reshape(x, (-1, LENGTH)) * 2.0)

    inputs = keras.Input((LENGTH,))
    x = keras.layers.Reshape((LENGTH,))(inputs)
    model = boost(keras.Model(inputs, keras.layers.Dense(3)(Block()(x))))
    _compile(model, "mixed_bfloat16")
    assert precision_lib.index_input_layers(model) == []
    assert not any(hooks.keeps_input_dtypes(l) for l in hooks.flatten_layers(model))


def test_only_the_layers_on_the_way_to_the_ids_pass_them_uncast():
    inputs = keras.Input((LENGTH,))
    features = keras.Input((LENGTH,))
    ids = keras.layers.Reshape((LENGTH,), name="ids_reshape")(inputs)
    scaled = keras.layers.Rescaling(0.5, name="features_rescale")(features)
    hidden = keras.layers.Dense(8, name="hidden")(keras.layers.Reshape((LENGTH, 1))(scaled))
    tokens = TokenAndPositionEmbedding(2000, name="token_and_position")(ids)
    outputs = _head(keras.layers.Add()([tokens, hidden]))
    model = boost(keras.Model([inputs, features], outputs))
    _compile(model, "mixed_bfloat16")
    kept = sorted(l.name for l in hooks.flatten_layers(model) if hooks.keeps_input_dtypes(l))
    assert kept == ["ids_reshape", "token_and_position"]
    assert model.get_layer("features_rescale").compute_dtype == "bfloat16"
    assert model.get_layer("token_and_position").compute_dtype == "bfloat16"

    _compile(model, "float32")  # a later compile undoes it
    assert not any(hooks.keeps_input_dtypes(l) for l in hooks.flatten_layers(model))
