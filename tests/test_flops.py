"""FLOPs of a traced training step against hand counts, and the matmul
peak (tiny sizes: no timing asserts)."""

import inspect
import re

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_gradboost import flops
from keras_gradboost import zoo


def _specs(x_shape, y_shape, x_dtype="float32", y_dtype="float32"):
    return (tf.TensorSpec(x_shape, x_dtype), tf.TensorSpec(y_shape, y_dtype))


@pytest.mark.parametrize("kwargs", [{}, {"accumulate_steps": 4}, {"precision": "mixed_bfloat16"}])
def test_mlp_step_flops_match_the_hand_count(kwargs):
    batch = 256
    model = zoo.mlp(input_dim=784, hidden=(1024, 1024), classes=10)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", **kwargs)
    counted = flops.step_flops(model, _specs((batch, 784), (batch,), y_dtype="int32"))
    forward = 2 * batch * (784 * 1024 + 1024 * 1024 + 1024 * 10)
    # Backward: every layer's weight gradient and the input gradient of all
    # but the first layer (nothing needs the gradient of the data): about
    # 3x the forward.
    expected = 3 * forward - 2 * batch * 784 * 1024
    assert counted.total == expected
    assert counted.exact and counted.uncounted == ()
    if "precision" in kwargs:
        head = 3 * 2 * batch * 1024 * 10  # the softmax head stays float32
        assert counted.by_dtype == {"bfloat16": expected - head, "float32": head}
    else:
        # Under accumulate_steps: one micro-batch's step, the same count.
        assert counted.by_dtype == {"float32": expected}


def test_recompute_adds_the_recomputed_forward():
    batch, sizes = 8, dict(input_dim=12, hidden=(16, 16, 16), classes=3)
    specs = _specs((batch, 12), (batch,), y_dtype="int32")
    counts = []
    for recompute in (None, ["dense_0", "dense_1"]):  # (named: "auto" finds too little to save here)
        model = zoo.mlp(**sizes)
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", recompute=recompute)
        counts.append(flops.step_flops(model, specs).total)
    forward = 2 * batch * (12 * 16 + 16 * 16 + 16 * 16 + 16 * 3)
    plain, recomputed = counts
    assert plain == 3 * forward - 2 * batch * 12 * 16
    assert plain < recomputed <= plain + forward


def test_conv_step_flops_match_the_hand_count():
    batch = 4
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)  # 8x8x4
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2)(x)  # 6x6x8, valid
    x = keras.layers.Conv2D(5, 3, strides=2, padding="valid")(x)  # 2x2x5
    outputs = keras.layers.Dense(2)(keras.layers.Flatten()(x))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    counted = flops.step_flops(model, _specs((batch, 8, 8, 3), (batch, 2)))
    conv_1 = 2 * batch * 8 * 8 * (3 * 3 * 3) * 4
    depthwise = 2 * batch * 6 * 6 * 8 * (3 * 3)
    conv_2 = 2 * batch * 2 * 2 * (3 * 3 * 8) * 5
    dense = 2 * batch * 20 * 2
    # Forward, filter gradient, and the input gradient except the first's.
    assert counted.total == 2 * conv_1 + 3 * (depthwise + conv_2 + dense)
    assert counted.exact


def test_einsum_dense_counts_like_dense():
    def count(layer):
        inputs = keras.Input((16,))
        model = keras.Model(inputs, keras.layers.Dense(3)(layer(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        return flops.step_flops(model, _specs((8, 16), (8, 3)))

    dense = count(keras.layers.Dense(32))
    einsum = count(keras.layers.EinsumDense("ab,bc->ac", output_shape=32))
    assert einsum == dense
    assert dense.total == 2 * 8 * 16 * 32 * 2 + 2 * 8 * 32 * 3 * 3


def test_transformer_step_flops_match_the_hand_count():
    batch, length, dim, heads, ffn, classes = 4, 8, 16, 2, 32, 3
    model = zoo.transformer(length=length, vocab=20, dim=dim, heads=heads, blocks=1,
                            ffn_dim=ffn, classes=classes)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    counted = flops.step_flops(model, _specs((batch, length), (batch,), "int32", "int32"))
    tokens = batch * length
    # Query, key, value and output projections; scores and their weighted
    # sum over values (einsums); the feed-forward pair; the head.
    block = 2 * tokens * (4 * dim * dim + 2 * length * dim + 2 * dim * ffn)
    forward = block + 2 * batch * dim * classes
    # The embedding's gradient is a gather's: every contraction has both
    # gradients, 3x the forward.
    assert counted.total == 3 * forward
    assert counted.exact


def test_einsum_flops_with_broadcast_dims():
    assert flops.einsum_flops("...ij,...jk->...ik", [(2, 3, 4, 5), (3, 5, 6)]) == 2 * 2 * 3 * 4 * 5 * 6
    assert flops.einsum_flops("abc,cd->abd", [(2, 3, 4), (4, 5)]) == 2 * 2 * 3 * 4 * 5
    assert flops.einsum_flops("ab->ba", [(2, 3)]) is None


class _Branching(keras.layers.Layer):
    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3))

    def call(self, x):
        return tf.cond(
            tf.reduce_sum(x) > 0,
            lambda: tf.matmul(x, self.kernel),
            lambda: 2.0 * tf.matmul(x, self.kernel),
        )


def test_a_contraction_inside_a_cond_makes_the_count_a_lower_bound():
    inputs = keras.Input((5,))
    x = keras.layers.Dense(4)(inputs)
    model = keras.Model(inputs, _Branching(name="branching")(x))
    model.compile(optimizer="sgd", loss="mse")
    counted = flops.step_flops(model, _specs((2, 5), (2, 3)))
    assert not counted.exact
    assert counted.total == 2 * 2 * 5 * 4 * 2  # the Dense: forward, weights
    assert any(re.match(r"MatMul inside (Stateless)?If '.*branching", u) for u in counted.uncounted)


def test_the_step_flops_example_runs():
    source = re.search(r"```python\n(.*?)```", inspect.getdoc(flops.step_flops), re.DOTALL)
    exec(compile(source.group(1), "<docstring example>", "exec"), {})


def test_measure_peak_is_positive_per_dtype():
    peaks = flops.measure_peak(["float32", "bfloat16"], size=64, reps=2, warmup=1)
    assert set(peaks) == {"float32", "bfloat16"}
    assert all(v is not None and v > 0 for v in peaks.values())


def test_peak_share_weights_each_dtype_by_its_peak():
    peaks = {"bfloat16": 9e8, "float32": 5e8}
    # 0.5 s at the bfloat16 peak, 0.2 s at the float32 one, in a 1.4 s step.
    assert flops.peak_share({"bfloat16": 4.5e8, "float32": 1e8}, 1.4, peaks) == pytest.approx(0.5)
    assert flops.peak_share({"float32": 2.5e8}, 1.0, peaks) == pytest.approx(0.5)
    assert flops.peak_share({"float16": 1e8}, 1.0, peaks) is None
    assert flops.peak_share({"float32": 1e8}, 1.0, {"float32": None}) is None
