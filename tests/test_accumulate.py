"""Accumulation against its independent reference: one large-batch step."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import frozen_base_classifier
from conftest import max_weight_diff
from conftest import rnn_states
from conftest import small_model
from conftest import stateful_rnn_data
from conftest import stateful_rnn_model
from keras_gradboost import GradBoostModel
from keras_gradboost.accumulate import accumulate
from keras_gradboost.accumulate import repeats_change_update

TOL = 2e-6  # float32 round-off on weights of magnitude ~1


def test_accumulate_formula_matches_concatenated_mean():
    rng = np.random.default_rng(1)
    per_sample = rng.normal(size=(13, 4))  # per-sample gradients
    sizes = [5, 5, 3]
    acc, start = [np.zeros(4)], 0
    for n in sizes:
        batch_mean = per_sample[start : start + n].mean(axis=0)
        acc = accumulate(acc, [batch_mean], n)
        start += n
    np.testing.assert_allclose(acc[0] / sum(sizes), per_sample.mean(axis=0))
    # Equal weighting of micro-batch means (Keras' own) is not the same.
    equal = np.mean([per_sample[:5].mean(0), per_sample[5:10].mean(0), per_sample[10:].mean(0)], 0)
    assert np.abs(equal - per_sample.mean(axis=0)).max() > 1e-3
    # None gradients leave the accumulator alone.
    assert accumulate([np.ones(2)], [None], 3)[0].tolist() == [1.0, 1.0]


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_momentum_clipnorm": lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.05),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw_global_clipnorm": lambda: keras.optimizers.AdamW(0.01, global_clipnorm=0.1),
}


def _large_batch_reference(x, y, optimizer, splits, sample_weight=None, **compile_kwargs):
    """A plain keras.Model trained with one train_on_batch per update window."""
    ref = small_model()
    ref.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    for lo, hi in splits:
        sw = None if sample_weight is None else sample_weight[lo:hi]
        ref.train_on_batch(x[lo:hi], y[lo:hi], sample_weight=sw)
    return ref


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_uneven_micro_batches_equal_one_large_step(regression_data, name, jit_compile):
    x, y = regression_data  # 104 samples: micro-batches 32, 32, 32, 8
    ref = _large_batch_reference(x, y, OPTIMIZERS[name](), [(0, 104)])
    model = small_model(GradBoostModel)
    model.compile(
        optimizer=OPTIMIZERS[name](),
        loss="mse",
        accumulate_steps=4,
        jit_compile=jit_compile,
    )
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_weight_diff(model, ref) < TOL


def test_keras_own_accumulation_is_wrong_on_uneven_batches(regression_data):
    # Why this feature exists: the check above fails for Keras' own option.
    x, y = regression_data
    ref = _large_batch_reference(x, y, keras.optimizers.SGD(0.1), [(0, 104)])
    model = small_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), loss="mse"
    )
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert max_weight_diff(model, ref) > 100 * TOL


def test_epoch_remainder_is_applied_at_epoch_end_not_carried(regression_data):
    x, y = regression_data  # batch 24: 5 micro-batches (24,24,24,24,8) per epoch
    ref = _large_batch_reference(
        x, y, keras.optimizers.Adam(0.01), [(0, 96), (96, 104)] * 2
    )
    model = small_model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", accumulate_steps=4)
    history = model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert max_weight_diff(model, ref) < TOL
    assert len(history.history["loss"]) == 2


def test_an_epoch_ending_on_a_window_boundary_traces_no_flush(regression_data):
    """Nothing pending at the epoch's end: no flush runs, and none is traced
    (it traces the optimizer's update once more); a remainder still is."""
    x, y = regression_data
    ref = _large_batch_reference(x, y, keras.optimizers.Adam(0.01), [(0, 96)] * 2)
    model = small_model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", accumulate_steps=4)
    model.fit(x[:96], y[:96], batch_size=24, epochs=2, shuffle=False, verbose=0)
    assert model._gradboost.flush_function is None
    assert int(model.optimizer.iterations.numpy()) == 2
    assert max_weight_diff(model, ref) < TOL
    model.fit(x[:104], y[:104], batch_size=24, epochs=1, shuffle=False, verbose=0)
    assert model._gradboost.flush_function is not None
    assert int(model.optimizer.iterations.numpy()) == 4


def test_validation_and_checkpoint_see_the_flushed_remainder(regression_data, tmp_path):
    x, y = regression_data
    model = small_model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=4)
    path = str(tmp_path / "last.weights.h5")
    history = model.fit(
        x, y, batch_size=24, shuffle=False, verbose=0,
        validation_data=(x, y),
        callbacks=[keras.callbacks.ModelCheckpoint(path, save_weights_only=True)],
    )
    assert int(model.optimizer.iterations.numpy()) == 2
    after = model.evaluate(x, y, verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][-1], after, rtol=1e-6)
    saved = small_model(GradBoostModel)
    saved.load_weights(path)
    assert max_weight_diff(saved, model) == 0.0


def test_sample_weights_match_weighted_large_batch(regression_data):
    x, y = regression_data
    sw = np.random.default_rng(2).uniform(0.0, 3.0, size=104).astype("float32")
    ref = _large_batch_reference(x, y, keras.optimizers.Adam(0.01), [(0, 104)], sample_weight=sw)
    model = small_model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", accumulate_steps=4)
    model.fit(x, y, sample_weight=sw, batch_size=32, shuffle=False, verbose=0)
    assert max_weight_diff(model, ref) < TOL


def test_class_weights_match_weighted_large_batch():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 5)).astype("float32")
    labels = rng.integers(0, 3, size=40)
    y = keras.utils.to_categorical(labels, 3)
    class_weight = {0: 1.0, 1: 3.0, 2: 0.5}

    def build(cls):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        outputs = keras.layers.Dense(3, activation="softmax")(inputs)
        return cls(inputs, outputs)

    ref = build(keras.Model)
    ref.compile(optimizer=keras.optimizers.SGD(0.5), loss="categorical_crossentropy")
    sw = np.array([class_weight[int(c)] for c in labels], dtype="float32")
    ref.train_on_batch(x, y, sample_weight=sw)
    model = build(GradBoostModel)
    model.compile(
        optimizer=keras.optimizers.SGD(0.5), loss="categorical_crossentropy", accumulate_steps=3
    )
    model.fit(x, y, batch_size=16, class_weight=class_weight, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_weight_diff(model, ref) < TOL


@pytest.mark.parametrize("jit_compile", [False, True])
def test_steps_per_execution(regression_data, jit_compile):
    x, y = regression_data  # batch 16: 7 micro-batches -> updates on 4 and 3
    ref = _large_batch_reference(x, y, keras.optimizers.Adam(0.01), [(0, 64), (64, 104)])
    model = small_model(GradBoostModel)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        accumulate_steps=4,
        steps_per_execution=3,
        jit_compile=jit_compile,
    )
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert max_weight_diff(model, ref) < TOL


def test_loss_is_reported_per_micro_batch(regression_data):
    x, y = regression_data
    plain = small_model()
    plain.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=["mae"])
    model = small_model(GradBoostModel)
    model.compile(
        optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=["mae"], accumulate_steps=4
    )
    # With a zero learning rate the weights never move, so the epoch's mean
    # loss over micro-batches must equal the plain model's.
    h_plain = plain.fit(x, y, batch_size=32, shuffle=False, verbose=0).history
    h_model = model.fit(x, y, batch_size=32, shuffle=False, verbose=0).history
    np.testing.assert_allclose(h_model["loss"], h_plain["loss"], rtol=1e-6)
    np.testing.assert_allclose(h_model["mae"], h_plain["mae"], rtol=1e-6)


@pytest.mark.parametrize("traced", [False, True])
def test_train_on_batch_then_flush(regression_data, traced):
    """Traced in a user's tf.function, the flush cannot read the window on
    the host: its own traced condition decides, pending or not."""
    x, y = regression_data
    ref = _large_batch_reference(x, y, keras.optimizers.SGD(0.1), [(0, 48)])
    model = small_model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=4)
    model.train_on_batch(x[:32], y[:32])
    model.train_on_batch(x[32:48], y[32:48])
    assert int(model.optimizer.iterations.numpy()) == 0
    flush = model.flush_accumulated_gradients
    if traced:
        flush = tf.function(flush)
    flush()
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_weight_diff(model, ref) < TOL
    flush()  # nothing pending: no update
    assert int(model.optimizer.iterations.numpy()) == 1


def test_refuses_optimizer_gradient_accumulation_steps():
    model = small_model(GradBoostModel)
    with pytest.raises(ValueError) as info:
        model.compile(
            optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2),
            loss="mse",
            accumulate_steps=4,
        )
    assert "accumulate_steps=4" in str(info.value)
    assert "gradient_accumulation_steps=2" in str(info.value)
    assert "Set only one" in str(info.value)


def test_batch_normalization_warning_names_layers():
    inputs = keras.Input((5,))
    x = keras.layers.Dense(4)(inputs)
    x = keras.layers.BatchNormalization(name="bn_1")(x)
    model = GradBoostModel(inputs, keras.layers.Dense(1)(x))
    with pytest.warns(UserWarning, match=r"accumulate_steps=2.*\(bn_1\)"):
        model.compile(optimizer="sgd", loss="mse", accumulate_steps=2)


@pytest.mark.parametrize("kind, rate", [
    ("noise", 0.1), ("noise", 0.0), ("dropout", 0.1), ("lstm", 0.2)])
def test_a_layer_drawing_random_numbers_is_warned_about(kind, rate):
    # Each micro-batch draws its own GaussianNoise, so a window differs
    # from the large batch by that randomness. At stddev 0 nothing is
    # drawn. Dropout and an LSTM's dropout draw the large batch's masks
    # (test_window_dropout.py): nothing to say.
    inputs = keras.Input((3, 5))
    if kind == "noise":
        x = keras.layers.GaussianNoise(rate, name="noise")(keras.layers.Flatten()(inputs))
    elif kind == "dropout":
        x = keras.layers.Dropout(rate, name="drop")(keras.layers.Flatten()(inputs))
    else:
        x = keras.layers.LSTM(4, dropout=rate, name="lstm")(inputs)
    model = GradBoostModel(inputs, keras.layers.Dense(1)(x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer="sgd", loss="mse", accumulate_steps=2)
    said = [str(w.message) for w in caught if "draw random numbers" in str(w.message)]
    if kind == "noise" and rate:
        assert len(said) == 1 and "('noise', e.g. Dropout masks)" in said[0], said
        assert "not the one a large-batch step would draw" in said[0]
    else:
        assert not said


@pytest.mark.parametrize("rnn", [keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN])
def test_accumulate_check_turns_an_rnns_dropout_off_on_both_sides(rnn):
    # The check ran the RNN's cell as the identity, as it runs Dropout,
    # and the RNN failed (a cell returns its states too).
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3, 5)).astype("float32"), rng.normal(size=(16, 1))
    inputs = keras.Input((3, 5))
    h = rnn(4, dropout=0.2, recurrent_dropout=0.1, name="rnn")(inputs)
    model = GradBoostModel(inputs, keras.layers.Dense(1)(h))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the random-layer warning
        model.compile(optimizer="sgd", loss="mse", accumulate_steps=2, accumulate_check=True)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)  # passes
    cell = model.get_layer("rnn").cell
    assert (cell.dropout, cell.recurrent_dropout) == (0.2, 0.1)  # put back


def test_a_stateful_rnn_window_sums_consecutive_batches_and_warns():
    # No large batch equals a window of a stateful RNN (its batch size is
    # fixed; each micro-batch starts from the state the one before left):
    # compile says so, naming the layers, and the window's update is what
    # the warning says, against a hand-written loop on a plain model.
    x, y = stateful_rnn_data(8)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = stateful_rnn_model(GradBoostModel)
    with pytest.warns(UserWarning, match=r"stateful RNN layers \('lstm', 'gru'\)"):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, accumulate_steps=2)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    reference = stateful_rnn_model()
    grads = []
    for part in (slice(0, 4), slice(4, 8)):
        with tf.GradientTape() as tape:
            value = loss(y[part], reference(x[part], training=True))
        grads.append(tape.gradient(value, reference.trainable_variables))
    for variable, first, second in zip(reference.trainable_variables, *grads):
        variable.assign(variable - 0.1 * (first + second) / 2)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_weight_diff(model, reference) < TOL
    for a, b in zip(rnn_states(model), rnn_states(reference)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_accumulate_check_on_a_stateful_rnn_is_refused_by_name():
    # It compares a window with its micro-batches concatenated, which a
    # stateful RNN cannot run (it failed inside LSTM.call with "Iterating
    # over a symbolic `tf.Tensor` is not allowed").
    model = stateful_rnn_model(GradBoostModel)
    with pytest.raises(ValueError, match=r"accumulate_check=True.*\('lstm', 'gru'\).*Drop accumulate_check"):
        model.compile(optimizer="sgd", loss="mse", accumulate_steps=2, accumulate_check=True)


def test_a_frozen_keras_applications_base_is_exact_and_not_warned_about():
    # keras.io's transfer learning: a frozen base's BatchNormalization runs in
    # inference mode (Keras: `training and self.trainable`), so a window is
    # the large batch exactly; compile named its 52 layers as a cause.
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 32, 32, 3), dtype="float32"), np.arange(16) % 3
    runs = []
    for steps, batch in ((1, 16), (4, 4)):
        model = frozen_base_classifier(GradBoostModel)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning at all
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                accumulate_steps=steps,
                accumulate_check=steps > 1,
            )
        model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        runs.append(model)
    large, windows = runs
    assert int(windows.optimizer.iterations.numpy()) == 2
    assert max_weight_diff(windows, large) < TOL


def test_evaluate_from_a_callback_does_not_split_a_window(regression_data):
    x, y = regression_data

    class EvaluateEveryBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.evaluate(x[:8], y[:8], verbose=0)

    ref = _large_batch_reference(x, y, keras.optimizers.SGD(0.1), [(0, 104)])
    model = small_model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=4)
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[EvaluateEveryBatch()])
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_weight_diff(model, ref) < TOL


def test_non_default_loss_reduction_warns():
    model = small_model(GradBoostModel)
    with pytest.warns(UserWarning, match=r"reduction='sum'"):
        model.compile(
            optimizer="sgd",
            loss=keras.losses.MeanSquaredError(reduction="sum"),
            accumulate_steps=2,
        )


_OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.1),
    "SGD, momentum, weight decay": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "SGD, clipnorm": lambda: keras.optimizers.SGD(0.1, clipnorm=0.5),
    "SGD, global_clipnorm": lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5),
    "SGD, clipvalue": lambda: keras.optimizers.SGD(0.1, clipvalue=0.3),
    "Adam": lambda: keras.optimizers.Adam(0.1),
    "AdamW": lambda: keras.optimizers.AdamW(0.1),
    "RMSprop": lambda: keras.optimizers.RMSprop(0.1),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "LossScaleOptimizer(SGD)": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=1.0),
    "LossScaleOptimizer(Adam)": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.1), initial_scale=1.0),
}


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_repeats_change_update_says_when_keras_updates_differ(name):
    """The reference: Keras' own update, two steps, from an Embedding's
    sparse gradient with a repeated row, against the same gradient summed
    per row (what an accumulation window keeps)."""
    ids = tf.constant([0, 0, 2, 0])
    upstream = tf.constant([[1.0, 2.0], [-1.0, 1.5], [3.0, 3.0], [0.5, -4.0]])
    results = []
    for densify in (False, True):
        embedding = keras.layers.Embedding(3, 2)
        embedding.build((None,))
        embedding.embeddings.assign(np.ones((3, 2), "float32"))
        optimizer = _OPTIMIZERS[name]()
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(embedding(ids) * upstream)
            (grad,) = tape.gradient(loss, [embedding.embeddings])
            assert isinstance(grad, tf.IndexedSlices)
            if densify:
                grad = tf.convert_to_tensor(grad)
            optimizer.apply_gradients([(grad, embedding.embeddings)])
        results.append(embedding.embeddings.numpy())
    equal = np.allclose(results[0], results[1], atol=1e-6)
    reason = repeats_change_update(_OPTIMIZERS[name]())
    assert (reason is None) == equal, (reason, results)
    if reason is not None:
        assert "clip" in reason or name.split("(")[-1].rstrip(")") in reason


def _activity_model(cls=keras.Model, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(
        8, activation="tanh", activity_regularizer=keras.regularizers.L2(0.5), name="sparse"
    )(inputs)
    return cls(inputs, keras.layers.Dense(3, name="out")(h))


def test_activity_regularizers_equal_one_large_step_or_warn(regression_data):
    """Keras adds an activity regularizer's loss from inside the forward. Where
    it divides it by the batch size (a mean over samples), a window's
    weighted average gives the large batch's, silently and exactly; where
    it adds the sum (Keras 3.8), the window's is 1/k of it: warned."""
    from keras_gradboost.accumulate import activity_losses_are_means

    x, y = regression_data
    ref = _activity_model()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.train_on_batch(x[:96], y[:96])
    model = _activity_model(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x[:96], y[:96], batch_size=32, shuffle=False, verbose=0)
    warned = [w for w in caught if "add losses of their own" in str(w.message)]
    if activity_losses_are_means():
        assert not warned
        assert max_weight_diff(model, ref) < TOL
    else:
        assert warned and "'sparse'" in str(warned[0].message)
        assert max_weight_diff(model, ref) > 1e-4  # why it warns


def test_an_activity_regularizer_under_a_mask_weighting_warns():
    """Micro-batches weighted by their valid mask entries (as Keras divides
    a masked loss) weight a mean over samples wrongly: 0.027 away from the
    large batch, silently, with an L2 activity regularizer."""
    def make(cls=keras.Model):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,), dtype="int32")
        h = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
        h = keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2(0.5), name="act")(h)
        return cls(inputs, keras.layers.Dense(3)(h))

    rng = np.random.default_rng(0)
    x = rng.integers(1, 20, size=(8, 6)).astype("int32")
    x[:4, 2:] = 0  # the first micro-batch: 2 valid tokens a row; the second: 6
    y = rng.integers(0, 3, size=(8, 6))
    model = make(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy",
                  accumulate_steps=2)
    with pytest.warns(UserWarning, match="'act' add losses of their own.*valid mask entries"):
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
