"""TrainPlan: what compile() decides, tested without calling compile()."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_gradboost import GradBoostModel
from keras_gradboost import recompute as recompute_lib
from keras_gradboost.config import GradBoostConfig
from keras_gradboost.plan import Devices
from keras_gradboost.plan import TrainPlan

from conftest import shared_mirrored_strategy
from conftest import small_model

CPU_BF16 = Devices(on_gpu=False, cpu_bf16=True)
CPU_PLAIN = Devices(on_gpu=False, cpu_bf16=False)
GPU = Devices(on_gpu=True, cpu_bf16=False)


def _plan(model=None, devices=CPU_BF16, keras_kwargs=None, **gradboost):
    model = model or small_model(GradBoostModel)
    kwargs = {"optimizer": "sgd", "loss": "mse", **(keras_kwargs or {})}
    return TrainPlan.build(GradBoostConfig(**gradboost), model, kwargs, devices)


def _policies(model):
    return [layer.dtype_policy.name for layer in model.layers]


@pytest.mark.parametrize(
    "devices, jit, expected",
    [
        (CPU_BF16, False, "mixed_bfloat16"),
        (CPU_BF16, True, "float32"),
        (CPU_PLAIN, False, "float32"),
        (GPU, False, "mixed_float16"),
        (GPU, True, "mixed_float16"),
    ],
)
def test_precision_auto_follows_device_then_jit(devices, jit, expected):
    plan = _plan(devices=devices, keras_kwargs={"jit_compile": jit}, precision="auto")
    assert plan.jit_compile is jit
    assert plan.policy == expected


@pytest.mark.parametrize(
    "precision, loss_scale, expected",
    [
        ("mixed_float16", "auto", (True, 2.0**15)),
        ("mixed_bfloat16", "auto", None),
        (None, "auto", None),
        ("float32", "dynamic", (True, 2.0**15)),
        ("float32", 128.0, (False, 128.0)),
        ("mixed_float16", None, None),
    ],
)
def test_loss_scale_follows_precision(precision, loss_scale, expected):
    plan = _plan(precision=precision, loss_scale=loss_scale)
    assert plan.loss_scale == expected
    assert plan.float16 is (precision == "mixed_float16")


def test_loss_scale_auto_reads_a_float16_model_as_built():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = small_model(GradBoostModel)
    finally:
        keras.config.set_dtype_policy("float32")
    plan = _plan(model)
    assert plan.policy is None and plan.float16 and plan.loss_scale[0] is True


def test_build_changes_nothing_and_conflicts_raise_before_any_change():
    model = small_model(GradBoostModel)
    before = _policies(model)
    plan = _plan(model, precision="mixed_bfloat16", accumulate_steps=2)
    assert plan.policy == "mixed_bfloat16"
    assert _policies(model) == before and not model.compiled
    optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        _plan(
            model,
            keras_kwargs={"optimizer": optimizer},
            precision="mixed_bfloat16",
            accumulate_steps=4,
        )
    with pytest.raises(ValueError, match="auto_scale_loss=True"):
        _plan(model, keras_kwargs={"auto_scale_loss": True}, loss_scale="dynamic")
    assert _policies(model) == before and not model.compiled


def test_keras_kwargs_hold_what_keras_is_given():
    plan = _plan(keras_kwargs={"auto_scale_loss": True}, precision="mixed_float16", loss_scale=None)
    assert plan.auto_scale_loss is True
    assert plan.keras_kwargs["auto_scale_loss"] is True  # gradboost scaling off
    assert isinstance(plan.keras_kwargs["optimizer"], keras.optimizers.SGD)
    with pytest.raises(TypeError):
        plan.keras_kwargs["loss"] = "mae"  # read-only


def test_measure_gives_keras_no_xla_until_measured():
    plan = _plan(keras_kwargs={"jit_compile": "measure"})
    assert plan.jit_requested == "measure"
    assert plan.keras_kwargs["jit_compile"] is False and plan.jit_compile is False
    assert plan.xla_blocked is None and plan.warnings == ()


class _NoJit(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False

    def call(self, x):
        return x


def test_a_layer_without_jit_blocks_xla_with_a_named_warning():
    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(3)(_NoJit(name="nojit")(inputs))
    model = GradBoostModel(inputs, outputs)
    plan = _plan(model, keras_kwargs={"jit_compile": True}, precision="auto")
    assert "layer 'nojit' (_NoJit) has supports_jit=False" in plan.xla_blocked
    assert plan.keras_kwargs["jit_compile"] is False and plan.jit_compile is False
    assert plan.policy == "mixed_bfloat16"  # the rule for no XLA
    (message,) = plan.warnings
    assert "XLA is off" in message and "nojit" in message


def test_run_eagerly_blocks_xla():
    plan = _plan(keras_kwargs={"jit_compile": True, "run_eagerly": True})
    assert plan.xla_blocked == "run_eagerly=True" and plan.jit_compile is False


def test_mirrored_strategy_over_cpus_blocks_xla_where_keras_fails():
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    y = np.zeros((8, 3), "float32")
    with shared_mirrored_strategy().scope():
        plain = small_model()
        plain.compile(optimizer="sgd", loss="mse", jit_compile=True)
        model = small_model(GradBoostModel)
    # The independent reference: plain Keras cannot run this XLA step.
    with pytest.raises(tf.errors.InvalidArgumentError, match="located in device"):
        plain.fit(x, y, batch_size=4, verbose=0)
    plan = _plan(model, keras_kwargs={"jit_compile": True})
    assert "MirroredStrategy over 2 CPU devices" in plan.xla_blocked
    assert plan.keras_kwargs["jit_compile"] is False and plan.jit_compile is False
    assert _plan(keras_kwargs={"jit_compile": True}).xla_blocked is None  # one device


def test_inexact_accumulation_and_float16_cpu_warnings_are_in_the_plan():
    inputs = keras.Input((5,))
    x = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(4)(inputs))
    model = GradBoostModel(inputs, keras.layers.Dense(3)(x))
    plan = _plan(
        model,
        devices=CPU_PLAIN,
        keras_kwargs={"loss": keras.losses.MeanSquaredError(reduction="sum")},
        precision="mixed_float16",
        accumulate_steps=2,
    )
    text = "\n".join(plan.warnings)
    assert "mixed_float16" in text and "slow" in text
    assert "BatchNormalization layers (bn)" in text
    assert "reduction='sum'" in text
    assert len(plan.warnings) == 3


def test_recompute_blocks_are_chosen_not_applied():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    block = keras.Sequential([keras.layers.Dense(5), keras.layers.Dense(5)], name="block_a")
    model = GradBoostModel(inputs, keras.layers.Dense(3)(block(inputs)))
    plan = _plan(model, recompute=["block_a"])
    assert list(plan.recompute.names().values()) == ["block_a"]
    assert not recompute_lib.is_marked(block)
    with pytest.raises(ValueError, match="matches no layer"):
        _plan(model, recompute=["nothing_*"])


def test_depthwise_layers_are_chosen_not_applied():
    from keras_gradboost import wrappers

    inputs = keras.Input((6, 6, 4))
    depthwise = keras.layers.Conv2D(4, 3, groups=4, name="dw")
    grouped = keras.layers.Conv2D(4, 3, groups=2, name="grouped")
    model = GradBoostModel(inputs, grouped(depthwise(inputs)))
    plan = _plan(model, depthwise="native")
    assert plan.depthwise_layers == (depthwise,)
    assert not wrappers.patches(depthwise, "convolution_op")
    assert _plan(model).depthwise_layers == ()


def test_with_jit_replans_the_precision_rule():
    plan = _plan(keras_kwargs={"jit_compile": True}, precision="auto")
    assert plan.policy == "float32"
    replanned = plan.with_jit(False, CPU_BF16)
    assert replanned.jit_compile is False and replanned.policy == "mixed_bfloat16"
    assert replanned.config == plan.config


def test_compile_applies_the_plan_it_builds():
    model = small_model(GradBoostModel)
    model.compile(optimizer="sgd", loss="mse", precision="float32", loss_scale=64.0)
    plan = model.train_plan
    assert isinstance(plan, TrainPlan)
    assert plan.policy == "float32" and plan.loss_scale == (False, 64.0)
    assert model.dtype_policy_applied == "float32"
    assert model.gradboost_config is plan.config
    assert float(model.step_facts.skipped_steps.numpy()) == 0
    assert small_model(GradBoostModel).train_plan is None
