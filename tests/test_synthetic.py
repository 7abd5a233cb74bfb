"""`keras-gradboost compare`'s data for saved models (`synthetic`): every
input of a multi-input model in its own array (a list was stacked into one
tensor: every row failed), dict inputs, ids within the range of the
Embedding that reads them, and `--data` with one array per input."""

import numpy as np
import pytest

import keras
from keras_gradboost import cli
from keras_gradboost import synthetic


def two_inputs():
    """Token ids (int) into Embedding(50), through a Reshape; float features;
    a float input of ids (as keras.io text models feed them)."""
    ids = keras.Input((6,), dtype="int32", name="ids")
    features = keras.Input((4,), name="features")
    float_ids = keras.Input((3,), name="float_ids")
    embedded = keras.layers.Embedding(50, 8)(keras.layers.Reshape((6,))(ids))
    small = keras.layers.Embedding(7, 8)(float_ids)
    pooled = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Concatenate(axis=1)([embedded, small])
    )
    h = keras.layers.Concatenate()([pooled, keras.layers.Dense(8)(features)])
    return keras.Model([ids, features, float_ids], keras.layers.Dense(2)(h))


def test_each_input_gets_its_own_array_with_ids_in_range():
    model = two_inputs()
    notes = []
    x = synthetic.inputs(model, 64, notes, np.random.default_rng(0))
    assert isinstance(x, tuple) and [a.shape for a in x] == [(64, 6), (64, 4), (64, 3)]
    ids, features, float_ids = x
    assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < 50 and ids.max() > 7
    assert features.dtype == np.float32 and features.min() < 0  # features, not ids
    assert float_ids.dtype == np.float32 and set(np.unique(float_ids)) <= set(range(7))
    assert np.asarray(model(synthetic.first_rows(x, 2))).shape == (2, 2)
    assert notes == []


def test_compare_trains_a_saved_two_input_model(tmp_path, capsys, no_matmul_peak):
    """End to end: before, every row failed (the inputs stacked into one
    tensor)."""
    path = str(tmp_path / "two.keras")
    two_inputs().save(path)
    code = cli.main(["compare", "--model", path, "--steps", "3", "--batch-size", "8",
                     "--configs", "baseline"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    (row,) = cli.LAST_ROWS
    assert "error" not in row, row
    assert np.isfinite(row["final_loss"])
    # The same with --data, one array per input.
    rng = np.random.default_rng(1)
    data = tmp_path / "data.npz"
    np.savez(data, x_ids=rng.integers(0, 50, (24, 6)).astype("int32"),
             x_features=rng.normal(size=(24, 4)).astype("float32"),
             x_float_ids=rng.integers(0, 7, (24, 3)).astype("float32"),
             y=rng.normal(size=(24, 2)).astype("float32"))
    code = cli.main(["compare", "--model", path, "--data", str(data), "--steps", "3",
                     "--batch-size", "8", "--configs", "baseline"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    (row,) = cli.LAST_ROWS
    assert "error" not in row and np.isfinite(row["final_loss"]), row


def test_a_keras_hub_bert_gets_dict_inputs_within_its_embeddings():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=12, num_segments=3, dropout=0.0,
    )
    head = keras.layers.Dense(3)(backbone(backbone.input)["sequence_output"])
    model = keras.Model(backbone.input, head)
    notes = []
    x = synthetic.inputs(model, 32, notes, np.random.default_rng(0))
    assert sorted(x) == ["padding_mask", "segment_ids", "token_ids"]
    assert x["token_ids"].max() < 50 and x["token_ids"].max() > 3
    assert set(np.unique(x["segment_ids"])) <= {0, 1, 2}
    assert (x["padding_mask"] == 1).all()
    assert any("padding_mask: all ones" in n for n in notes)
    assert np.isfinite(np.asarray(model(synthetic.first_rows(x, 2)))).all()


def test_archive_keys_are_named_in_the_errors():
    model = two_inputs()

    class Archive(dict):
        @property
        def files(self):
            return list(self)

    with pytest.raises(ValueError, match="one 'x', but the model takes 3 inputs.*'x_ids'"):
        synthetic.from_archive(model, Archive(x=np.zeros((2, 6)), y=np.zeros((2, 2))))
    with pytest.raises(ValueError, match=r"missing \['x_float_ids'\]"):
        synthetic.from_archive(model, Archive(x_ids=np.zeros((2, 6)),
                                              x_features=np.zeros((2, 4)), y=np.zeros((2, 2))))
    assert synthetic.expected_keys(model) == ["x_ids", "x_features", "x_float_ids"]
