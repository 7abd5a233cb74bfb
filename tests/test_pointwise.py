"""compile(pointwise="matmul"): Conv2Ds with a 1x1 kernel run as matrix
products, with Keras' own results (the un-boosted model, which keeps the
convolution kernel) as the reference, alone and with recompute,
accumulation, bfloat16 and saving; and the Eigen working buffers they no
longer allocate, estimated and measured."""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_gradboost as kgb
from keras_gradboost import depthwise
from keras_gradboost import pointwise


def pointwise_net(seed=0):
    """Conv2Ds of every kind `eligible` sorts, between blocks `recompute`
    can cut: 1x1 ones (stride 1, a stride 2 on an odd size, unequal
    strides), and a 3x3, a grouped 1x1 and a dilated 1x1, which stay
    convolutions."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((9, 9, 8))
    x = keras.layers.Conv2D(8, 1, activation="relu", name="pw_1")(inputs)
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv_3x3")(x)
    h = keras.layers.Conv2D(16, 1, strides=2, padding="same", name="pw_stride_2")(x)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Conv2D(16, 1, strides=(1, 2), name="pw_unequal")(h)
    h = keras.layers.Conv2D(16, 1, groups=2, name="grouped_1x1")(h)
    h = keras.layers.Conv2D(16, 1, dilation_rate=2, name="dilated_1x1")(h)
    x = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(3, name="head")(x)
    return keras.Model(inputs, outputs)


MATMUL = {"pw_1", "pw_stride_2", "pw_unequal"}


def data(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 9, 9, 8)).astype("float32"), rng.integers(0, 3, size=(n,))


def convolved(fn, spec):
    """The names of the layers whose Conv2D ops the traced graph of `fn`
    runs (forward and replays; a gradient is another op)."""
    graph = tf.function(fn).get_concrete_function(spec).graph
    return {
        name
        for op in graph.get_operations()
        if op.type == "Conv2D"
        for name in [*MATMUL, "conv_3x3", "dilated_1x1"]
        if f"/{name}_" in op.name or op.name.startswith(f"{name}_")
    }


def gradients(model, x, y):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def test_eligible_sorts_convolutions():
    model = pointwise_net()
    reasons = {
        layer.name: pointwise.eligible(layer)
        for layer in model.layers
        if isinstance(layer, keras.layers.Conv2D)
    }
    assert {name for name, (ok, _) in reasons.items() if ok} == MATMUL
    assert reasons["conv_3x3"] == (False, "kernel size (3, 3)")
    assert reasons["grouped_1x1"] == (False, "2 groups")
    assert reasons["dilated_1x1"] == (False, "dilation (2, 2)")
    assert not pointwise.eligible(keras.layers.DepthwiseConv2D(1))[0]
    assert not pointwise.eligible(keras.layers.Conv2D(2, 1, data_format="channels_first"))[0]


class StandardizedConv2D(keras.layers.Conv2D):
    """A weight-standardised convolution (BiT's): its own `convolution_op`."""

    def convolution_op(self, inputs, kernel):
        mean, variance = tf.nn.moments(kernel, axes=[0, 1, 2], keepdims=True)
        return super().convolution_op(inputs, (kernel - mean) / tf.sqrt(variance + 1e-5))


@pytest.mark.parametrize("groups", [1, 4])
def test_a_class_with_its_own_convolution_op_keeps_it(groups):
    """Neither option replaces a `convolution_op` a layer's class defines
    (the matmul or the depthwise kernel would drop its standardisation):
    the boosted model's output equals the plain one's."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 5, 4))
    layer = StandardizedConv2D(4, 1, groups=groups, name="standardized")
    plain = keras.Model(inputs, layer(inputs))
    boosted = kgb.boost(plain)
    boosted.compile(optimizer="sgd", loss="mse", pointwise="matmul", depthwise="native")
    reason = (False, "its class overrides convolution_op")
    assert (pointwise.eligible(layer) if groups == 1 else depthwise.eligible(layer)) == reason
    x = np.random.default_rng(0).normal(size=(2, 5, 5, 4)).astype("float32")
    np.testing.assert_allclose(boosted.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strides", [(1, 1), (2, 2), (2, 1), (3, 2)])
@pytest.mark.parametrize("padding", ["same", "valid"])
def test_the_matrix_product_is_the_convolution(strides, padding):
    """Odd sizes (7x9), every stride: the shape and values of Keras'
    convolution (0.0 apart measured: TensorFlow's 1x1 kernel is a matrix
    product too), whatever the padding (none around a 1x1 kernel)."""
    x = tf.random.stateless_normal((2, 7, 9, 5), seed=[0, 1])
    layer = keras.layers.Conv2D(4, 1, strides=strides, padding=padding, use_bias=False)
    want = layer(x)
    got = pointwise.matmul_convolution(x, layer.kernel, layer.strides)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_matmul_equals_keras_values_and_gradients():
    plain = pointwise_net()
    boosted = kgb.boost(plain)
    boosted.compile(optimizer="sgd", loss="mse", pointwise="matmul")
    assert {layer.name for layer in boosted.train_plan.pointwise_layers} == MATMUL
    x, y = data()
    spec = tf.TensorSpec(x.shape, tf.float32)
    # The matrix product runs in the boosted model only: the model given to
    # boost() shares the layers and keeps the convolution. (If Keras stops
    # calling `Conv2D.convolution_op`, the first set holds MATMUL too.)
    # Keras runs the grouped one as an XLA-compiled call, not a Conv2D op.
    assert convolved(lambda t: boosted(t, training=False), spec) == {"conv_3x3", "dilated_1x1"}
    assert convolved(lambda t: plain(t, training=False), spec) == MATMUL | {
        "conv_3x3", "dilated_1x1"}
    np.testing.assert_allclose(boosted.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-5)
    for got, want in zip(gradients(boosted, x, y), gradients(plain, x, y)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("no_graph_rewrites")
def test_a_real_architecture_trains_like_keras():
    """keras.applications.MobileNetV3Small (1x1 convolutions in its inverted
    residuals and squeeze-and-excite blocks, hard-swish), boosted with
    `pointwise="matmul"` and accumulation: its weights after a window of 2
    micro-batches equal those with the convolutions. boost() shares the
    given model's layers and weights."""

    def step(setting):
        keras.utils.set_random_seed(1)
        base = keras.applications.MobileNetV3Small(
            input_shape=(32, 32, 3), weights=None, classes=4, include_preprocessing=False
        )
        model = kgb.boost(base)
        assert model.layers == base.layers[: len(model.layers)]
        assert len(model.weights) == len(base.weights)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="categorical_crossentropy",
                      accumulate_steps=2, pointwise=setting)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(8, 32, 32, 3)).astype("float32")
        model.fit(x, keras.utils.to_categorical(np.arange(8) % 4, 4), batch_size=4, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 1
        return model, [w.numpy() for w in base.weights]

    model, got = step("matmul")
    assert len(model.train_plan.pointwise_layers) > 20
    _, want = step(None)
    moved = max(float(np.max(np.abs(a))) for a in want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * moved)


def _fit_weights(pointwise_setting, seed=0, **compile_kwargs):
    model = kgb.boost(pointwise_net(seed))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        pointwise=pointwise_setting,
        **compile_kwargs,
    )
    x, y = data(16)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model, [w.numpy() for w in model.trainable_weights]


@pytest.mark.parametrize(
    "extra",
    [
        {"recompute": ["pw_stride_2", "pw_unequal"], "recompute_check": True},
        {"recompute": {"policy": "selective"}, "recompute_check": True},
        {"accumulate_steps": 2, "accumulate_check": True},
        {"precision": "mixed_bfloat16"},
    ],
    ids=["recompute", "selective", "accumulate", "bfloat16"],
)
def test_matmul_with_other_features_trains_like_keras(extra):
    """Each feature with 1x1 convolutions as matmuls against the same
    feature with Keras' convolutions: the same weights after 4 steps. The
    recompute checks (gradients with and without each block recomputed)
    and the accumulation check (against one large-batch step) run inside,
    and no forward, replay or gradient runs a 1x1 convolution."""
    _, want = _fit_weights(None, **extra)
    model, got = _fit_weights("matmul", **extra)
    tolerance = 2e-2 if "precision" in extra else 1e-4
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)
    if "recompute" in extra:
        assert model.recompute_plan().recomputed
    x = data()[0]

    def step(t):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model.training_forward(t))
        return tape.gradient(loss, model.trainable_variables)

    found = convolved(step, tf.TensorSpec(x.shape, tf.float32))
    assert "conv_3x3" in found  # the names match in this graph: MATMUL's would
    assert not found & MATMUL


def test_matmul_survives_save_and_load(tmp_path):
    model, _ = _fit_weights("matmul")
    path = os.fspath(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.gradboost_config.pointwise == "matmul"
    assert {layer.name for layer in loaded.train_plan.pointwise_layers} == MATMUL
    x, _ = data()
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("value", ["native", True, "MatMul"])
def test_bad_value_names_the_argument(value):
    model = kgb.boost(pointwise_net())
    with pytest.raises(ValueError, match=r"argument `pointwise`.*Received: pointwise="):
        model.compile(optimizer="sgd", loss="mse", pointwise=value)


def test_matmul_without_candidates_warns():
    inputs = keras.Input((4,))
    model = kgb.GradBoostModel(inputs, keras.layers.Dense(2)(inputs))
    with pytest.warns(UserWarning, match='pointwise="matmul" changes nothing'):
        model.compile(optimizer="sgd", loss="mse", pointwise="matmul")
    assert model.train_plan.pointwise_layers == ()


def _one_pointwise_model(setting):
    """A 1x1 Conv2D (its input has a gradient: both Eigen buffers) in a
    recomputed block."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 16))
    h = keras.layers.Dense(16, name="stem")(inputs)
    h = keras.Sequential([keras.layers.Conv2D(16, 1, name="pw")], name="seq")(h)
    model = kgb.GradBoostModel(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    model.compile(optimizer="sgd", loss="mse", recompute=["seq"], pointwise=setting)
    return model


def test_the_estimate_drops_the_eigen_buffers(monkeypatch):
    """Where oneDNN is off, the 1x1 convolution's backward allocates two
    im2col buffers of [shard, 8 * 8, 16] floats (`shard` the images whose
    operands fit 30 MiB: 3414, 14 MB each); as a matmul, none, and the
    training peak estimate says so."""
    from keras_gradboost import hooks
    from keras_gradboost import precision

    monkeypatch.setattr(hooks, "onednn_enabled", lambda: False)
    monkeypatch.setattr(precision, "gpu_available", lambda: False)
    convolution = _one_pointwise_model(None).recompute_plan(batch_size=4)
    matmul = _one_pointwise_model("matmul").recompute_plan(batch_size=4)
    buffer = 3414 * 64 * 16 * 4
    added = convolution.peak_bytes - matmul.peak_bytes
    assert 2 * buffer - 4 * 64 * 16 * 4 * 4 <= added <= 2 * buffer, (added, buffer)
    assert convolution.bytes_with == matmul.bytes_with  # activations: unchanged


def test_the_steps_request_no_eigen_buffers(requested_peak):
    """The same, measured (the profiler's requested bytes of two training
    steps): where oneDNN is off, the convolution's steps request at least
    one of the buffers (14 MB here; 13.9 MB measured against 0.07 for the
    matmul's steps: TensorFlow ran the two backward kernels one after the
    other on this small model) on top of the matmul's."""
    from keras_gradboost import hooks

    if hooks.onednn_enabled() is not False:
        pytest.skip("oneDNN runs the convolutions here: no Eigen buffers to remove")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8, 8, 16)).astype("float32")
    y = rng.normal(size=(4, 2)).astype("float32")
    peaks = {}
    for setting in (None, "matmul"):
        model = _one_pointwise_model(setting)
        model.fit(x, y, batch_size=4, verbose=0)

        def steps():
            for _ in range(2):
                model.train_on_batch(x, y)

        peaks[setting] = requested_peak.requested_peak(steps)
    buffer = 3414 * 64 * 16 * 4
    assert peaks[None] - peaks["matmul"] >= 0.9 * buffer, peaks
