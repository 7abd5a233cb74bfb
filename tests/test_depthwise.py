"""compile(depthwise="native"): grouped Conv2Ds whose groups equal their input
channels run TensorFlow's depthwise kernel, with Keras' own results (the
un-boosted model, which keeps Keras' XLA-compiled grouped convolution) as the
reference, alone and with recompute, accumulation, bfloat16 and saving."""

import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_gradboost as kgb
from keras_gradboost import depthwise


def depthwise_net(seed=0, eligible_only=False):
    """Grouped Conv2Ds of every kind `eligible` sorts: depthwise (multiplier
    1 and 2, a stride, a dilation), grouped by 2 (not depthwise) and unequal
    strides (left out with `eligible_only`), between residual blocks
    `recompute` can cut."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((12, 12, 8))
    x = keras.layers.Conv2D(8, 7, padding="same", groups=8, name="dw_7x7")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    h = keras.layers.Dense(16, activation="gelu", name="expand")(x)
    h = keras.layers.Dense(8, name="project")(h)
    x = keras.layers.Add(name="residual")([x, h])
    x = keras.layers.Conv2D(16, 3, strides=2, padding="same", groups=8, name="dw_x2_stride")(x)
    x = keras.layers.Conv2D(16, 3, padding="same", dilation_rate=2, groups=16, name="dw_dilated")(x)
    if not eligible_only:
        x = keras.layers.Conv2D(16, 3, padding="same", groups=2, name="grouped_by_2")(x)
        x = keras.layers.Conv2D(16, 3, strides=(2, 1), padding="same", groups=16,
                                name="dw_unequal")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3, name="head")(x)
    return keras.Model(inputs, outputs)


NATIVE = {"dw_7x7", "dw_x2_stride", "dw_dilated"}


def data(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 12, 12, 8)).astype("float32"), rng.integers(0, 3, size=(n,))


def depthwise_ops(fn, spec):
    graph = tf.function(fn).get_concrete_function(spec).graph
    return sum(op.type == "DepthwiseConv2dNative" for op in graph.get_operations())


def xla_convolutions(model, x):
    """How many XLA-compiled convolutions (Keras' grouped-convolution
    path) one training step's forward and backward trace, recompute
    replays included."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = loss_fn(tf.zeros([x.shape[0]], "int32"), model.training_forward(x))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec(x.shape, tf.float32)).graph
    return sum("conv_xla" in f.signature.name for f in graph.as_graph_def().library.function)


def gradients(model, x, y):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def test_eligible_sorts_grouped_convolutions():
    model = depthwise_net()
    reasons = {
        layer.name: depthwise.eligible(layer)
        for layer in model.layers
        if isinstance(layer, keras.layers.Conv2D)
    }
    assert {name for name, (ok, _) in reasons.items() if ok} == NATIVE
    assert reasons["grouped_by_2"] == (False, "its groups are not its input channels")
    assert reasons["dw_unequal"] == (False, "unequal strides (2, 1)")
    assert not depthwise.eligible(keras.layers.DepthwiseConv2D(3))[0]  # native already


def test_native_equals_keras_values_and_gradients():
    plain = depthwise_net()
    boosted = kgb.boost(plain)
    boosted.compile(optimizer="sgd", loss="mse", depthwise="native")
    assert {layer.name for layer in boosted.train_plan.depthwise_layers} == NATIVE
    x, y = data()
    spec = tf.TensorSpec(x.shape, tf.float32)
    # The native kernel runs in the boosted model only: the model given to
    # boost() shares the layers and keeps Keras' grouped convolution. (If
    # Keras stops calling `Conv2D.convolution_op`, the first count is 0.)
    assert depthwise_ops(lambda t: boosted(t, training=False), spec) == len(NATIVE)
    assert depthwise_ops(lambda t: plain(t, training=False), spec) == 0
    np.testing.assert_allclose(boosted.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-5)
    for got, want in zip(gradients(boosted, x, y), gradients(plain, x, y)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _fit_weights(depthwise_setting, seed=0, **compile_kwargs):
    model = kgb.boost(depthwise_net(seed, eligible_only=True))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        depthwise=depthwise_setting,
        **compile_kwargs,
    )
    x, y = data(16)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model, [w.numpy() for w in model.trainable_weights]


# The features each depthwise setting trains with, against the same feature
# with Keras' grouped convolution.
FEATURES = {
    "recompute": {"recompute": "auto", "recompute_check": True},
    "selective": {"recompute": {"policy": "selective"}, "recompute_check": True},
    "accumulate": {"accumulate_steps": 2, "accumulate_check": True},
    "bfloat16": {"precision": "mixed_bfloat16"},
}


@pytest.mark.parametrize("extra", list(FEATURES.values()), ids=list(FEATURES))
def test_native_with_other_features_trains_like_keras(extra):
    """Each feature with native depthwise against the same feature with
    Keras' grouped convolution: the same weights after 4 steps. The
    recompute checks (gradients with and without each block recomputed) and
    the accumulation check (against one large-batch step) run inside."""
    reference, want = _fit_weights("keras", **extra)
    model, got = _fit_weights("native", **extra)
    tolerance = 2e-2 if "precision" in extra else 1e-4
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)
    if "recompute" in extra:
        assert model.recompute_plan().recomputed
    # No forward, replay or gradient of a depthwise layer went through
    # Keras' XLA-compiled grouped convolution.
    assert xla_convolutions(model, data()[0]) == 0
    assert xla_convolutions(reference, data()[0]) > 0


def test_native_survives_save_and_load(tmp_path):
    model, _ = _fit_weights("native")
    path = os.fspath(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.gradboost_config.depthwise == "native"
    assert {layer.name for layer in loaded.train_plan.depthwise_layers} == NATIVE
    x, _ = data()
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("value", ["xla", True, "Native"])
def test_bad_value_names_the_argument(value):
    model = kgb.boost(depthwise_net())
    with pytest.raises(ValueError, match=r"argument `depthwise`.*Received: depthwise="):
        model.compile(optimizer="sgd", loss="mse", depthwise=value)


def test_native_without_candidates_warns():
    inputs = keras.Input((4,))
    model = kgb.GradBoostModel(inputs, keras.layers.Dense(2)(inputs))
    with pytest.warns(UserWarning, match='depthwise="native" changes nothing'):
        model.compile(optimizer="sgd", loss="mse", depthwise="native")
    assert model.train_plan.depthwise_layers == ()


# keras.applications.ConvNeXtTiny (18 depthwise Conv2Ds) with the native
# kernels and recompute="auto" against plain Keras, step by step:
# tests/test_applications.py::test_boosted_with_recompute_trains_like_plain_keras.


def test_recompute_on_a_cpu_names_depthwise_native():
    """The XLA grouped convolution's temporaries are beyond recompute's
    reach: compile says so, and says what removes them."""
    model = kgb.boost(depthwise_net(eligible_only=True))
    # dw_x2_stride's depth multiplier of 2 has no such temporary.
    with pytest.warns(UserWarning, match=r'2 depthwise Conv2D.*depthwise="native"'):
        model.compile(optimizer="sgd", loss="mse", recompute="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.compile(optimizer="sgd", loss="mse", recompute="auto", depthwise="native")


def test_native_under_mirrored_strategy_trains_like_keras():
    """Replicas trace in threads of their own (the native context is per
    thread): with recompute, the weights after 4 steps equal Keras' path
    under the same strategy, and the model's training step traces no XLA
    convolution."""
    from conftest import shared_mirrored_strategy

    def weights(setting):
        with shared_mirrored_strategy().scope():
            model = kgb.boost(depthwise_net(eligible_only=True))
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          depthwise=setting, recompute="auto")
        x, y = data(16)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        return model, [w.numpy() for w in model.trainable_weights]

    model, got = weights("native")
    _, want = weights("keras")
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert xla_convolutions(model, data()[0]) == 0


def wide_depthwise_net(policy="float32", pixels=4, dense_layers=0):
    """One wide depthwise 7x7 convolution first (`pixels` square inputs of
    256 channels), then `dense_layers` Dense layers: on small activations
    XLA's backward temporary (dense (7, 7, 256, 256) filters, ~24 MiB) is
    most of the training peak; after 16x16 inputs and 6 Dense layers it
    comes last in the backward, when most activations are freed."""
    keras.utils.set_random_seed(0)
    before = keras.config.dtype_policy().name
    keras.config.set_dtype_policy(policy)
    try:
        inputs = keras.Input((pixels, pixels, 256))
        x = keras.layers.Conv2D(256, 7, padding="same", groups=256, name="dw_wide")(inputs)
        x = keras.layers.LayerNormalization(name="norm")(x)
        x = keras.layers.Dense(64, activation="gelu", name="expand")(x)
        for i in range(dense_layers):
            x = keras.layers.Dense(256, activation="gelu", name=f"dense_{i}")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, keras.layers.Dense(3, name="head", dtype="float32")(x))
    finally:
        keras.config.set_dtype_policy(before)


def test_xla_temporaries_are_not_reported_as_eigen_buffers(monkeypatch):
    """The XLA depthwise temporaries sit in the same working-buffer figures
    as Eigen's convolution buffers: where both could be counted, the plan
    names the XLA one and its remedy, and gives no Eigen figures (no
    TF_ENABLE_ONEDNN_OPTS advice, which would not remove it)."""
    from keras_gradboost import hooks

    monkeypatch.setattr(hooks, "onednn_enabled", lambda: False)
    model = kgb.boost(wide_depthwise_net())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compile's depthwise advice
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      recompute={"budget_mb": 1, "batch_size": 16})
    with pytest.warns(UserWarning, match="cannot be brought under") as caught:
        plan = model.recompute_plan()
    said = " ".join(str(w.message) for w in caught)
    assert plan.xla_temporary_bytes > 2**20 and plan.eigen_convolutions
    assert plan.working_buffer_bytes == 0 and plan.lowest_unbuffered_bytes is None
    assert "they add" not in str(plan) and "plans searched" not in str(plan)
    assert 'depthwise="native"' in said and "TF_ENABLE_ONEDNN_OPTS" not in said


def measured_training_peak(model, requested_peak, pixels=4):
    x = np.random.default_rng(0).normal(size=(32, pixels, pixels, 256)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, np.arange(32) % 3)).batch(16).repeat()
    model.fit(data, steps_per_epoch=2, verbose=0)  # traced, slots made
    iterator = iter(data)

    def steps():
        for _ in range(2):
            logs = model.train_function(iterator)
        float(logs["loss"])

    return requested_peak.requested_peak(steps)


_OLD_XLA = tuple(int(p) for p in tf.__version__.split(".")[:2]) < (2, 17)


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="a CPU temporary")
@pytest.mark.parametrize("policy, native, first", [
    # With first=False, TensorFlow 2.16's XLA allocates up to 1.29x the
    # estimate, varying from run to run (float32, where "auto" recomputes
    # nothing: 30.2 MiB, not 25.3, within 15% in other runs; mixed_bfloat16
    # on an AMD EPYC without AVX-512: 31.9, not 24.8): there that bound
    # alone is an expected failure (below).
    ("float32", False, False),
    ("mixed_bfloat16", False, False),
    ("float32", True, False),
    pytest.param("float32", False, True, marks=pytest.mark.xfail(
        _OLD_XLA, strict=True,
        reason="TensorFlow 2.16's XLA allocated 1.54x the estimate here (117 MiB, not 76)")),
])
def test_the_training_peak_estimate_counts_xla_depthwise_temporaries(
        policy, native, first, requested_peak):
    """Keras runs a depthwise Conv2D as an XLA grouped convolution, whose
    backward on a CPU allocates dense (kh, kw, C, C) filters (in float32
    under mixed precision too): the estimate counts them at their moment
    (it read ~0.07x of the measured peak without them, 0.75x with them on
    top of the peak where the convolution comes first in a larger model),
    the plan says which layer and what removes them, and a budget below
    them warns so; with depthwise="native" there are none to count."""
    pixels, dense_layers = (16, 6) if first else (4, 0)
    model = kgb.boost(wide_depthwise_net(policy, pixels, dense_layers))
    # Keras' way by name: with recompute on, depthwise=None would run slices.
    kwargs = {"depthwise": "native" if native else "keras"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compile's depthwise advice
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      recompute="auto", **kwargs)
    measured = measured_training_peak(model, requested_peak, pixels)
    plan = model.recompute_plan(batch_size=16)
    dense_filters = 7 * 7 * 256 * 256 * 4
    if native:
        assert plan.xla_temporary_bytes == 0 and "XLA backward" not in str(plan)
        assert measured < dense_filters  # nothing of that size
        return
    assert plan.xla_temporary_bytes == int(depthwise.XLA_DENSE_FILTER_COPIES * dense_filters)
    assert plan.xla_temporary_layer == "dw_wide"
    assert "'dw_wide'" in str(plan) and 'depthwise="native"' in str(plan)
    within = 0.85 * plan.peak_bytes <= measured <= 1.15 * plan.peak_bytes
    if not within and _OLD_XLA and not first:
        pytest.xfail(f"TensorFlow 2.16's XLA allocated {measured / plan.peak_bytes:.2f}x "
                     "the estimate here, varying from run to run")
    assert within, (measured, plan.peak_bytes)
    if first:
        return
    assert measured > 2 * (plan.peak_bytes - plan.xla_temporary_bytes)  # the old estimate
    budget = kgb.boost(wide_depthwise_net(policy))
    with pytest.warns(UserWarning, match=r"cannot be brought under 20 MiB.*'dw_wide' "
                      r"allocates .*recompute cannot remove them; .*"
                      r'compile\(depthwise="native"\) removes them') as caught:
        budget.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                       recompute={"budget_mb": 20, "batch_size": 16}, depthwise="keras")
        budget.recompute_plan()
    said = " ".join(str(w.message) for w in caught if "cannot be brought" in str(w.message))
    # "chunked" would serve in either precision (a mixed policy's slices
    # cast their kernels as Keras does): named.
    assert 'compile(depthwise="chunked") makes them' in said
