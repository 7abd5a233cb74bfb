"""bucket_by_length: a few fixed shapes, and what that does to XLA."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_gradboost import data
from keras_gradboost.callbacks import RetraceCounter

LENGTHS = (3, 6, 9, 12, 15, 18, 21, 24)


def _sequences(lengths=LENGTHS, per_length=4):
    def gen():
        for length in lengths:
            for i in range(per_length):
                yield np.full(length, i + 1, "int32"), np.int32(i % 2)

    return tf.data.Dataset.from_generator(
        gen,
        output_signature=(tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.int32)),
    )


def test_batches_take_only_the_bucket_shapes_and_keep_every_token():
    ds = data.bucket_by_length(_sequences(), [12, 24], batch_size=4)
    shapes, tokens = set(), 0
    for x, y in ds:
        shapes.add(tuple(x.shape))
        assert tuple(y.shape) == (4,)
        tokens += int(tf.math.count_nonzero(x))
    assert shapes == {(4, 12), (4, 24)}
    assert tokens == 4 * sum(LENGTHS)  # padding added zeros only


def test_short_bucket_batches_are_dropped_or_kept():
    ds = _sequences(lengths=(3, 3, 3), per_length=2)  # 6 elements, one bucket
    kept = list(data.bucket_by_length(ds, [8], batch_size=4, drop_remainder=False))
    dropped = list(data.bucket_by_length(ds, [8], batch_size=4))
    assert [tuple(x.shape) for x, _ in kept] == [(4, 8), (2, 8)]
    assert [tuple(x.shape) for x, _ in dropped] == [(4, 8)]


def test_padding_value_and_plain_tensor_elements():
    ds = tf.data.Dataset.from_generator(
        lambda: (np.ones(n, "float32") for n in (2, 5)),
        output_signature=tf.TensorSpec((None,), tf.float32),
    )
    (batch,) = list(data.bucket_by_length(ds, [6], batch_size=2, padding_value=-1.0))
    np.testing.assert_array_equal(batch.numpy()[0], [1, 1, -1, -1, -1, -1])


def test_too_long_element_is_an_error():
    ds = data.bucket_by_length(_sequences(lengths=(30,)), [12, 24], batch_size=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="longer than the last boundary"):
        list(ds)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"boundaries": []}, "boundaries=\\[\\]"),
        ({"boundaries": [16, 8]}, "increasing"),
        ({"boundaries": [0, 8]}, "boundaries=\\[0, 8\\]"),
        ({"batch_size": 0}, "batch_size=0"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"boundaries": [8], "batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        data.bucket_by_length(_sequences(), **args)


def test_not_a_dataset():
    with pytest.raises(TypeError, match="Expected a tf.data.Dataset"):
        data.bucket_by_length([1, 2], [8], batch_size=2)


def _xla_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(30, 4)(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    return model


def test_buckets_take_xla_recompiles_from_one_per_length_to_one_per_bucket():
    padded = RetraceCounter()
    _xla_model().fit(_sequences().padded_batch(4), verbose=0, callbacks=[padded])
    assert padded.recompiles == len(LENGTHS) - 1  # 7: one per new length

    bucketed = RetraceCounter()
    ds = data.bucket_by_length(_sequences(), [12, 24], batch_size=4)
    _xla_model().fit(ds, verbose=0, callbacks=[bucketed])
    assert bucketed.recompiles == 1  # two shapes: one compile beyond the first
    assert bucketed.events[0].changes == ("x: shape (4, 12) -> (4, 24), dim 1 varies",)


def test_dict_elements_are_measured_by_their_varying_component():
    # Sorted keys put the scalar "label" first: the default length is that of
    # the first component whose first dimension varies, "tokens".
    ds = _sequences().map(lambda x, y: {"label": y, "tokens": x})
    batches = list(data.bucket_by_length(ds, [12, 24], batch_size=4))
    assert {tuple(b["tokens"].shape) for b in batches} == {(4, 12), (4, 24)}
    assert all(tuple(b["label"].shape) == (4,) for b in batches)
    assert sum(int(tf.math.count_nonzero(b["tokens"])) for b in batches) == 4 * sum(LENGTHS)


def test_no_varying_component_asks_for_length_fn():
    ds = tf.data.Dataset.from_tensor_slices(np.zeros((8, 5), "int32"))
    with pytest.raises(ValueError, match="Pass `length_fn`"):
        data.bucket_by_length(ds, [8], batch_size=4)
