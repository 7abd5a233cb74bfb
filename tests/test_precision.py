"""Dtype policies on built models, the "auto" rule, and loss scaling."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import max_weight_diff
from conftest import small_model
from keras_gradboost import GradBoostModel
from keras_gradboost import precision as precision_lib


@pytest.mark.parametrize(
    "precision, jit, gpu, bf16, expected",
    [
        ("auto", False, True, False, "mixed_float16"),
        ("auto", True, True, True, "mixed_float16"),
        ("auto", False, False, True, "mixed_bfloat16"),
        ("auto", True, False, True, "float32"),
        ("auto", False, False, False, "float32"),
        ("auto", True, False, False, "float32"),
        ("mixed_float16", False, False, True, "mixed_float16"),
        (None, False, False, True, None),
    ],
)
def test_auto_rule(precision, jit, gpu, bf16, expected):
    assert precision_lib.resolve_precision(precision, jit, gpu, bf16) == expected


def test_auto_never_picks_float16_on_cpu():
    for jit in (False, True):
        for bf16 in (False, True):
            assert precision_lib.resolve_precision("auto", jit, False, bf16) != "mixed_float16"


def _classifier(cls=GradBoostModel):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", name="probs")(x)
    return cls(inputs, outputs)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_policy_applied_to_built_model(policy):
    model = _classifier()
    with pytest.warns(UserWarning) if policy == "mixed_float16" else _no_warning():
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", precision=policy)
    compute = policy.split("_")[1]
    assert model.get_layer("hidden").compute_dtype == compute
    assert model.get_layer("probs").compute_dtype == "float32"  # final softmax
    assert all(v.dtype == "float32" for v in model.weights)
    probe = keras.Model(model.inputs[0], model.get_layer("hidden").output)
    hidden = probe(np.ones((2, 6), "float32"))
    assert keras.backend.standardize_dtype(hidden.dtype) == compute
    assert model.dtype_policy_applied == policy


class _no_warning:
    def __enter__(self):
        self._catch = pytest.warns(UserWarning)
        import warnings

        self._w = warnings.catch_warnings(record=True)
        self.records = self._w.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)
        assert not [r for r in self.records if "mixed_float16" in str(r.message)]


def test_float16_on_cpu_without_xla_warns_with_cause_and_fix():
    message = precision_lib.float16_cpu_warning("mixed_float16", False, False)
    assert "remapping" in message and "jit_compile=True" in message
    assert 'precision="auto"' in message
    assert precision_lib.float16_cpu_warning("mixed_float16", True, False) is None
    assert precision_lib.float16_cpu_warning("mixed_float16", False, True) is None
    assert precision_lib.float16_cpu_warning("mixed_bfloat16", False, False) is None


def test_precision_none_leaves_model_as_built():
    model = _classifier()
    model.compile(optimizer="sgd", loss="mse")
    assert model.get_layer("hidden").compute_dtype == "float32"
    assert model.dtype_policy_applied is None


def _three_class_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 6)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")


def test_bfloat16_trains_and_loss_goes_down():
    x, y = _three_class_data()
    model = _classifier()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        precision="mixed_bfloat16",
    )
    history = model.fit(x, y, batch_size=32, epochs=5, verbose=0).history
    assert history["loss"][-1] < 0.7 * history["loss"][0]
    assert "loss_scale" not in history  # bfloat16 needs no loss scaling


def test_auto_loss_scale_follows_float16():
    model = _classifier()
    model.compile(optimizer="sgd", loss="mse", precision="mixed_bfloat16")
    assert model._gradboost.scaler is None
    model = _classifier()
    with pytest.warns(UserWarning, match="remapping"):
        model.compile(optimizer="sgd", loss="mse", precision="mixed_float16")
    assert model._gradboost.scaler is not None and model._gradboost.scaler.dynamic


def _overflow_model(cls=GradBoostModel):
    """float16 model whose backward overflows at loss scale 2**15: the MSE
    gradient 2*(pred - y)/N is ~1e3 per output, times 2**15 > float16 max
    once it enters the float16 hidden layer."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="out")(hidden)  # stays float32
    return cls(inputs, outputs)


def test_planted_overflow_is_skipped_and_scale_recovers():
    x = np.ones((64, 4), "float32")
    y = np.full((64, 2), 2000.0, "float32")
    model = _overflow_model()
    with pytest.warns(UserWarning, match="remapping"):
        model.compile(
            optimizer=keras.optimizers.SGD(1e-6), loss="mse", precision="mixed_float16"
        )
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    facts = model.step_facts.read()
    assert facts["skipped_steps"] >= 1
    assert facts["skipped_steps"] < 16  # the scale came down and steps applied
    assert int(model.optimizer.iterations.numpy()) == 16 - facts["skipped_steps"]
    assert history["loss_scale"][-1] < 2.0**15
    assert history["skipped_steps"][-1] == facts["skipped_steps"]
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_fixed_scale_overflow_never_reaches_weights(regression_data):
    x, y = regression_data
    y = 10.0 * y  # gradients ~10: times the scale 3e38 overflow float32
    model = small_model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", loss_scale=3e38)
    before = model.get_weights()
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    after = model.get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert model.step_facts.read()["skipped_steps"] == 4
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("jit_compile", [False, True])
def test_nonfinite_micro_batch_is_not_accumulated(regression_data, jit_compile):
    x, y = regression_data
    x = x.copy()
    x[40] = np.inf  # poisons micro-batch 1 (samples 32..63) only
    keep = np.r_[0:32, 64:104]
    ref = small_model()
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    ref.train_on_batch(x[keep], y[keep])
    model = small_model(GradBoostModel)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        accumulate_steps=4,
        loss_scale="dynamic",
        jit_compile=jit_compile,
    )
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    facts = model.step_facts.read()
    assert facts["skipped_steps"] == 1
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_weight_diff(model, ref) < 2e-6
    assert float(model._gradboost.scaler.scale.numpy()) == 2.0**14


def test_loss_scaled_accumulation_equals_unscaled(regression_data):
    x, y = regression_data
    a = small_model(GradBoostModel)
    a.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", accumulate_steps=4, loss_scale=None)
    b = small_model(GradBoostModel)
    b.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", accumulate_steps=4, loss_scale=1024.0)
    for m in (a, b):
        m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(a, b) < 2e-6


@pytest.mark.parametrize(
    "scale, skipped, steps, fragment",
    [
        (1.0, 3, 10, "at its floor"),
        (4.0, 9, 10, "9 of 10 steps"),
        (4.0, 4, 5, None),  # fewer than MIN_SKIPS_TO_WARN: the normal descent
        (1024.0, 1, 2000, None),
        (1.0, 0, 10, None),
    ],
)
def test_health_warning(scale, skipped, steps, fragment):
    message = precision_lib.health_warning(scale, skipped, steps)
    if fragment is None:
        assert message is None
    else:
        assert fragment in message


def test_no_floor_warning_for_a_fixed_scale():
    assert precision_lib.health_warning(1.0, 3, 10, dynamic=False) is None


def test_health_warning_is_raised_at_epoch_end():
    x = np.ones((40, 4), "float32")
    y = np.full((40, 2), np.inf, "float32")  # every step non-finite
    model = _overflow_model()
    model.compile(optimizer="sgd", loss="mse", loss_scale="dynamic")
    with pytest.warns(UserWarning, match=r"at its floor|steps this epoch were skipped"):
        model.fit(x, y, batch_size=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_float16_xla_accumulation_with_dynamic_scale_trains():
    x, y = _three_class_data()
    model = _classifier()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        precision="mixed_float16",
        accumulate_steps=2,
        jit_compile=True,
    )
    assert model._gradboost.scaler.dynamic  # "auto" -> dynamic for float16
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0).history
    assert history["loss"][-1] < 0.7 * history["loss"][0]
    assert int(model.optimizer.iterations.numpy()) == 4 * 8
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert model.get_layer("hidden").compute_dtype == "float16"


def test_linear_output_layer_stays_float32():
    model = small_model(GradBoostModel)  # hidden tanh -> linear "out"
    model.compile(optimizer="sgd", loss="mse", precision="mixed_bfloat16")
    assert model.get_layer("hidden").compute_dtype == "bfloat16"
    assert model.get_layer("out").compute_dtype == "float32"
    assert model.float32_layers == ["out"]


def test_dynamic_scale_stops_growing_at_the_ceiling():
    scaler = precision_lib.LossScaler(dynamic=True, initial=precision_lib.SCALE_CEILING)
    scaler.good_steps.assign(precision_lib.GROWTH_STEPS - 1)
    scaler.update(tf.constant(True))
    assert float(scaler.scale.numpy()) == precision_lib.SCALE_CEILING
    scaler.update(tf.constant(False))
    assert float(scaler.scale.numpy()) == precision_lib.SCALE_CEILING / 2
    low = precision_lib.LossScaler(dynamic=True, initial=1.0)
    low.update(tf.constant(False))
    assert float(low.scale.numpy()) == precision_lib.SCALE_FLOOR
