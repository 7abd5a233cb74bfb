"""Built-in models and synthetic data: shapes, training, blocks, saving."""

import numpy as np
import pytest

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost import zoo


@pytest.mark.parametrize(
    "data, x_shape, x_dtype",
    [
        (lambda: zoo.classification_data(64, input_dim=12), (64, 12), "float32"),
        (lambda: zoo.image_data(64, shape=(8, 8, 2)), (64, 8, 8, 2), "float32"),
        (lambda: zoo.sequence_data(64, length=6, vocab=20), (64, 6), "int32"),
    ],
)
def test_data_shapes_and_labels(data, x_shape, x_dtype):
    x, y = data()
    assert x.shape == x_shape and x.dtype == x_dtype
    assert y.shape == (64,) and y.dtype == "int32"
    assert 0 <= y.min() and y.max() < 10
    assert len(np.unique(y)) >= 3  # labels carry information


def test_sequence_data_is_deterministic_and_in_vocab():
    x1, y1 = zoo.sequence_data(32, length=5, vocab=7, seed=3)
    x2, y2 = zoo.sequence_data(32, length=5, vocab=7, seed=3)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    assert x1.min() >= 0 and x1.max() < 7


def test_cnn_trains():
    x, y = zoo.image_data(64, shape=(8, 8, 3))
    model = zoo.cnn(input_shape=(8, 8, 3), filters=(4,))
    assert isinstance(model, GradBoostModel)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert model.output_shape == (None, 10)
    assert history.history["loss"][-1] < history.history["loss"][0]


def _tiny_transformer(**kwargs):
    return zoo.transformer(length=6, vocab=20, dim=8, heads=2, blocks=2, **kwargs)


def test_transformer_trains_and_recompute_auto_picks_the_encoder_blocks():
    x, y = zoo.sequence_data(64, length=6, vocab=20)
    model = _tiny_transformer()
    blocks = [layer for layer in model.layers if isinstance(layer, zoo.EncoderBlock)]
    assert [b.name for b in blocks] == ["encoder_0", "encoder_1"]
    assert all(b.attention.built and b.up.built and b.down.built for b in blocks)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        recompute="auto",
    )
    assert model.recompute_plan().recomputed == ["encoder_0", "encoder_1"]
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_transformer_save_and_load_round_trip(tmp_path):
    model = _tiny_transformer(cls=keras.Model)
    x, _ = zoo.sequence_data(4, length=6, vocab=20)
    path = str(tmp_path / "transformer.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.get_layer("encoder_1"), zoo.EncoderBlock)
    assert loaded.get_layer("encoder_0").get_config()["ffn_dim"] == 32
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
