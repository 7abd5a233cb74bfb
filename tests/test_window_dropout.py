"""Dropout under accumulation against its independent reference: Keras' own
large-batch step with the same seeds (`window_dropout`)."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import SaveAfterBatch
from conftest import max_weight_diff
from keras_gradboost import GradBoostModel
from keras_gradboost import jit_measure
from keras_gradboost import window_dropout
from keras_gradboost import wrappers
from keras_gradboost.accumulate import held_generators

TOL = 2e-6  # float32 round-off of the window's sums


@pytest.mark.parametrize("xla", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_uniform_rows_are_the_rows_of_the_whole_draw(dtype, xla):
    seed = tf.constant([11, -3], tf.int32)
    whole = tf.function(
        lambda: tf.random.stateless_uniform([9, 7], seed, dtype=dtype), jit_compile=xla
    )()
    for first, rows in [(0, 9), (1, 3), (2, 5), (7, 2), (8, 1)]:  # 7, 14, 49, 56: odd offsets
        part = tf.function(
            lambda: window_dropout.uniform_rows(tf.constant([rows, 7]), seed, first * 7, dtype),
            jit_compile=xla,
        )()
        np.testing.assert_array_equal(
            tf.cast(part, tf.float32).numpy(),
            tf.cast(whole[first : first + rows], tf.float32).numpy(),
        )
    assert window_dropout.draws_rows_exactly(dtype, xla)


@pytest.mark.parametrize("make, shape", [
    (lambda: keras.layers.SpatialDropout2D(0.3, seed=1), (6, 3, 3, 4)),
    (lambda: keras.layers.SpatialDropout1D(0.3, seed=2), (6, 3, 4)),
    (lambda: keras.layers.Dropout(0.3, noise_shape=(None, 1, 4), seed=3), (6, 3, 4)),
    (lambda: keras.layers.Dropout(0.3, noise_shape=(1, None, 4), seed=4), (6, 3, 4)),  # shared
], ids=["spatial2d", "spatial1d", "per_sample", "shared"])
def test_noise_shapes_draw_their_rows_at_a_batch_of_no_fixed_size(make, shape):
    # SpatialDropout passes the batch's size as a tensor: it crashed here.
    layer = make()
    x = tf.reshape(tf.range(1, np.prod(shape) + 1, dtype=tf.float32), shape)
    start = layer.seed_generator.state.numpy().copy()
    whole = layer(x, training=True).numpy()  # Keras' own draw for 6 samples
    layer.seed_generator.state.assign(start)
    draws = window_dropout.WindowDraws.for_model(keras.Sequential([keras.Input(shape[1:]), layer]))
    draws.starts[0].assign(start)  # the window's seed: samples 2-4 come second

    @tf.function(input_signature=[tf.TensorSpec([None, *shape[1:]])])
    def samples_2_to_4(part):
        samples = tf.cast(tf.shape(part)[0], tf.int64)
        with draws.drawing(tf.constant(False), tf.constant(2, tf.int64), samples, part.shape[0]):
            return layer(part, training=True)

    np.testing.assert_array_equal(samples_2_to_4(x[2:5]).numpy(), whole[2:5])


def test_float64_draws_are_not_drawn_in_rows():
    # Two 32-bit numbers per element: the rows would start elsewhere.
    assert not window_dropout.draws_rows_exactly("float64", False)


def _dropout_model(cls, rate=0.3):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    x = keras.layers.Dropout(rate, seed=7, name="drop")(x)
    x = keras.layers.Dense(8)(x)
    x = keras.layers.Dropout(rate, noise_shape=(None, 1), seed=8, name="per_sample")(x)
    return cls(inputs, keras.layers.Dense(1)(x))


def _twelve_samples():
    rng = np.random.default_rng(3)
    return (rng.normal(size=(12, 5)).astype("float32"),
            rng.normal(size=(12, 1)).astype("float32"))


def _windows_of_3(jit_compile="auto"):
    """`_dropout_model` boosted: SGD(0.1), windows of 3 micro-batches."""
    model = _dropout_model(GradBoostModel)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=3,
        jit_compile=jit_compile,
    )
    return model


def _generators(model):
    return [g for layer in model._flatten_layers() for g in held_generators(layer)]


def _seed_states(model):
    return [
        g.state.numpy().tolist()
        for layer in model._flatten_layers()
        for g in held_generators(layer)
    ]


def _fit_both(build, x, y, large, micro, steps, epochs=2, boost=None, **compile_kwargs):
    """Keras' own fit with batches of `large`, and GradBoostModel's with
    `steps` micro-batches of `micro` (a partial window at each epoch's end
    where the samples do not divide)."""
    ref = build(keras.Model)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    ref.fit(x, y, batch_size=large, epochs=epochs, shuffle=False, verbose=0)
    model = build(GradBoostModel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=steps,
            **compile_kwargs, **(boost or {}),
        )
        model.fit(x, y, batch_size=micro, epochs=epochs, shuffle=False, verbose=0)
    said = [str(w.message) for w in caught if "draw" in str(w.message)]
    return ref, model, said


@pytest.mark.parametrize("jit_compile, steps_per_execution", [(False, 1), (True, 1), (False, 3)])
def test_a_window_with_dropout_is_one_large_batch_step(jit_compile, steps_per_execution):
    # 20 samples: windows of 12 and 8 (a partial one, flushed), two epochs.
    # Before, each micro-batch drew masks of its own: 1.2 away from Keras'
    # large-batch steps, of the 1.4 training moved the weights.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 5)).astype("float32")
    y = rng.normal(size=(20, 1)).astype("float32")
    ref, model, said = _fit_both(
        _dropout_model, x, y, 12, 4, 3, jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
    )
    assert not said
    assert max_weight_diff(model, ref) < TOL
    assert max_weight_diff(ref, _dropout_model(keras.Model)) > 0.5  # training moved them
    assert _seed_states(model) == _seed_states(ref)  # moved once per window


def _recurrent_model(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 3))
    seq = keras.layers.LSTM(
        6, dropout=0.3, recurrent_dropout=0.2, return_sequences=True, seed=1)(inputs)
    seq = keras.layers.GRU(
        6, dropout=0.2, recurrent_dropout=0.3, return_sequences=True, seed=2)(seq)
    seq = keras.layers.Attention(dropout=0.4, seed=3)([seq, seq])
    seq = keras.layers.SpatialDropout1D(0.3, seed=4)(seq)
    return cls(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(seq)))


def test_rnn_attention_and_spatial_dropout_windows_are_exact():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(10, 4, 3)).astype("float32")
    y = rng.normal(size=(10, 1)).astype("float32")
    ref, model, said = _fit_both(_recurrent_model, x, y, 6, 2, 3)  # windows of 6 and 4
    assert not said
    assert max_weight_diff(model, ref) < TOL
    assert _seed_states(model) == _seed_states(ref)


class _Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, activation="gelu")
        self.drop = keras.layers.Dropout(0.4, seed=5)

    def call(self, x, training=None):
        return x + self.drop(self.dense(x), training=training)


def _block_model(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = _Block(name="block")(inputs)
    return cls(inputs, keras.layers.Dense(1)(x))


def test_a_recomputed_block_replays_its_rows_of_the_window_mask():
    # The replay must draw what the forward drew: the same rows, seed and
    # generator state as read before the forward.
    rng = np.random.default_rng(2)
    x = rng.normal(size=(12, 8)).astype("float32")
    y = rng.normal(size=(12, 1)).astype("float32")
    ref, model, said = _fit_both(_block_model, x, y, 6, 3, 2, boost={"recompute": ["block"]})
    assert not said
    assert model.recompute_plan().recomputed == ["block"]
    assert max_weight_diff(model, ref) < TOL


class _Noisy(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noise = keras.layers.GaussianNoise(0.1, name="noise")
        self.drop = keras.layers.Dropout(0.2, name="drop")

    def call(self, x, training=None):
        return self.drop(self.noise(x, training=training), training=training)


def test_other_random_layers_are_still_named_and_dropout_is_not():
    # Two blocks name their layers alike (as keras-hub's do): each name once.
    inputs = keras.Input((5,))
    x = _Noisy(name="first")(inputs)
    x = _Noisy(name="second")(x)
    model = GradBoostModel(inputs, keras.layers.Dense(1)(x))
    said = r"draw random numbers \('noise'; 2 layers, e\.g\."
    with pytest.warns(UserWarning, match=said) as caught:
        model.compile(optimizer="sgd", loss="mse", accumulate_steps=2)
    assert not any("'drop'" in str(w.message) for w in caught)


class OwnMinimizeStep(GradBoostModel):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x, training=True) - y) ** 2)
        self.minimize(tape, loss, count=tf.shape(x)[0])
        return {"loss": loss}


class OwnSuperStep(GradBoostModel):
    def train_step(self, data):
        return super().train_step(data)


def test_a_train_step_of_ones_own_is_warned_and_one_calling_gradboosts_is_exact():
    # minimize()'s micro-batches ran their forward outside GradBoostModel's
    # step: masks of their own, said when the step is traced.
    rng = np.random.default_rng(4)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    own = _dropout_model(OwnMinimizeStep)
    own.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=2)
    said = r"own train_step .* Dropout layers \('drop', 'per_sample'\)"
    with pytest.warns(UserWarning, match=said):
        own.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    ref, model, said = _fit_both(_dropout_model, x, y, 4, 2, 2)
    _, calling, said_too = _fit_both(lambda cls: _dropout_model(OwnSuperStep), x, y, 4, 2, 2)
    assert not said and not said_too
    assert max_weight_diff(calling, ref) < TOL
    assert max_weight_diff(own, ref) > 1e-3


def test_a_window_saved_mid_way_goes_on_with_its_rows_and_seeds(tmp_path):
    x, y = _twelve_samples()

    path = str(tmp_path / "mid.weights.h5")
    never_saved = _windows_of_3()
    never_saved.fit(x, y, batch_size=2, shuffle=False, verbose=0,
                    callbacks=[SaveAfterBatch(4, path)])
    loaded = _windows_of_3()
    loaded.load_weights(path)  # 2 of the second window's 3 micro-batches pending
    assert int(loaded._gradboost.accumulator.micro_step.numpy()) == 2
    loaded.fit(x[10:], y[10:], batch_size=2, shuffle=False, verbose=0)
    assert max_weight_diff(loaded, never_saved) < TOL


def test_mixed_bfloat16_windows_draw_the_large_batchs_masks():
    # Dropout draws in bfloat16 here; the sums of a bfloat16 step round
    # differently in micro-batches (2% of what training moved), where masks
    # of their own ended 86% away.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 5)).astype("float32")
    y = rng.normal(size=(20, 1)).astype("float32")

    def build(cls):
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        try:
            return _dropout_model(cls)
        finally:
            keras.mixed_precision.set_global_policy("float32")

    ref, model, said = _fit_both(build, x, y, 12, 4, 3)
    assert not said
    moved = max_weight_diff(ref, build(keras.Model))
    assert max_weight_diff(model, ref) < 0.05 * moved


def test_spatial_dropout_in_micro_batches_of_one_sample():
    # SpatialDropout gives the batch's size as the noise's first axis: at 1
    # it read as one mask for every sample (each micro-batch drew sample
    # 0's rows: 0.39 away).
    def build(cls):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4, 3))
        x = keras.layers.Dense(6, activation="tanh")(inputs)
        x = keras.layers.SpatialDropout1D(0.5, seed=3)(x)
        return cls(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(x)))

    rng = np.random.default_rng(6)
    x = rng.normal(size=(8, 4, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    ref, model, said = _fit_both(build, x, y, 4, 1, 4)
    assert not said
    assert max_weight_diff(model, ref) < TOL
    assert _seed_states(model) == _seed_states(ref)


@pytest.mark.parametrize("bad", [5, 4], ids=["mid-window", "window-start"])
def test_a_skipped_micro_batch_leaves_its_rows_and_seeds_to_the_others(bad):
    # NaNWatcher skips micro-batch `bad` (a NaN in its inputs): window (4-7)
    # is the large batch of the others, whose masks close up, drawn from the
    # seeds the window started with even where the skipped one opened it
    # (the generators had moved on: it took the moved ones, 0.28 away).
    from keras_gradboost.callbacks import NaNWatcher

    rng = np.random.default_rng(5)
    x = rng.normal(size=(16, 5)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    x[2 * bad, 0] = np.nan
    kept = [r for r in range(8, 16) if r // 2 != bad]
    ref = _dropout_model(keras.Model)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.train_on_batch(x[:8], y[:8])
    ref.train_on_batch(x[kept], y[kept])
    model = _dropout_model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=4)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0,
              callbacks=[NaNWatcher(action="skip", verbose=0)])
    assert int(model.optimizer.iterations.numpy()) == 2
    assert max_weight_diff(model, ref) < TOL
    assert _seed_states(model) == _seed_states(ref)

class _TwoOptimizers(GradBoostModel):
    """minimize()'s docstring's pattern, with a Dropout."""

    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(1)
        self.b = keras.layers.Dense(1)
        self.drop = keras.layers.Dropout(0.3, name="drop")
        self.b_optimizer = keras.optimizers.SGD(0.1)

    def call(self, x, training=None):
        return self.a(self.drop(x, training=training)) + self.b(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self.a(self.drop(x, training=True)) - y) ** 2)
        count = tf.shape(x)[0]
        self.minimize(tape, loss, self.a.trainable_weights, count=count)
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self.b(x) - y) ** 2)
        self.minimize(tape, loss, self.b.trainable_weights, self.b_optimizer, count=count)
        return {"loss": loss}


def test_minimize_with_other_optimizers_and_variables_is_warned_about():
    model = _TwoOptimizers()
    model(np.zeros((1, 3), "float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.1), accumulate_steps=2)
    with pytest.warns(UserWarning, match=r"own train_step .* Dropout layers \('drop'\)"):
        model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=2,
                  verbose=0)


def test_a_refused_draw_gives_each_micro_batch_a_mask_of_its_own():
    # A float64 Dropout cannot draw rows: Keras' draw, from the window's
    # seed folded with where the micro-batch starts (the same seed in each
    # micro-batch would give each the same mask).
    drop = keras.layers.Dropout(0.5, seed=2, dtype="float64")
    draws = window_dropout.WindowDraws([drop.seed_generator])
    ones = tf.ones((4, 16), tf.float64)

    def mask(first):
        with draws.drawing(tf.constant(first == 0), tf.constant(first, tf.int64),
                           tf.constant(4, tf.int64), 4):
            return drop(ones, training=True).numpy() > 0

    with pytest.warns(UserWarning, match="float64 draws on this TensorFlow"):
        first, second = mask(0), mask(4)
    assert (first != second).any()
    assert first.mean() not in (0.0, 1.0)


class _NoisyDropout(keras.layers.Layer):
    """Draws noise from its Dropout's generator."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = keras.layers.Dropout(0.2, seed=4, name="inner_drop")
        self.generator = self.drop.seed_generator

    def call(self, x, training=None):
        noise = keras.random.normal(keras.ops.shape(x), seed=self.generator)
        return self.drop(x + noise, training=training)


def test_a_generator_another_random_layer_draws_from_is_left_alone():
    # Started anew at each micro-batch, the noise would repeat in each.
    other = keras.layers.Dropout(0.2, seed=5, name="other")
    inputs = keras.Input((3,))
    model = GradBoostModel(inputs, other(_NoisyDropout(name="noisy")(inputs)))
    draws = window_dropout.WindowDraws.for_model(model)
    assert draws.names == ["other"]
    assert draws.ids == {id(other.seed_generator)}
    # ... and compile names both layers that draw from it.
    said = r"draw random numbers \('noisy', 'inner_drop', e\.g\."
    with pytest.warns(UserWarning, match=said):
        model.compile(optimizer="sgd", loss="mse", accumulate_steps=2)


def _time_major_model(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2, 3))
    swap = keras.layers.Lambda(lambda t: keras.ops.transpose(t, (1, 0, 2)))
    x = swap(keras.layers.Dropout(0.3, seed=1, name="time_major")(swap(inputs)))
    return cls(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(x)))


def test_a_dropout_the_graph_calls_on_a_time_major_tensor_is_named():
    # (2, batch, 3): as long as the micro-batches of 2, so no size tells it
    # apart; the functional graph does (its first axis is fixed there).
    rng = np.random.default_rng(7)
    x = rng.normal(size=(8, 2, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    _, _, said = _fit_both(_time_major_model, x, y, 4, 2, 2, epochs=1)
    assert any("draw random numbers ('time_major'" in w for w in said), said


class _Flattened(keras.layers.Layer):
    """A Dropout on (samples * 2, 3): its first axis is not the samples."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = keras.layers.Dropout(0.3, seed=1, name="flat")

    def call(self, x, training=None):
        flat = keras.ops.reshape(x, (-1, 3))
        return keras.ops.reshape(self.drop(flat, training=training), keras.ops.shape(x))


def _flattened_model(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2, 3))
    x = _Flattened()(inputs)
    return cls(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(x)))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_dropout_not_over_the_samples_inside_a_layer_is_warned_about(jit_compile):
    # Known at trace time (arrays: batches of a fixed size): warned then;
    # at run time only (no fixed size): counted in the step (XLA ignores
    # asserts) and warned at the epoch's end. Masks of their own either way.
    rng = np.random.default_rng(7)
    x = rng.normal(size=(8, 2, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    _, _, said = _fit_both(_flattened_model, x, y, 4, 2, 2, epochs=1, jit_compile=jit_compile)
    assert any("whose first axis is not the micro-batch's 2 samples" in w for w in said), said
    model = _flattened_model(GradBoostModel)
    model.compile(optimizer="sgd", loss="mse", accumulate_steps=2, jit_compile=jit_compile)
    unbatched = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)  # no fixed size
    with pytest.warns(UserWarning, match="4 Dropout draws this epoch were on a tensor"):
        model.fit(unbatched, verbose=0)


def test_jit_compile_measure_runs_each_window_under_one_setting(monkeypatch):
    # TensorFlow's random numbers under XLA are not its numbers without, so
    # a window is the large-batch step only if all its micro-batches ran
    # under one setting. Before, the measured calls alternated call by call:
    # each window drew half its masks under XLA (and XLA timed only the
    # calls that do not update). 20 samples, micro-batches of 4, windows of
    # 2: per epoch windows of 8, 8 and 4 (partial, flushed). Units of 2
    # calls that end only where a window closes: the partial window's unit
    # goes on into the next epoch's first window.
    from keras_gradboost import jit_measure

    ticks = iter(range(10**6))  # every call takes 1 s: a tie keeps no XLA
    monkeypatch.setattr(jit_measure, "perf_counter", lambda: float(next(ticks)))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(20, 5)).astype("float32")
    y = rng.normal(size=(20, 1)).astype("float32")
    model = _dropout_model(GradBoostModel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=2,
            jit_compile="measure",
        )
        model.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0)
    assert not [w for w in caught if "draw" in str(w.message)]
    assert model.jit_measurement.jit_compile is False
    assert model.jit_measurement.calls_per_timing == 2
    # The windows' settings as the schedule says (X: XLA, N: without):
    # XLA, no XLA, ... by unit; the choice (no XLA) after 8 units.
    def keras_windows(settings):
        ref = _dropout_model(keras.Model)
        ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        for epoch in settings:
            for (start, stop), xla in zip([(0, 8), (8, 16), (16, 20)], epoch):
                ref.jit_compile = xla
                ref.train_function = None  # made again under this setting
                ref.fit(
                    x[start:stop], y[start:stop], batch_size=stop - start, shuffle=False,
                    verbose=0,
                )
        return ref

    ref = keras_windows([[True, False, True]] * 3 + [[True, False, False]])
    assert max_weight_diff(model, ref) < 1e-5  # XLA's sums round otherwise
    assert max_weight_diff(ref, _dropout_model(keras.Model)) > 0.5
    assert _seed_states(model) == _seed_states(ref)
    # The control: XLA's masks are not the others here, so the settings
    # matter (every window without XLA ends far from the measured fit).
    assert max_weight_diff(model, keras_windows([[False] * 3] * 4)) > 0.05


def _saved_mid_window(path, jit_compile, unsaved_setting=False):
    """A Dropout model trained with `accumulate_steps=3` on 12 samples in
    micro-batches of 2, saved after the 5th (2 of the second window's 3
    micro-batches pending) and trained on to the end; with
    `unsaved_setting`, as a file saved before the setting was saved."""
    x, y = _twelve_samples()
    saved = _windows_of_3(jit_compile)
    if unsaved_setting:
        object.__setattr__(saved, "_pending_window_jit", lambda: None)
    saved.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[SaveAfterBatch(4, path)])
    return saved, x, y


def _resume(path, x, y, jit_compile):
    loaded = _windows_of_3(jit_compile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded.load_weights(path)  # 2 micro-batches pending
        assert int(loaded._gradboost.accumulator.micro_step.numpy()) == 2
        loaded.fit(x[10:], y[10:], batch_size=2, shuffle=False, verbose=0)
    said = [str(w.message) for w in caught if "accumulation window" in str(w.message)]
    return loaded, said


@pytest.mark.parametrize("saved_jit", [False, True, "measure"])
def test_a_restored_window_goes_on_under_the_setting_it_began_in(tmp_path, saved_jit):
    # TensorFlow's random numbers under XLA are not its numbers without, so
    # a window resumed under another setting draws other masks. The file
    # says which setting ran the window's micro-batches; jit_compile=
    # "measure" runs the rest of the window under it, untimed, and then
    # measures. The saving "measure" run's second window is its second
    # unit, without XLA. Before, the rest ran under XLA, the first measured
    # setting (with a warning): 0.15 (the file's False) and 0.09 ("measure")
    # away, of 0.37-0.40 that training moved the weights.
    path = str(tmp_path / "mid.weights.h5")
    never_stopped, x, y = _saved_mid_window(path, saved_jit)
    loaded, said = _resume(path, x, y, "measure")
    assert not said
    assert max_weight_diff(loaded, never_stopped) < TOL
    assert max_weight_diff(never_stopped, _dropout_model(keras.Model)) > 0.2  # trained
    measuring = wrappers.base_train_function(loaded)
    # The resumed calls are not measured; a measuring run's file holds its
    # progress, and the unit holding the window goes on with it.
    assert measuring.measurer.started is (saved_jit == "measure")
    # The control: a model with the other setting fixed is warned, and ends
    # elsewhere (the settings matter here).
    other = saved_jit is False or saved_jit == "measure"
    loaded, said = _resume(path, x, y, other)
    assert len(said) == 1 and "runs the rest of the window" in said[0], said
    assert f"drew their Dropout masks ('drop', 'per_sample') {'under' if not other else 'without'} XLA" in said[0]
    assert f"Compile with jit_compile={not other}" in said[0]
    assert max_weight_diff(loaded, never_stopped) > 1e-3


@pytest.mark.parametrize("jit_compile, warned", [("measure", True), (False, False)])
def test_measure_resuming_a_window_it_cannot_tell_is_warned_about(tmp_path, jit_compile, warned):
    # A file saved before the window's setting was saved.
    path = str(tmp_path / "mid.weights.h5")
    _, x, y = _saved_mid_window(path, False, unsaved_setting=True)
    loaded, said = _resume(path, x, y, jit_compile)
    assert len(said) == int(warned)
    if warned:
        assert "The 2 micro-batch(es) of the pending accumulation window" in said[0]
        assert "('drop', 'per_sample')" in said[0]
        assert "which the file does not say" in said[0]


def test_a_window_loaded_into_a_model_that_measured_goes_on_under_its_setting(tmp_path):
    # Loads into a measuring model whose schedule has begun (as a second
    # fit with a backup does): the file's setting wins over the schedule's.
    # First a fit of 4 calls (a window under XLA; then a partial one,
    # flushed, in the no-XLA unit), then a file saved under XLA: its rest
    # runs under XLA, not the unit's no XLA. Then a second file, saved
    # without XLA: not the first file's setting.
    xla_file, plain_file = str(tmp_path / "xla.weights.h5"), str(tmp_path / "plain.weights.h5")
    under_xla, x, y = _saved_mid_window(xla_file, True)
    without, _, _ = _saved_mid_window(plain_file, False)
    model = _windows_of_3("measure")
    model.fit(x[:8], y[:8], batch_size=2, shuffle=False, verbose=0)
    assert wrappers.base_train_function(model).measurer.started
    for path, never_stopped in ((xla_file, under_xla), (plain_file, without)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.load_weights(path)
            model.fit(x[10:], y[10:], batch_size=2, shuffle=False, verbose=0)
        assert not [w for w in caught if "accumulation window" in str(w.message)]
        assert max_weight_diff(model, never_stopped) < TOL, path


class SaveOnceAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch, path):
        super().__init__()
        self.at, self.path, self.epoch = (epoch, batch), path, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            self.model.save_weights(self.path)


@pytest.mark.parametrize("record_saved", [True, False], ids=["saved", "not-saved"])
@pytest.mark.parametrize("epochs", [2, 6], ids=["measuring", "decided"])
def test_measure_resumed_goes_on_with_the_saved_schedule(tmp_path, monkeypatch, epochs,
                                                         record_saved):
    # 12 samples, micro-batches of 2, windows of 3: 2 windows an epoch, one
    # unit each (XLA, no XLA, ...; 8 units decide at the end of epoch 3: a
    # tie, every call taking 1 s, keeps no XLA). Saved in the second epoch
    # from the end (2 of its first window's micro-batches pending), loaded,
    # trained on: as in the run never stopped, its last three windows run
    # XLA, no XLA, XLA while measuring (2 epochs), all without XLA once
    # decided (6). Without the saved record (as before) the loaded model
    # measures again from the start, XLA: other masks, 0.10 away.
    ticks = iter(range(10**6))
    monkeypatch.setattr(jit_measure, "perf_counter", lambda: float(next(ticks)))
    x, y = _twelve_samples()
    path = str(tmp_path / "mid.weights.h5")

    never_stopped = _windows_of_3("measure")
    if not record_saved:
        object.__setattr__(never_stopped, "_jit_state", lambda: None)
    never_stopped.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0,
                      callbacks=[SaveOnceAt(epochs - 1, 1, path)])
    assert (never_stopped.jit_measurement is not None) is (epochs == 6)
    loaded = _windows_of_3("measure")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded.load_weights(path)
        loaded.fit(x[4:], y[4:], batch_size=2, shuffle=False, verbose=0)
    assert not [w for w in caught if "accumulation window" in str(w.message)]
    if epochs == 6 and record_saved:
        assert loaded.jit_measurement.restored and loaded.jit_measurement.jit_compile is False
    difference = max_weight_diff(loaded, never_stopped)
    if record_saved:
        assert difference < TOL
    else:
        assert difference > 1e-2  # the control: the schedule matters here


def test_a_file_saved_before_measuring_starts_the_schedule_again(tmp_path):
    # A model part way through measuring loads weights saved before any
    # measuring: it goes on as a new model loading them would (from the
    # schedule's first unit), not from where it was. Before, it went on
    # from its own position: other settings, other masks.
    x, y = _twelve_samples()
    path = str(tmp_path / "start.weights.h5")

    _windows_of_3("measure").save_weights(path)
    part_way = _windows_of_3("measure")
    part_way.fit(x[:6], y[:6], batch_size=2, shuffle=False, verbose=0)  # one unit, XLA
    new = _windows_of_3("measure")
    part_way.load_weights(path)
    new.load_weights(path)
    # Keras' save_weights leaves the seed generators out: start both alike.
    for mine, theirs in zip(_generators(part_way), _generators(new)):
        mine.state.assign(theirs.state)
    for model in (part_way, new):
        model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(part_way, new) < TOL
    assert max_weight_diff(new, _dropout_model(keras.Model)) > 0.2  # trained


def test_a_window_saved_while_resuming_keeps_its_setting(tmp_path):
    # Saved, loaded into "measure" and saved again before the window closes:
    # the second file says what the first said (the restored setting, not
    # this process's first measured one).
    first, second = str(tmp_path / "first.weights.h5"), str(tmp_path / "second.weights.h5")
    never_stopped, x, y = _saved_mid_window(first, False)
    loaded = _windows_of_3("measure")
    loaded.load_weights(first)
    loaded.save_weights(second)  # no call since the load
    again, said = _resume(second, x, y, "measure")
    assert not said
    assert max_weight_diff(again, never_stopped) < TOL


def test_other_draws_from_a_dropouts_generator_are_warned_about():
    # A layer drawing keras.random.normal from a Dropout's generator that it
    # does not hold (so `exact_generators` cannot see it): the generator
    # starts each micro-batch from the window's state, so that noise would
    # repeat in every micro-batch of a window, silently.
    drop = keras.layers.Dropout(0.3, seed=5, name="drop")
    borrowed = [drop.seed_generator]

    class Jitter(keras.layers.Layer):
        def call(self, x, training=False):
            if not training:
                return x
            return x + 0.1 * keras.random.normal(keras.ops.shape(x), seed=borrowed[0])

    def build(cls):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        x = drop(keras.layers.Dense(8)(inputs))
        return cls(inputs, keras.layers.Dense(1)(Jitter()(x)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    model = build(GradBoostModel)
    model.compile(optimizer="sgd", loss="mse", accumulate_steps=2)
    with pytest.warns(UserWarning, match=r"generator of layer 'drop' was drawn from 1 time"):
        model.fit(x, y, batch_size=2, verbose=0)
    assert "next" not in vars(drop.seed_generator)  # put back after the trace


def test_a_loss_scales_own_overflow_adds_no_rows():
    # A dynamic loss scale's overflow drops the micro-batch without calling
    # it dropped (not a real non-finite step): its rows must not count.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((1,))
    hidden = keras.layers.Dropout(0.1, seed=1)(inputs)
    model = GradBoostModel(inputs, keras.layers.Dense(1, use_bias=False)(hidden))
    model.compile(optimizer="sgd", loss="mse", accumulate_steps=4, loss_scale="dynamic")
    ones, zeros = np.ones((2, 1), "float32"), np.zeros((2, 1), "float32")
    model.train_on_batch(ones, zeros)
    model.train_on_batch(ones, zeros)
    acc = model._gradboost.accumulator
    assert int(acc.rows.numpy()) == 4
    huge = np.full((4, 1), 1e18, "float32")  # the loss is finite, its scaled gradient not
    logs = model.train_on_batch(huge, np.zeros((4, 1), "float32"), return_dict=True)
    assert logs["loss_scale"] == 2.0**14 and int(model._gradboost.facts.nonfinite_steps.numpy()) == 0
    assert int(acc.micro_step.numpy()) == 3 and int(acc.rows.numpy()) == 4


def test_a_batch_size_the_input_fixes_is_the_samples_axis():
    # keras.Input(batch_size=4): every tensor's first axis is 4, the
    # samples', not a time-major one's.
    inputs = keras.Input((5,), batch_size=4)
    x = keras.layers.Dense(8, activation="tanh")(inputs)
    x = keras.layers.Dropout(0.3, seed=2, name="fixed")(x)
    model = GradBoostModel(inputs, keras.layers.Dense(1)(x))
    assert window_dropout.WindowDraws.for_model(model).names == ["fixed"]
