"""Ids carried in a float input reach the layers that read them as indices
exactly as given, under every mixed precision.

keras.io text models feed token ids as a float32 `Input`. bfloat16 holds
integers exactly only up to 256 (1366 of the ids 1..1999 change), float16 up
to 2048 (1702 of the ids 1..4999 change). The reference is independent of
keras_gradboost: the ids themselves, the float32 lookup (embedding rows
gathered by the true ids, cast to the compute dtype), the same model fed the
ids as int32 (never cast), and the float32 model.

Only a functional or Sequential graph shows that a float input is ids. A
subclassed model (or a layer with several inputs) keeps Keras' casting,
since its float features must meet the embeddings in the compute dtype: its
float ids would change, so they are refused with a ValueError; its float
features beside int ids compute exactly as in plain Keras (the reference: the
same model, without keras_gradboost, its layers given the same policies).
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost import boost
from keras_gradboost import hooks
from keras_gradboost import precision as precision_lib
from keras_gradboost import precision_ids
from keras_gradboost import wrappers

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


class IdsAndFeatures(keras.Model):
    """A subclassed model fed int ids and float features, mixed in raw
    TensorFlow ops: they must meet in the same dtype, the compute dtype Keras
    casts the features to. (For a subclassed model apply_policy keeps its
    last layer, `out`, in float32.)"""

    def __init__(self, vocab, mixing="multiply", **kwargs):
        super().__init__(**kwargs)
        self.mixing = mixing
        self.mix = keras.layers.Dense(8, name="mix")
        self.token_emb = keras.layers.Embedding(vocab, 8, name="tokens")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, inputs):
        tokens = self.token_emb(inputs["ids"])
        features = inputs["features"][..., None]
        if self.mixing == "multiply":
            x = tokens * features
        else:
            x = tf.concat([tokens, features], axis=-1)
        return self.out(self.mix(tf.reduce_mean(x, axis=1)))


class BoostedIdsAndFeatures(IdsAndFeatures, GradBoostModel):
    """The same model, written as a GradBoostModel subclass."""


class FeatureAndPosition(keras.layers.Layer):
    """keras.io "Video classification with a Transformer"-style positional
    embedding, minus its cast: the one input is float features; an
    Embedding reads the positions (ints it makes itself); a raw add mixes
    them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pos_emb = keras.layers.Embedding(LENGTH, 8, name="positions")

    def call(self, x):
        return x + self.pos_emb(tf.range(tf.shape(x)[1]))


class IdsTimesFeatures(keras.layers.Layer):
    """A custom layer with two inputs, [ids, features], mixed in raw ops."""

    def __init__(self, vocab, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(vocab, 8, name="tokens")

    def call(self, inputs):
        ids, features = inputs
        return self.token_emb(ids) * features[..., None]


def _keras_hub():
    return pytest.importorskip("keras_hub")


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
    "keras_hub_token_and_position": (
        lambda v: _functional(
            v, embedding=_keras_hub().layers.TokenAndPositionEmbedding(v, LENGTH, 8)
        ),
        "token_embedding",
    ),
    "nested_sequential": (
        lambda v: _functional(
            v,
            embedding=keras.Sequential(
                [
                    keras.Input((LENGTH,)),
                    keras.layers.Reshape((LENGTH,)),
                    keras.layers.Embedding(v, 8, name="tokens"),
                ]
            ),
        ),
        "tokens",
    ),
    "subclassed_int32": (_subclassed, "tokens"),
    "integer_lookup": (
        lambda v: _lookup(
            keras.layers.IntegerLookup(vocabulary=np.arange(1, v), name="ids"), v
        ),
        "ids",
    ),
    "hashing": (lambda v: _lookup(keras.layers.Hashing(v, name="ids"), v), "ids"),
}
EMBEDDING_FORMS = [
    "functional",
    "reshape",
    "token_and_position",
    "keras_hub_token_and_position",
    "subclassed_int32",
]


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


def _dtype(form):
    return "int32" if form.endswith("int32") else "float32"


def _changed(received, ids):
    return int(np.sum(np.asarray(received, "float64").reshape(ids.shape) != ids))


@pytest.mark.parametrize("precision, vocab", CASES)
@pytest.mark.parametrize("form", list(FORMS))
def test_ids_reach_the_index_layer_as_given(form, precision, vocab, monkeypatch):
    ids = _ids(vocab)
    dtype = _dtype(form)
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
    table = _layer(model, FORMS[form][1]).embeddings
    before = keras.ops.convert_to_numpy(table)

    model.fit(
        _inputs(model, ids.astype(_dtype(form))),
        np.ones((len(ids), 3), "float32"),
        batch_size=len(ids),
        verbose=0,
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
    assert precision_ids.index_input_layers(model) == []
    assert not any(hooks.keeps_input_dtypes(l) for l in hooks.flatten_layers(model))
    assert not any(wrappers.patches(l, "call") for l in hooks.flatten_layers(model))


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


# ------------------------------------------- subclassed models: Keras' casting


def _features(n, seed=0):
    return np.random.default_rng(seed).uniform(0.5, 1.5, (n, LENGTH)).astype("float32")


def _plain_twin(compiled, build):
    """The model as plain Keras gives it, the reference: `build()` (a
    keras.Model, no keras_gradboost code on its way), its layers given the
    policies the compiled model's layers have, and its weights."""
    twin = build()
    inner = compiled.model if type(compiled).__name__ == "_BoostedModel" else compiled
    pairs = list(zip(hooks.flatten_layers(inner), hooks.flatten_layers(twin)))
    assert [type(b).__name__ for _, b in pairs[1:]] == [type(a).__name__ for a, _ in pairs[1:]]
    for ours, theirs in pairs:
        theirs.dtype_policy = ours.dtype_policy.name
    twin.set_weights(compiled.get_weights())
    return twin


def _ids_and_features(how, mixing, vocab):
    keras.utils.set_random_seed(0)
    cls = BoostedIdsAndFeatures if how == "subclass" else IdsAndFeatures
    model = _built(cls(vocab, mixing=mixing))
    return model if how == "subclass" else boost(model)


def _built(model):
    model({"ids": np.zeros((1, LENGTH), "int32"), "features": _features(1)})
    return model


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("mixing", ["multiply", "concat"])
@pytest.mark.parametrize("how", ["boost", "subclass"])
def test_float_features_beside_int_ids_compute_as_in_plain_keras(how, mixing, precision):
    """Keras casts a subclassed model's float features to the compute dtype,
    where they meet the embeddings in raw ops. Kept float32, they failed
    (bfloat16 * float32)."""
    vocab = 2000
    x = {"ids": _ids(vocab)[-8:].astype("int32"), "features": _features(8)}
    model = _ids_and_features(how, mixing, vocab)
    _compile(model, precision)
    reference = _plain_twin(model, lambda: _built(IdsAndFeatures(vocab, mixing=mixing)))
    assert _layer(reference, "tokens").compute_dtype == precision.split("_")[1]

    np.testing.assert_array_equal(model(x), reference(x))  # exact
    before = model.get_weights()
    history = model.fit(x, np.ones((8, 3), "float32"), batch_size=8, epochs=1, verbose=0)

    assert np.isfinite(history.history["loss"]).all()
    assert int(model.optimizer.iterations.numpy()) == 1
    assert any(np.any(a != b) for a, b in zip(before, model.get_weights()))
    reference.set_weights(model.get_weights())
    np.testing.assert_array_equal(model.predict(x, verbose=0), reference.predict(x, verbose=0))
    assert not any(hooks.keeps_input_dtypes(l) for l in hooks.flatten_layers(model))


def _recommender(how, vocab):
    keras.utils.set_random_seed(0)
    if how == "subclass":
        cls = type("BoostedRecommender", (Recommender, GradBoostModel), {})
    else:
        cls = Recommender
    model = cls(vocab, name="recommender")
    model(_ids(vocab)[:1])
    return model if how == "subclass" else boost(model)


def _refused(precision, layer="Embedding 'tokens'"):
    dtype = precision.split("_")[1]
    return pytest.raises(
        ValueError,
        match=(
            rf"(?s){layer}.*the {precision} precision policy cast "
            rf"the ids to {dtype} on the way, in .*'recommender', the layer "
            r"that holds it.*Feed the ids as integers.*precision=\"float32\""
        ),
    )


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("how", ["boost", "subclass"])
def test_float_ids_cast_by_a_subclassed_model_are_refused(how, precision):
    """The subclassed model casts its float input (the ids) to the compute
    dtype, as in plain Keras: the Embedding refuses it at the first trace,
    before any update (traced: fit, predict; eager too when the ids reach
    it still in the half dtype). Int ids then train."""
    vocab = 2000
    ids = _ids(vocab)[-8:]
    model = _recommender(how, vocab)
    _compile(model, precision)
    before = model.get_weights()

    with _refused(precision):
        model.fit(ids, np.ones((8, 3), "float32"), batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    with _refused(precision):
        model.predict(ids, verbose=0)
    if how == "subclass":
        with _refused(precision):
            model(ids)  # eager: it arrives as the half dtype itself

    model.fit(ids.astype("int32"), np.ones((8, 3), "float32"), batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1


def test_float_ids_cast_then_cast_back_are_refused_eagerly():
    """Called eagerly, boost()'s wrapper of a subclassed model casts the ids
    to bfloat16 and the Embedding refuses them. (Before, output_layers kept
    the first layer defined, the Reshape in front of the Embedding, in
    float32: it cast the ids back, with no history to show it.)"""
    model = _recommender("boost", 2000)
    _compile(model, "mixed_bfloat16")
    with _refused("mixed_bfloat16"):
        model(_ids(2000)[-8:])


def _text_model(nested):
    if nested == "functional":
        return _functional(2000)
    return keras.Sequential(
        [
            keras.Input((LENGTH,)),
            keras.layers.Embedding(2000, 8, name="tokens"),
            keras.layers.GlobalAveragePooling1D(),
        ]
    )


@pytest.mark.parametrize("nested", ["functional", "sequential"])
def test_a_nested_model_refuses_float_ids_cast_by_a_subclassed_model(nested):
    """A text model with a float32 Input inside a subclassed one: the
    subclassed model casts the ids, the text model casts them back to its
    Input's float32 (a Functional in its `call`, where the check sees them
    cast, eager or traced; a Sequential in `__call__`, before it: seen only
    when traced, as `fit` and `predict` run it)."""

    class Outer(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.text = _text_model(nested)
            self.out = keras.layers.Dense(3, name="out")

        def call(self, x):
            return self.out(self.text(x))

    keras.utils.set_random_seed(0)
    outer = Outer(name="recommender")
    outer(_ids(2000)[:1])
    model = boost(outer)
    _compile(model, "mixed_bfloat16")
    ids = _ids(2000)[-8:]
    calls = [lambda x: model.predict(x, verbose=0)]
    calls += [model] if nested == "functional" else []
    for call in calls:
        with _refused("mixed_bfloat16", layer=f"{type(outer.text).__name__} '{outer.text.name}'"):
            call(ids)
    with _refused("mixed_bfloat16", layer=f"{type(outer.text).__name__} '{outer.text.name}'"):
        model.fit(ids, np.ones((8, 3), "float32"), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    seen = _spy_call(outer.text.get_layer("tokens"))
    model(ids.astype("int32"))
    assert _changed(seen[-1], ids) == 0


def _spy_call(layer):
    seen = []
    wrappers.patch(layer, "call", lambda call, x, **kw: seen.append(x) or call(x, **kw))
    return seen


def test_recompiling_does_not_stack_the_check_and_float32_takes_it_off():
    model = _recommender("boost", 2000)
    embedding = _layer(model, "tokens")
    for precision in ("mixed_bfloat16", "mixed_bfloat16", "mixed_float16"):
        _compile(model, precision)
        assert len(wrappers.patches(embedding, "call")) == 1
    _compile(model, "float32")
    assert wrappers.patches(embedding, "call") == []
    assert "call" not in vars(embedding)  # as it was before any compile
    model.fit(_ids(2000)[-8:], np.ones((8, 3), "float32"), verbose=0)  # float ids: fine


def _features_model(form):
    keras.utils.set_random_seed(0)
    if form == "one_float_input_is_features":
        features = keras.Input((LENGTH, 8), name="features")
        inputs = [features]
        x = FeatureAndPosition(name="holder")(keras.layers.Reshape((LENGTH, 8))(features))
    else:  # "several_inputs"
        ids = keras.Input((LENGTH,), dtype="int32", name="ids")
        features = keras.Input((LENGTH,), name="features")
        inputs = [ids, features]
        x = IdsTimesFeatures(2000, name="holder")([ids, keras.layers.Reshape((LENGTH,))(features)])
    return keras.Model(inputs, _head(x))


@pytest.mark.parametrize("form", ["one_float_input_is_features", "several_inputs"])
def test_a_functional_graph_holder_of_features_casts_as_in_plain_keras(form):
    """A holder in a functional graph whose float input is features (an
    Embedding inside reads positions it makes), or that has several inputs,
    casts as in plain Keras, and so do the weightless layers in front of it.
    Kept float32, its features met bfloat16 embeddings in raw ops and
    failed."""
    if form == "several_inputs":
        x = [_ids(2000)[-8:].astype("int32"), _features(8)]
    else:
        x = [np.random.default_rng(0).uniform(0.5, 1.5, (8, LENGTH, 8)).astype("float32")]
    model = boost(_features_model(form))
    _compile(model, "mixed_bfloat16")
    reference = _plain_twin(model, lambda: _features_model(form))
    np.testing.assert_array_equal(model(x), reference(x))
    model.fit(x, np.ones((8, 3), "float32"), batch_size=8, verbose=0)
    reference.set_weights(model.get_weights())
    np.testing.assert_array_equal(model.predict(x, verbose=0), reference.predict(x, verbose=0))
    assert precision_ids.index_input_layers(model) == []
    assert not any(hooks.keeps_input_dtypes(l) for l in hooks.flatten_layers(model))
