"""float8 layers against Keras' own results: a variable with
`overwrite_with_gradient` (a float8 scale or amax history) takes its
"gradient" as its new value. Under `accumulate_steps` it gets the maximum
over the window, as with the optimizer's `gradient_accumulation_steps`;
under loss scaling it is neither unscaled nor weighted, as with
`LossScaleOptimizer`."""

import types

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import needs_keras
from conftest import shared_mirrored_strategy
from keras_gradboost import GradBoostModel
from keras_gradboost import checkpoint
from keras_gradboost.accumulate import GradientAccumulator

BATCH = 16
# Inputs of another magnitude in each micro-batch: a window's largest amax
# (7.0, then 4.0) is neither its mean nor its last.
MAGNITUDES = (1.0, 7.0, 2.0, 3.0, 0.5, 4.0, 1.5, 2.5)
TOL = 2e-6  # float32 round-off on values of magnitude ~1 (measured: 0.0)
# Keras' own handling, the reference below, is right from 3.10 on.
needs_keras_reference = needs_keras(
    (3, 10),
    "before it, LossScaleOptimizer divides an overwrite_with_gradient value by "
    "the scale, and apply() with only such variables raises 'No gradients'",
)


def _data():
    rng = np.random.default_rng(0)
    scale = np.repeat(MAGNITUDES, BATCH)[:, None]
    x = (rng.normal(size=(len(MAGNITUDES) * BATCH, 5)) * scale).astype("float32")
    y = rng.normal(size=(len(MAGNITUDES) * BATCH, 3)).astype("float32")
    return x, y


def _model(cls):
    """Dense(8, tanh) quantized to float8 -> Dense(3)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh", name="f8")(inputs)
    model = cls(inputs, keras.layers.Dense(3, name="out")(hidden))
    model.get_layer("f8").quantize("float8")
    return model


def _fit(model, x, y):
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)


def _differences(model, reference):
    """Each variable's max absolute difference from the reference's."""
    return {
        v.path: float(np.max(np.abs(np.asarray(v) - np.asarray(r))))
        for v, r in zip(model.weights, reference.weights)
    }


def _float8_variables(model):
    return [v for v in model.weights if v.overwrite_with_gradient]


def test_the_model_has_float8_scale_and_amax_history_variables():
    names = sorted(v.path for v in _float8_variables(_model(keras.Model)))
    assert names == sorted(
        f"f8/{part}_{kind}"
        for part in ("inputs", "kernel", "outputs_grad")
        for kind in ("scale", "amax_history")
    )


def _trained_pair(reference_optimizer, **gradboost):
    """Keras' model with `reference_optimizer`, and the GradBoostModel with
    plain SGD and the `gradboost` options, both fit on the same data."""
    x, y = _data()
    reference = _model(keras.Model)
    reference.compile(optimizer=reference_optimizer, loss="mse", jit_compile=False)
    _fit(reference, x, y)
    model = _model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False,
                  **gradboost)
    _fit(model, x, y)
    return reference, model


def test_accumulate_steps_equals_keras_gradient_accumulation_steps():
    # 8 micro-batches: two windows of 4.
    reference, model = _trained_pair(
        keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), accumulate_steps=4
    )
    assert int(model.optimizer.iterations.numpy()) == 2
    history = np.asarray(model.get_layer("f8").inputs_amax_history)
    # Newest first: the second window's amax, then the first's, rolled last.
    assert history[0] > 0.0 and history[-1] > 0.0
    differences = _differences(model, reference)
    assert max(differences.values()) < TOL, differences


def _keras_scaled_optimizer(loss_scale, accumulate_steps):
    inner = keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=accumulate_steps if accumulate_steps > 1 else None
    )
    if loss_scale == "dynamic":
        return keras.optimizers.LossScaleOptimizer(inner)
    # A fixed scale: it would only change after 10**6 finite steps or an
    # overflow (the test asserts there is none).
    return keras.optimizers.LossScaleOptimizer(
        inner, initial_scale=loss_scale, dynamic_growth_steps=10**6
    )


@needs_keras_reference
@pytest.mark.parametrize("accumulate_steps", [1, 4])
@pytest.mark.parametrize("loss_scale", [128.0, "dynamic"])
def test_loss_scaling_equals_keras_loss_scale_optimizer(loss_scale, accumulate_steps):
    reference, model = _trained_pair(
        _keras_scaled_optimizer(loss_scale, accumulate_steps),
        loss_scale=loss_scale, accumulate_steps=accumulate_steps,
    )
    scale = 128.0 if loss_scale == 128.0 else 2.0**15
    assert float(reference.optimizer.dynamic_scale.numpy()) == scale  # no overflow
    assert float(model._gradboost.scaler.scale.numpy()) == scale
    assert model.step_facts.read()["skipped_steps"] == 0
    differences = _differences(model, reference)
    float8 = {v.path: differences[v.path] for v in _float8_variables(model)}
    assert max(float8.values()) < TOL, float8
    assert max(differences.values()) < TOL, differences


# Values of an `overwrite_with_gradient` variable over a window of 3, some
# negative: Keras' window starts from zeros, so it keeps max(0, g_1, g_2, g_3).
WINDOW = ([-3.0, 1.0, 2.0], [-1.0, 5.0, -4.0], [-2.0, 0.5, 3.0])


def _overwrite_variable():
    variable = keras.Variable(np.full(3, 9.0, "float32"))
    variable.overwrite_with_gradient = True
    return variable


@needs_keras_reference
def test_the_window_of_a_value_is_keras_maximum_from_zeros():
    keras_variable = _overwrite_variable()
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=3)
    for value in WINDOW:
        optimizer.apply([np.asarray(value, "float32")], [keras_variable])
    accumulator = GradientAccumulator([_overwrite_variable()], steps=3)
    for n, value in zip((4.0, 8.0, 2.0), WINDOW):  # unweighted: n is not used
        accumulator.add([tf.constant(value)], n)
    (ours,) = accumulator.mean_gradients(tf.constant(14.0))
    np.testing.assert_array_equal(keras_variable.numpy(), [0.0, 5.0, 3.0])
    np.testing.assert_array_equal(ours.numpy(), keras_variable.numpy())


def test_a_saved_window_keeps_the_maximum_over_replicas():
    strategy = shared_mirrored_strategy()
    with strategy.scope():
        accumulator = GradientAccumulator(
            [_overwrite_variable(), keras.Variable(np.zeros(3, "float32"))], steps=4
        )
    halves = (WINDOW[0], WINDOW[1])  # what each replica holds
    for i, total in enumerate(accumulator.sums):
        for part, value in zip(strategy.experimental_local_results(total), halves):
            part.assign(value)
    for part in strategy.experimental_local_results(accumulator.count):
        part.assign(8.0)
    runtime = types.SimpleNamespace(facts=None, scaler=None, accumulator=accumulator,
                                    window_draws=None, other_states={})
    state = checkpoint.collect(runtime, strategy)
    np.testing.assert_array_equal(state["window_sum_0"], [-1.0, 5.0, 2.0])  # max
    np.testing.assert_array_equal(state["window_sum_1"], [-4.0, 6.0, -2.0])  # sum


def test_a_float8_model_saved_mid_window_goes_on_as_if_never_saved(tmp_path):
    x, y = _data()

    def boosted():
        model = _model(GradBoostModel)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False,
            accumulate_steps=4,
        )
        return model

    def train(model, batches):
        for i in batches:
            model.train_on_batch(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])

    never_saved = boosted()
    train(never_saved, range(8))
    model = boosted()
    train(model, range(6))  # one update, and micro-batches 4 and 5 pending
    path = str(tmp_path / "mid.weights.h5")
    model.save_weights(path)
    loaded = boosted()
    loaded.optimizer.build(loaded.trainable_variables)  # else Keras skips its state
    loaded.load_weights(path)
    train(loaded, range(6, 8))
    assert int(loaded.optimizer.iterations.numpy()) == 2
    assert max(_differences(loaded, never_saved).values()) == 0.0
