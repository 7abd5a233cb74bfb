"""keras.applications architectures (weights=None, 32x32 inputs), as users
bring them: each feature against its independent reference (plain Keras,
the large batch, a planted fault at a known step and layer, the model
before saving, the bytes the training steps' allocations request).

These are the slowest tests of the suite (each traces a real architecture;
about 5-40 s a test on 2 CPU cores), marked `slow`; CI runs them.
`python -m pytest -m "not slow"` leaves them out.
"""

import gc

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_gradboost as kgb
from keras_gradboost import hooks

pytestmark = pytest.mark.slow

# The five the issue names; ConvNeXtTiny normalises with LayerNormalization,
# the four others with BatchNormalization.
MODELS = ["ResNet50", "MobileNetV2", "EfficientNetB0", "DenseNet121", "ConvNeXtTiny"]
PIXELS, CLASSES, N, BATCH = 32, 3, 8, 4


@pytest.fixture(autouse=True)
def _free_the_models():
    """These models are large (a worker reached 4.5 GB): free them before
    the worker's next test."""
    yield
    gc.collect()


def application(name, seed=0):
    keras.utils.set_random_seed(seed)
    kwargs = dict(input_shape=(PIXELS, PIXELS, 3), weights=None, classes=CLASSES)
    if name == "ConvNeXtTiny":
        kwargs["include_preprocessing"] = False
    return getattr(keras.applications, name)(**kwargs)


def images(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, PIXELS, PIXELS, 3)).astype("float32")
    return x, keras.utils.to_categorical(np.arange(N) % CLASSES, CLASSES)


def compile_model(model, **kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss="categorical_crossentropy",
        **kwargs,
    )
    return model


# The recompute comparison on ConvNeXtTiny (LayerNorm blocks inline between
# nested Sequentials, both kinds of plan estimated, depthwise="native": its 18
# depthwise Conv2Ds on TensorFlow's own kernels in the forwards and the
# replays), weights and moving statistics against the unboosted model after
# each of two steps: 42-51 s of CI on an AVX2 CPU, dropped to keep CI under
# its limit. What still covers it: depthwise="native" with recompute trains
# like Keras (tests/test_depthwise.py), MobileNetV2's graph cut as a nested
# base trains exactly like Keras (tests/recompute/test_nested_graph.py), the
# keras-hub BERT and GPT-2 recompute exactly (tests/test_real_models.py);
# `benchmarks/bench_recompute.py --models ConvNeXtTiny` measures its plans.


@pytest.mark.skipif(
    hooks.onednn_enabled() is False,
    reason="~20 s of CI on the AVX2 CPUs (oneDNN off) where CI has the least "
           "room; there the small models of tests/test_depthwise_chunked.py "
           "run, and each layer's check at its first trace")
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_convnext_chunked_depthwise_is_keras_bit_for_bit(monkeypatch, policy):
    """ConvNeXtTiny's 15 depthwise Conv2Ds of over 96 channels (stages 1-3)
    in slices (`depthwise="chunked"`): one training step's gradients equal
    those of Keras' grouped convolutions in the model given to `boost()`,
    bit for bit, and every one of the 15 ran in slices. In mixed_bfloat16
    too, where Keras reads each float32 kernel cast inside its XLA function
    (a slice cast outside rounded the kernels' gradients)."""
    from test_depthwise_chunked import recording_slices

    keras.mixed_precision.set_global_policy(policy)
    try:
        plain = application("ConvNeXtTiny")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    boosted = compile_model(kgb.boost(plain), depthwise="chunked")
    chosen = {layer.name for layer in boosted.train_plan.depthwise_layers}
    assert len(chosen) == 15
    sliced = recording_slices(monkeypatch)
    x, y = images()
    loss_fn = keras.losses.CategoricalCrossentropy()

    def gradients(model):
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            return tape.gradient(loss, model.trainable_variables)

        return [g.numpy() for g in step(x, y)]

    for got, want in zip(gradients(boosted), gradients(plain)):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # -0.0 != 0.0
    assert sliced == chosen


# ConvNeXt's residual adds are raw operations: under the mixed policy
# compile(precision=...) sets after the model was built, a segment may not
# start where one reads, and a selective plan chosen at compile used to refuse
# at the first trace. Trained against no recompute on ConvNeXtTiny in
# mixed_bfloat16 (53 s of CI on a CPU without bfloat16 instructions), dropped
# to keep CI under its limit: a plan chosen again under the policy compile
# sets is tested on a smaller graph in tests/recompute/test_nested_graph.py.


# A NaN planted in a middle convolution of ConvNeXtTiny (nested Sequentials,
# LayerNormalization), located at its step and layer with the weights of the
# step before: 18 s of CI on an AVX2 CPU, dropped to keep CI under its limit.
# The keras-hub GPT-2 and ViT tests plant theirs in nested layers named by
# their paths (tests/test_real_models.py), and the planted faults of
# tests/callbacks/ cover the rest.


# The two with the most to save beyond Keras' standard layers in a
# functional graph: EfficientNetB0's Normalization (its statistics) and
# Rescaling preprocessing, ConvNeXtTiny's LayerScale in nested Sequentials.
# ResNet50, MobileNetV2 and DenseNet121 (8-13 s of CI each) are left out.
@pytest.mark.parametrize("name", ["EfficientNetB0", "ConvNeXtTiny"])
def test_boosted_model_saves_and_loads(name, tmp_path):
    x, _ = images()
    model = compile_model(kgb.boost(application(name)), accumulate_steps=2,
                          recompute="auto")
    path = str(tmp_path / f"{name}.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, kgb.GradBoostModel)
    assert loaded.gradboost_config.accumulate_steps == 2
    assert loaded.gradboost_config.recompute == "auto"
    # Recompute runs ConvNeXt's depthwise convolutions in slices, loaded too.
    chunked = "chunked" if name == "ConvNeXtTiny" else None
    assert model.train_plan.depthwise_setting == loaded.train_plan.depthwise_setting == chunked
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Called eagerly (tracing `predict` for both cost a minute on DenseNet121).
    np.testing.assert_array_equal(loaded(x[:2], training=False), model(x[:2], training=False))


@pytest.mark.parametrize("name", [m for m in MODELS if m != "ConvNeXtTiny"])
def test_batch_normalization_models_warn_that_accumulation_is_inexact(name):
    model = kgb.boost(application(name))
    with pytest.warns(UserWarning, match="BatchNormalization"):
        compile_model(model, accumulate_steps=2)


# ConvNeXtTiny normalises per sample (LayerNormalization): two micro-batches
# of 4 equal one step on the 8, and nothing warns. 34 s of CI on an AVX2 CPU,
# dropped to keep CI under its limit: the keras-hub BERT (LayerNormalization,
# padding) accumulated equals its large batch (tests/test_real_models.py),
# and the BatchNormalization models' warning is tested above.


# kgb.callbacks.BackupAndRestore on EfficientNetB0 (BatchNormalization,
# Dropout and stochastic depth) boosted with accumulate_steps=2, a backup
# holding half a window, resumed exactly: 61 s of CI on an AVX2 CPU, dropped
# to keep CI under its limit. tests/callbacks/test_backup.py resumes a
# mid-epoch backup of a GradBoostModel and Dropout's masks exactly, and the
# interaction matrix resumes accumulation windows from mid-window backups.


# With grappler's dependency optimizer off the updates wait for the whole
# backward and every gradient is alive (ResNet50 "auto": 145.4 MiB requested,
# 132.1 estimated; README). That case's measured check (40 s of CI) was
# dropped to keep CI under its limit; its estimate is tested on a small model
# (recompute/test_estimates.py).
#
# ResNet50's weights (90 MiB of gradients) outweigh its activations at
# 64x64, batch 16; TensorFlow applies each variable's update as soon as its
# gradient exists, so they never all live at once: without recompute the
# steps requested within 15% of the estimate (all the gradients on top of
# the peak activations over-counted by far). That measured check (56-68 s
# of CI on an AVX2 CPU, the last real-architecture one of the gradients'
# lifetimes) was dropped to keep CI under its limit; the lifetimes are
# tested on small models (recompute/test_estimates.py,
# `test_the_peak_estimate_counts_the_update_of_a_weight_at_its_moment`), and
# `benchmarks/bench_recompute.py --models ResNet50` measures ResNet50's.


@pytest.mark.skipif(
    hooks.onednn_enabled() is False,
    reason="with oneDNN off the steps requested 0.82 of the estimate (101.3 of "
           "124.2 MiB; 0.75 with the estimate before), 0.94-0.95 with it on; "
           "skipped, not an expected failure: 45 s of CI that asserted nothing")
def test_selective_estimate_follows_the_backward_on_convnext(requested_peak):
    """A selective plan's peak is one moment of the backward: ConvNeXtTiny's
    largest replays come last in the backward (its first blocks, 64x64
    images), its largest weight gradients first (stage 3), when the rest
    is long freed. The estimate that summed the largest replay, the
    largest gradients and all the step keeps read 152.7 MiB where the
    steps requested 110.2 (0.72x; README)."""
    _assert_the_selective_estimate_holds("ConvNeXtTiny", requested_peak, depthwise="native")


@pytest.mark.skipif(
    hooks.onednn_enabled() is False,
    reason="~45 s of CI on the AVX2 CPUs (oneDNN off) where CI has the least "
           "room; measured with oneDNN off once (TF_ENABLE_ONEDNN_OPTS=0 on an "
           "AVX-512 CPU: 0.92 of the low end, which counts Eigen's buffers there)")
def test_convnext_steps_meet_the_estimate_with_each_update_alone(requested_peak):
    """ConvNeXtTiny (64x64, batch 16, "auto", `depthwise="native"`, Adam):
    the backward between two of its 9 MiB kernels' gradients (two 302
    MFLOP matmuls) outlasts Adam's update of one, so TensorFlow's executor
    runs the updates alone: alive at the profiler's peak, one kernel's
    gradient and its update's `Square`. The steps requested 49.3-50.1 MiB
    in most runs (up to 64.1 in others); the estimate with the next update
    beside each (`peak_bytes`) read 67.5, the one with each alone
    (`peak_bytes_updates_alone`) 49.5."""
    keras.utils.set_random_seed(0)
    base = keras.applications.ConvNeXtTiny(weights=None, input_shape=(64, 64, 3), classes=10)
    measured, model = _requested_peak(base, requested_peak, recompute="auto", depthwise="native")
    plan = model.recompute_plan(batch_size=16)
    alone = plan.peak_bytes_updates_alone
    assert alone < 0.85 * plan.peak_bytes, (alone, plan.peak_bytes)
    # Within the estimate's two ends. Which end a run meets follows the
    # executor's timing: on an AMD EPYC with AVX-512 the median of 3
    # processes was 1.00x the low end, twice, and single runs 0.99-1.01x,
    # 1.12x once; on 2026-12-07 3 of 9 runs read 1.19-1.30x of it (0.87-0.95x
    # of `peak_bytes`), at this commit and at the one before the option
    # "chunked" alike, so the low end alone is not asserted.
    assert 0.85 * alone <= measured <= 1.15 * plan.peak_bytes, (
        measured, alone, plan.peak_bytes)


# MobileNetV2's selective peak is in its first block's replay, at the
# backward of `block_1_expand_BN`: all the block's activations alive, with
# three gradients of that BatchNormalization's input size; counting one read
# 40.9 MiB where the steps requested 48.6-49.4. That measured check (47 s of
# CI on an AVX2 CPU) was dropped to keep CI under its limit; the figure is
# tested on small models (tests/recompute/test_estimates.py) and measured by
# `benchmarks/bench_recompute.py --configs selective`.


def _assert_the_selective_estimate_holds(name, requested_peak, **options):
    """keras.applications' `name` (64x64, batch 16) under a selective plan
    (and `options`): the bytes the steps request at most 15% over its
    training peak estimate, and at most 20% under it (the executor's order
    varies from process to process: MobileNetV2's plan requested 41.3-49.4
    MiB against 49.0 estimated)."""
    keras.utils.set_random_seed(0)
    base = getattr(keras.applications, name)(
        weights=None, input_shape=(64, 64, 3), classes=10
    )
    options = {**options, "recompute": {"policy": "selective"}}
    measured, model = _requested_peak(base, requested_peak, **options)
    plan = model.recompute_plan(batch_size=16)
    assert plan.recomputed
    assert 0.8 * plan.peak_bytes <= measured <= 1.15 * plan.peak_bytes, (
        measured, plan.peak_bytes)


def test_frozen_base_peak_estimate_counts_the_forward_working_set(requested_peak):
    """keras.io's transfer learning: a frozen MobileNetV2 base called as a
    layer. Its backward keeps almost nothing (TensorFlow prunes the base's),
    so the peak is the forward's largest operation with its input; the
    moments of the backward alone gave 6.4 MiB where the steps requested
    12.5 (1.96x). Within 15% now, with and without "auto" (which recomputes
    nothing: nothing to save)."""
    keras.utils.set_random_seed(0)
    base = keras.applications.MobileNetV2(
        input_shape=(64, 64, 3), include_top=False, weights=None
    )
    base.trainable = False
    inputs = keras.Input((64, 64, 3))
    pooled = keras.layers.GlobalAveragePooling2D()(base(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(pooled))
    measured, _ = _requested_peak(model, requested_peak)
    probe = kgb.boost(model)
    probe.compile(optimizer="adam", loss="sparse_categorical_crossentropy", recompute="auto")
    with pytest.warns(UserWarning, match="nothing is recomputed"):
        plan = probe.recompute_plan(batch_size=16)
    assert not plan.recomputed
    for estimated in (plan.peak_bytes_without, plan.peak_bytes):
        assert 0.85 * estimated <= measured <= 1.15 * estimated, (measured, estimated)


def _requested_peak(base, requested_peak, **compile_kwargs):
    """The bytes two warmed training steps of boosted `base` request
    (`compile_kwargs` with None values left out), and the boosted model
    (its `recompute_plan` is the estimate of those steps)."""
    model = kgb.boost(base)
    kwargs = {k: v for k, v in compile_kwargs.items() if v is not None}
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", **kwargs)
    x = np.random.default_rng(0).normal(size=(32, 64, 64, 3)).astype("float32")
    y = np.arange(32) % 10
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True).repeat()
    model.fit(data, steps_per_epoch=2, epochs=1, verbose=0)  # traced, slots made
    iterator = iter(data)

    def steps():
        for _ in range(2):
            logs = model.train_function(iterator)
        float(logs["loss"])

    # An earlier model's cycles freed during the steps would count as
    # negative bytes: free them first.
    gc.collect()
    # The median of three: which temporaries overlap follows the executor's
    # order, which another process's load moves (ConvNeXtTiny's selective
    # steps requested 145.8 MiB once in CI, 1.17x the estimate of 124.2;
    # 0.94-0.95x alone).
    return sorted(requested_peak.requested_peak(steps) for _ in range(3))[1], model
