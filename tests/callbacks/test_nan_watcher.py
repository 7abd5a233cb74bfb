"""NaNWatcher against planted faults at known layers and steps."""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import KERAS_VERSION
from conftest import TF_VERSION
from conftest import rnn_states
from conftest import shared_mirrored_strategy
from conftest import stateful_rnn_data
from conftest import stateful_rnn_model
from keras_gradboost import GradBoostModel
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import nan_watcher as nan_watcher_module
from keras_gradboost.callbacks import NonFiniteError

BAD_STEP = 5  # batch 5 of 8 (batch size 5) holds the poisoned sample


class BadLog(keras.layers.Layer):
    """log(x): NaN in the forward pass where x < 0."""

    def call(self, x):
        return tf.math.log(x)


class SqrtLayer(keras.layers.Layer):
    """sqrt(x): finite forward at x = 0, infinite gradient there."""

    def call(self, x):
        return tf.sqrt(x)


def _data(poison=True):
    x = np.abs(np.random.default_rng(0).normal(size=(40, 3))).astype("float32") + 1.0
    if poison:
        x[BAD_STEP * 5 + 2] = -100.0
    y = np.ones((40, 2), "float32")
    return x, y


def _functional(cls=keras.Model, fault=BadLog):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="d1")(inputs)
    h = fault(name="fault")(h)
    outputs = keras.layers.Dense(2, name="out")(h)
    model = cls(inputs, outputs)
    _positive_first_layer(model)
    return model


def _sequential(cls=None, fault=BadLog):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="d1"),
            fault(name="fault"),
            keras.layers.Dense(2, name="out"),
        ]
    )
    _positive_first_layer(model)
    return model


class Subclassed(keras.Model):
    def __init__(self, fault=BadLog):
        super().__init__()
        self.d1 = keras.layers.Dense(4, name="d1")
        self.fault = fault(name="fault")
        self.out = keras.layers.Dense(2, name="out")

    def call(self, x):
        return self.out(self.fault(self.d1(x)))


def _subclassed(cls=None, fault=BadLog):
    keras.utils.set_random_seed(0)
    model = Subclassed(fault)
    model(np.ones((1, 3), "float32"))
    _positive_first_layer(model)
    return model


def _positive_first_layer(model):
    # d1(x) = [x, 1] for x >= 1: finite log/sqrt except for the poisoned row.
    d1 = next(l for l in model.layers if l.name == "d1")
    d1.set_weights([np.eye(3, 4, dtype="float32"), np.ones(4, "float32")])


def _weights_before_bad_step(build, x, y, skip_bad=False, steps=BAD_STEP):
    """Independent reference: the same model trained without the watcher on
    the batches it should have applied."""
    ref = build()
    ref.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    for b in range(steps):
        if skip_bad and b == BAD_STEP:
            continue
        ref.train_on_batch(x[b * 5 : b * 5 + 5], y[b * 5 : b * 5 + 5])
    return ref.get_weights()


def _assert_weights(model, expected):
    for a, b in zip(model.get_weights(), expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


BUILDERS = {"functional": _functional, "sequential": _sequential, "subclassed": _subclassed}


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_stop_names_layer_and_keeps_last_good_weights(kind, jit_compile):
    build = BUILDERS[kind]
    x, y = _data()
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=jit_compile)
    watcher = NaNWatcher(verbose=0)
    with pytest.raises(NonFiniteError) as info:
        model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    event = info.value.event
    assert watcher.events == [event]
    assert (event.epoch, event.step, event.phase, event.layer) == (0, BAD_STEP, "forward", "fault")
    assert event.action_taken == "stopped"
    assert event.float32_finite is None  # a float32 model
    assert "fault" in str(info.value) and "learning rate" in str(info.value)
    assert int(model.optimizer.iterations.numpy()) == BAD_STEP
    _assert_weights(model, _weights_before_bad_step(build, x, y))


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_skip_drops_only_the_bad_step(cls, capsys):
    x, y = _data()
    model = _functional(cls)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    watcher = NaNWatcher(action="skip", verbose=0)
    history = model.fit(x, y, batch_size=5, shuffle=False, verbose=1, callbacks=[watcher])
    assert [(e.step, e.layer, e.action_taken) for e in watcher.events] == [(BAD_STEP, "fault", "skipped")]
    assert history.history["nonfinite_steps"] == [1.0]
    # The progress bar shows it; Keras before 3.15 averages every log over
    # the epoch's steps there (History above keeps the count).
    shown = "nonfinite_steps: 1" if KERAS_VERSION >= (3, 15) else "nonfinite_steps: "
    assert shown in capsys.readouterr().out
    assert int(model.optimizer.iterations.numpy()) == 7
    _assert_weights(model, _weights_before_bad_step(lambda: _functional(cls), x, y, skip_bad=True, steps=8))


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
@pytest.mark.parametrize("action", ["skip", "stop"])
def test_a_dropped_step_puts_a_stateful_rnns_states_back(cls, action):
    # A stateful RNN writes its states (variables Keras does not list among
    # the model's) in the forward pass. Before, a NaN batch left them NaN:
    # "skip" then skipped every later step, blaming 'lstm_cell' for "a
    # non-finite output from finite inputs", and "stop" ended with NaN
    # states. The run must equal training on the good batches alone.
    x, y = stateful_rnn_data()
    bad = x.copy()
    bad[8:12] = np.nan  # batch 2 of 6
    model = stateful_rnn_model(cls)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    watcher = NaNWatcher(action=action, verbose=0)
    try:
        model.fit(bad, y, batch_size=4, shuffle=False, verbose=0, callbacks=[watcher])
    except NonFiniteError:
        assert action == "stop"
    assert [(e.step, e.action_taken) for e in watcher.events] == [(2, action + "ped" if action == "stop" else "skipped")]
    good = np.r_[0:8, 12:24] if action == "skip" else np.r_[0:8]
    reference = stateful_rnn_model()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(x[good], y[good], batch_size=4, shuffle=False, verbose=0)
    _assert_weights(model, reference.get_weights())
    for got, want in zip(rnn_states(model), rnn_states(reference)):
        np.testing.assert_allclose(got, want, atol=1e-6)


class ActivationMean(keras.layers.Layer):
    """The identity, tracking the mean of its input in a metric of its own
    (a layer's `keras.metrics.Mean`, shown in the logs)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tracker = keras.metrics.Mean(name="activation_mean")

    def call(self, x):
        self.tracker.update_state(tf.reduce_mean(x))
        return x


def _tracked(cls=keras.Model):
    model = _functional(cls)
    outputs = ActivationMean(name="track")(model.outputs[0])
    return cls(model.inputs, outputs)


# A metric by name, or an object, whose variables exist before Keras builds
# the compiled metrics in the first trace (they were reset on every dropped
# step: 1.111 where the good batches give 1.079, silently).
METRICS = {
    "name": lambda: ["mae"],
    "object": lambda: [keras.metrics.MeanAbsoluteError(name="mae")],
}


@pytest.mark.parametrize("metric", sorted(METRICS))
@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_skip_keeps_the_bad_steps_loss_and_metrics_out_of_the_logs(cls, metric):
    # Keras updates the loss tracker, the compiled metrics and a layer's own
    # metrics in every step, applied or not. Before, a skipped NaN batch
    # made the epoch's loss and metrics NaN in History, and Keras'
    # TerminateOnNaN ended the run the watcher was skipping the batch for.
    # The logs must equal those of a run on the good batches alone.
    x, y = _data()
    model = _tracked(cls)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=METRICS[metric]())
    watcher = NaNWatcher(action="skip", verbose=0)
    history = model.fit(
        x, y, batch_size=5, shuffle=False, verbose=0,
        callbacks=[watcher, keras.callbacks.TerminateOnNaN()],
    )
    assert [e.step for e in watcher.events] == [BAD_STEP]
    assert int(model.optimizer.iterations.numpy()) == 7  # not terminated
    good = np.r_[0 : BAD_STEP * 5, BAD_STEP * 5 + 5 : 40]
    reference = _tracked()
    reference.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=METRICS[metric]())
    expected = reference.fit(x[good], y[good], batch_size=5, shuffle=False, verbose=0)
    for name in ("loss", "mae", "activation_mean"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)
    _assert_weights(model, reference.get_weights())


class BatchLosses(keras.callbacks.Callback):
    """The `loss` of every batch's logs."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_dropped_first_step_logs_nan_then_the_applied_steps(run_eagerly):
    # Before any applied step the epoch's mean is of nothing: NaN, not the
    # 0.0 of reset metrics (ModelCheckpoint(save_best_only=True) would take
    # 0.0 as the best loss ever). Keras builds the compiled metrics inside
    # the first step; eagerly, none of their values was taken before it,
    # and the dropped step's "mae" stayed NaN for the epoch.
    x, y = _data(poison=False)
    bad = x.copy()
    bad[2] = -100.0  # batch 0
    runs = []
    for data, rows in ((bad, np.arange(40)), (x, np.arange(5, 40))):
        model = _functional()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"],
                      run_eagerly=run_eagerly)
        logged = BatchLosses()
        callbacks = [logged] + ([NaNWatcher(action="skip", verbose=0)] if data is bad else [])
        history = model.fit(data[rows], y[rows], batch_size=5, shuffle=False, verbose=0,
                            callbacks=callbacks)
        runs.append((logged.losses, history.history))
    (losses, history), (expected_losses, expected) = runs
    assert np.isnan(losses[0])
    np.testing.assert_allclose(losses[1:], expected_losses, rtol=1e-5)
    for name in ("loss", "mae"):
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-5)


def test_an_epoch_of_dropped_steps_logs_nan_without_a_watcher():
    # A GradBoostModel's loss-scale check drops a non-finite step too; with
    # every step dropped, Keras' TerminateOnNaN must still see NaN.
    x, y = _data(poison=False)
    model = _functional(GradBoostModel)
    model.compile(optimizer="sgd", loss="mse", loss_scale="dynamic")
    history = model.fit(np.full_like(x, np.nan), y, batch_size=5, epochs=2, verbose=0,
                        callbacks=[keras.callbacks.TerminateOnNaN()])
    assert len(history.history["loss"]) == 1 and np.isnan(history.history["loss"][0])


class RawLossStep(keras.Model):
    """An own step that logs its batch's raw loss under "loss" (not the
    loss tracker's mean), with one update inside a `tf.cond` (of zeros:
    no change) and the real one after it."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)

        def nothing_to_apply():
            zeros = [tf.zeros_like(g) for g in grads]
            self.optimizer.apply_gradients(zip(zeros, self.trainable_variables))
            return tf.constant(0)

        tf.cond(tf.reduce_all(tf.math.is_finite(loss)), nothing_to_apply, lambda: tf.constant(0))
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_an_own_steps_raw_logs_and_an_update_in_a_cond_are_left_alone():
    # Before: with the watcher, every batch logged the loss tracker's value
    # (0.0: this step never updates it) instead of its own; an update inside
    # a tf.cond raised InaccessibleTensorError.
    x, y = _data(poison=False)
    runs = []
    for callbacks in ([], [NaNWatcher(action="skip", verbose=0)]):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        model = RawLossStep(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        logged = BatchLosses()
        model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=callbacks + [logged])
        runs.append((logged.losses, model.get_weights()))
    (plain, weights), (watched, watched_weights) = runs
    assert plain == watched and min(plain) > 0
    _assert_weights(model, weights)


class RawLossOnly(keras.Model):
    """An own step that logs its batch's raw loss under "loss" and never
    updates the loss tracker of that name."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_a_dropped_steps_raw_loss_stays_its_own():
    # Not a metric's result: the dropped batch logs its own NaN (documented),
    # the others their own losses; the never-updated tracker of that name
    # (0.0, or NaN for "no step applied") replaces none of them.
    x, y = _data()
    runs = []
    for rows, callbacks in ((np.arange(40), [NaNWatcher(action="skip", verbose=0)]),
                            (np.r_[0 : BAD_STEP * 5, BAD_STEP * 5 + 5 : 40], [])):
        model = _functional()  # seeded, with its first layer set
        model = RawLossOnly(model.inputs, model.outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        logged = BatchLosses()
        model.fit(x[rows], y[rows], batch_size=5, shuffle=False, verbose=0,
                  callbacks=callbacks + [logged])
        runs.append(logged.losses)
    watched, expected = runs
    assert np.isnan(watched[BAD_STEP])
    np.testing.assert_allclose(watched[:BAD_STEP] + watched[BAD_STEP + 1 :], expected, rtol=1e-5)


class UnbuiltStatefulRNN(keras.Model):
    def __init__(self):
        super().__init__()
        self.lstm = keras.layers.LSTM(8, stateful=True, name="lstm")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, x):
        return self.out(self.lstm(x))


def test_restore_building_an_unbuilt_model_leaves_its_rnn_states_at_zero():
    # "restore" builds a model unbuilt before fit with one inference call on
    # the first batch, which wrote a stateful RNN's states: training then
    # went on from states the run without the watcher never had.
    x, y = stateful_rnn_data()
    runs = []
    for callbacks in ([NaNWatcher(action="restore", verbose=0)], []):
        keras.utils.set_random_seed(0)
        model = UnbuiltStatefulRNN()
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=callbacks)
        runs.append(model)
    watched, plain = runs
    _assert_weights(watched, plain.get_weights())
    for a, b in zip(watched.lstm.states, plain.lstm.states):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


class LossSum(keras.metrics.Metric):
    """A metric whose result is its variable itself, as in the example of
    Keras' `Metric` docstring (settle raised on its `dtype`, a string)."""

    def __init__(self, name):
        super().__init__(name=name)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, value):
        self.total.assign_add(value)

    def result(self):
        return self.total


class TrackedOwnStep(GradBoostModel):
    """An own train step (keras.io's GAN pattern): its update through
    `self.minimize`, its logs from trackers of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(4, name="d1")
        self.fault = BadLog(name="fault")
        self.out = keras.layers.Dense(2, name="out")
        self.loss_mean = keras.metrics.Mean(name="own_loss")
        self.loss_sum = LossSum(name="loss_sum")

    def call(self, x):
        return self.out(self.fault(self.d1(x)))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        self.minimize(tape, loss, self.trainable_variables)
        self.loss_mean.update_state(loss)
        self.loss_sum.update_state(loss)
        return {"own_loss": self.loss_mean.result(), "loss_sum": self.loss_sum.result()}


def test_skip_keeps_the_bad_step_out_of_an_own_steps_trackers():
    x, y = _data()
    runs = []
    for rows, callbacks in ((np.arange(40), [NaNWatcher(action="skip", verbose=0)]),
                            (np.r_[0 : BAD_STEP * 5, BAD_STEP * 5 + 5 : 40], [])):
        keras.utils.set_random_seed(0)
        model = TrackedOwnStep()
        model(np.ones((1, 3), "float32"))
        _positive_first_layer(model)
        # loss_scale="dynamic": the own step's update needs GradBoostModel's.
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss_scale="dynamic")
        history = model.fit(x[rows], y[rows], batch_size=5, shuffle=False, verbose=0, callbacks=callbacks)
        runs.append((model, [history.history[k] for k in ("own_loss", "loss_sum")]))
    (model, logged), (reference, expected) = runs
    assert np.isfinite(logged).all()
    np.testing.assert_allclose(logged, expected, rtol=1e-5)
    _assert_weights(model, reference.get_weights())


def test_skip_stops_after_max_skips_consecutive_bad_steps():
    x, y = _data()
    x[:] = -1.0  # every step bad
    model = _functional()
    model.compile(optimizer="sgd", loss="mse")
    watcher = NaNWatcher(action="skip", max_skips=3, verbose=0)
    with pytest.raises(NonFiniteError):
        model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    assert [e.action_taken for e in watcher.events] == ["skipped", "skipped", "stopped"]
    assert int(model.optimizer.iterations.numpy()) == 0


def test_restore_rolls_back_to_epoch_start_and_lowers_learning_rate():
    x, y = _data()
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    start = model.get_weights()
    watcher = NaNWatcher(action="restore", lr_factor=0.5, verbose=0)
    model.fit(x[: (BAD_STEP + 1) * 5], y[: (BAD_STEP + 1) * 5], batch_size=5,
              shuffle=False, verbose=0, callbacks=[watcher])
    assert watcher.events[0].action_taken == "restored"
    _assert_weights(model, start)  # the bad step was the epoch's last
    np.testing.assert_allclose(float(model.optimizer.learning_rate.numpy()), 0.005)


def test_warn_reports_and_goes_on(capsys):
    x, y = _data()
    model = _functional()
    model.compile(optimizer="sgd", loss="mse")
    watcher = NaNWatcher(action="warn")
    model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    out = capsys.readouterr().out
    assert f"epoch 0, step {BAD_STEP}" in out and "layer: fault" in out
    assert "action: warned" in out
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_backward_only_fault_is_located_in_backward(kind):
    x, y = _data(poison=False)
    x[BAD_STEP * 5 + 1] = [-1.0, 1.0, 1.0]  # d1 -> [-1, ...]; relu below makes 0
    keras.utils.set_random_seed(0)

    class ReluSqrt(SqrtLayer):
        def call(self, x):
            return tf.sqrt(tf.nn.relu(x))  # finite value, infinite gradient at 0

    model = BUILDERS[kind](fault=ReluSqrt)
    model.compile(optimizer="sgd", loss="mse")
    watcher = NaNWatcher(verbose=0)
    with pytest.raises(NonFiniteError):
        model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    event = watcher.events[0]
    assert (event.step, event.phase, event.layer) == (BAD_STEP, "backward", "fault")
    assert any("d1/" in v for v in event.variables)


def test_float16_overflow_is_finite_in_float32():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="d1")(inputs)
    h = keras.layers.Dense(4, name="big")(h)
    outputs = keras.layers.Dense(2, name="out")(h)
    model = GradBoostModel(inputs, outputs)
    model.get_layer("d1").set_weights([np.eye(3, 4, dtype="float32"), np.zeros(4, "float32")])
    model.compile(  # lr 0: the weights (and so the overflow) stay as planted
        optimizer=keras.optimizers.SGD(0.0),
        loss="mse",
        precision="mixed_float16",
        loss_scale=None,
        jit_compile=True,
    )
    x, y = _data(poison=False)
    x[BAD_STEP * 5] = 3e4  # fits float16; 1e3 * 9e4 does not: inf in "big" only
    model.get_layer("big").set_weights([np.full((4, 4), 1e3, "float32"), np.zeros(4, "float32")])
    model.get_layer("out").set_weights([np.full((4, 2), 1e-4, "float32"), np.zeros(2, "float32")])
    watcher = NaNWatcher(action="skip", verbose=0)
    model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    event = watcher.events[0]
    assert (event.step, event.phase, event.layer) == (BAD_STEP, "forward", "big")
    assert event.float32_finite is True
    assert "float16 overflow" in event.report()


def test_gradboost_accumulation_skips_the_bad_micro_batch():
    x, y = _data()
    model = _functional(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", accumulate_steps=4)
    watcher = NaNWatcher(action="skip", verbose=0)
    model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    assert [(e.step, e.layer) for e in watcher.events] == [(BAD_STEP, "fault")]
    assert int(model.optimizer.iterations.numpy()) == 2
    # Reference: one large step on micro-batches 0-3, one on 4, 6, 7.
    ref = _functional()
    ref.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    ref.train_on_batch(x[:20], y[:20])
    keep = np.r_[20:25, 30:40]
    ref.train_on_batch(x[keep], y[keep])
    _assert_weights(model, ref.get_weights())


def test_stop_keeps_backup_and_checkpoint(tmp_path):
    x, y = _data()
    backup = str(tmp_path / "backup")
    ckpt = str(tmp_path / "ckpt.weights.h5")
    model = _functional()
    model.compile(optimizer="sgd", loss="mse")
    callbacks = [
        keras.callbacks.BackupAndRestore(backup, save_freq=2),
        keras.callbacks.ModelCheckpoint(ckpt, save_weights_only=True, save_freq=2),
        NaNWatcher(verbose=0),
    ]
    with pytest.raises(NonFiniteError):
        model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=callbacks)
    assert os.path.isdir(backup) and os.listdir(backup)
    assert os.path.exists(ckpt)


def test_dump_dir_saves_the_offending_batch(tmp_path):
    x, y = _data()
    model = _functional()
    model.compile(optimizer="sgd", loss="mse")
    watcher = NaNWatcher(action="skip", dump_dir=str(tmp_path), verbose=0)
    model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    saved = np.load(watcher.events[0].dump_path)
    np.testing.assert_array_equal(saved["arr_0"], x[BAD_STEP * 5 : BAD_STEP * 5 + 5])


def test_watcher_is_removed_after_fit_and_reused_without_retracing():
    x, y = _data()
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # only the planted fault
    watcher = NaNWatcher(action="skip", verbose=0)
    model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    assert [e.step for e in watcher.events] == [BAD_STEP]
    plain = model.train_function
    assert "apply" not in vars(model.optimizer)
    guarded = vars(model)[nan_watcher_module._GUARDED][1]
    assert guarded is not plain
    model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    assert vars(model)[nan_watcher_module._GUARDED][1] is guarded  # the same traced function
    assert [e.step for e in watcher.events] == [BAD_STEP]  # still guarded
    assert model.train_function is plain


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"action": "explode"}, "action='explode'"),
        ({"max_skips": 0}, "max_skips=0"),
        ({"lr_factor": 2.0}, "lr_factor=2.0"),
    ],
)
def test_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        NaNWatcher(**kwargs)


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_mirrored_strategy_plain_model_skip(cls):
    x, y = _data()
    with shared_mirrored_strategy().scope():
        model = _tracked(cls)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    watcher = NaNWatcher(action="skip", verbose=0)
    history = model.fit(x, y, batch_size=10, shuffle=False, verbose=0, callbacks=[watcher])
    # Batch 2 (samples 20-29) holds the poisoned sample 27, on replica 1 only.
    assert [(e.step, e.phase, e.layer) for e in watcher.events] == [(2, "forward", "fault")]
    assert model.optimizer.iterations.numpy() == 3
    assert all(np.isfinite(w).all() for w in model.get_weights())
    # Every replica's metrics go back, the clean replica's too; where Keras
    # mirrors metric variables on write (3.8), they cannot be assigned in a
    # replica's tf.cond and keep the dropped step (documented).
    on_read = all(
        v.value.synchronization == tf.VariableSynchronization.ON_READ
        for v in model.metrics_variables
    )
    if not on_read:
        assert np.isnan(history.history["loss"]).all()
        return
    reference = _tracked()
    reference.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    expected = reference.fit(np.r_[x[:20], x[30:]], np.r_[y[:20], y[30:]], batch_size=10,
                             shuffle=False, verbose=0)
    for name in ("loss", "mae", "activation_mean"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)


def test_recompile_between_fits_is_not_served_a_stale_function():
    x, y = _data(poison=False)
    model = _functional()
    optimizer = keras.optimizers.SGD(0.0)
    watcher = NaNWatcher(verbose=0)
    for loss in ("mse", "mae", "mse", "mae"):
        model.compile(optimizer=optimizer, loss=loss)
        logged = model.fit(x, y, batch_size=40, verbose=0, callbacks=[watcher]).history["loss"][0]
        np.testing.assert_allclose(logged, model.evaluate(x, y, verbose=0), rtol=1e-5)


def test_an_exception_elsewhere_leaves_no_guard_behind():
    x, y = _data()

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise KeyboardInterrupt

    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=5, verbose=0, callbacks=[NaNWatcher(verbose=0), Interrupt()])
    history = model.fit(x, y, batch_size=5, shuffle=False, verbose=0)  # no watcher
    assert "nonfinite_steps" not in history.history
    # 1 step before the interrupt, then all 8: the NaN step applied, as in Keras.
    assert int(model.optimizer.iterations.numpy()) == 9
    assert "apply" not in vars(model.optimizer)
    assert "make_train_function" not in vars(model)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_dynamic_loss_scale_overflows_are_not_events(jit_compile):
    if jit_compile and TF_VERSION < (2, 18) and not tf.config.list_physical_devices("GPU"):
        pytest.skip(
            "XLA on the CPU before TensorFlow 2.18 computes these float16 "
            "gradients without overflow: no step to skip"
        )
    x, y = _data(poison=False)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(8, name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="out")(h)
    model = GradBoostModel(inputs, outputs)
    model.compile(
        optimizer="sgd", loss="mse", precision="mixed_float16", jit_compile=jit_compile
    )
    y = np.full_like(y, 3000.0)  # gradients ~1e3: times 2**15 overflow float16
    watcher = NaNWatcher(verbose=0)
    model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    facts = model.step_facts.read()
    assert facts["skipped_steps"] >= 1  # the scale searched downwards...
    assert watcher.events == [] and facts["nonfinite_steps"] == 0  # ...silently


def test_two_restores_in_one_epoch_halve_twice_and_schedules_are_refused():
    x, y = _data(poison=False)
    x[7] = x[22] = -100.0  # bad steps 1 and 4
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    watcher = NaNWatcher(action="restore", verbose=0)
    model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    assert [e.step for e in watcher.events] == [1, 4]
    np.testing.assert_allclose(float(model.optimizer.learning_rate.numpy()), 0.0025)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.9)
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    with pytest.raises(ValueError, match=r"is a schedule \(ExponentialDecay\)"):
        model.fit(x, y, batch_size=5, verbose=0, callbacks=[NaNWatcher(action="restore")])


def test_steps_per_execution_names_the_first_bad_step_of_the_chunk():
    x, y = _data()  # bad step 5, in chunk (4, 5, 6, 7)
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", steps_per_execution=4)
    watcher = NaNWatcher(action="skip", max_skips=2, verbose=0)
    model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    assert [(e.step, e.layer) for e in watcher.events] == [(BAD_STEP, "fault")]
    assert int(model.optimizer.iterations.numpy()) == 7


# ---------------------------------------------------------------- late read
# The watcher reads the count of bad steps one train call late (and at the
# epoch's end). These tests put good steps after the bad one, in its own
# steps_per_execution chunk and in the next, which run before it acts.


def _long_data(bad_steps, batches=16):
    x = np.abs(np.random.default_rng(1).normal(size=(batches * 5, 3))).astype("float32") + 1.0
    for step in bad_steps:
        x[step * 5 + 2] = -100.0
    return x, np.ones((batches * 5, 2), "float32")


def _reference(build, x, y, batches, lr=0.01):
    ref = build()
    ref.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    for b in batches:
        ref.train_on_batch(x[b * 5 : b * 5 + 5], y[b * 5 : b * 5 + 5])
    return ref.get_weights()


def test_no_batch_end_hook_so_keras_dispatch_stays_asynchronous():
    watcher = NaNWatcher()
    assert watcher.async_safe is True
    assert type(watcher).on_train_batch_end is keras.callbacks.Callback.on_train_batch_end


@pytest.mark.parametrize("steps_per_execution", [1, 2, 4])
@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_stop_after_a_late_read_keeps_the_weights_before_the_bad_step(cls, steps_per_execution):
    # Bad step 5. spe=1: step 6 runs before the read; spe=2: chunk (4, 5)
    # is read after chunk (6, 7); spe=4: steps 6, 7 share the bad step's
    # chunk and chunk (8..11) runs before the read.
    x, y = _long_data([BAD_STEP])
    build = lambda: _functional(cls)  # noqa: E731
    model = build()
    model.compile(
        optimizer=keras.optimizers.SGD(0.01), loss="mse",
        steps_per_execution=steps_per_execution,
    )
    watcher = NaNWatcher(verbose=0)
    with pytest.raises(NonFiniteError) as info:
        model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    event = info.value.event
    assert (event.epoch, event.step, event.phase, event.layer) == (0, BAD_STEP, "forward", "fault")
    assert int(model.optimizer.iterations.numpy()) == BAD_STEP
    _assert_weights(model, _reference(_functional, x, y, range(BAD_STEP)))


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_restore_after_a_late_read_rolls_back_and_goes_on(cls):
    # Bad step 1 in chunk (0, 1); chunk (2, 3) runs (halted) before the
    # read; then the rollback to the epoch's start, and steps 4..15 at half
    # the learning rate.
    x, y = _long_data([1])
    model = _functional(cls)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=2)
    watcher = NaNWatcher(action="restore", verbose=0)
    model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    assert [(e.step, e.layer, e.action_taken) for e in watcher.events] == [(1, "fault", "restored")]
    np.testing.assert_allclose(float(model.optimizer.learning_rate.numpy()), 0.005)
    _assert_weights(model, _reference(_functional, x, y, range(4, 16), lr=0.005))


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_skip_with_steps_per_execution_drops_only_the_bad_steps(cls):
    x, y = _long_data([5, 6, 13])  # two in chunk (4..7), one in (12..15)
    model = _functional(cls)
    # A small learning rate: training keeps log's input positive elsewhere.
    model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse", steps_per_execution=4)
    watcher = NaNWatcher(action="skip", verbose=0)
    history = model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    assert [(e.step, e.action_taken) for e in watcher.events] == [(5, "skipped"), (13, "skipped")]
    assert history.history["nonfinite_steps"] == [3.0]
    good = [b for b in range(16) if b not in (5, 6, 13)]
    assert int(model.optimizer.iterations.numpy()) == len(good)
    _assert_weights(model, _reference(_functional, x, y, good, lr=0.001))


def test_max_skips_counts_steps_in_a_row_within_a_chunk():
    x, y = _long_data([4, 5, 6])  # three in a row, all in chunk (4..7)
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=4)
    watcher = NaNWatcher(action="skip", max_skips=3, verbose=0)
    with pytest.raises(NonFiniteError):
        model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    assert [(e.step, e.action_taken) for e in watcher.events] == [(4, "stopped")]
    # Step 7 (good, after the third bad one) and chunk (8..11) were halted.
    assert int(model.optimizer.iterations.numpy()) == 4
    _assert_weights(model, _reference(_functional, x, y, range(4)))


def test_events_name_epoch_and_step_across_epochs_and_chunks():
    x, y = _data()  # 8 batches: chunks (0, 1, 2), (3, 4, 5), (6, 7)
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", steps_per_execution=3)  # only the planted fault
    watcher = NaNWatcher(action="warn", verbose=0)
    model.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0, callbacks=[watcher])
    assert [(e.epoch, e.step, e.layer) for e in watcher.events] == [
        (0, BAD_STEP, "fault"), (1, BAD_STEP, "fault")
    ]
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_stop_with_accumulation_applies_nothing_after_the_bad_micro_batch():
    x, y = _long_data([BAD_STEP])
    model = _functional(GradBoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", accumulate_steps=4)
    watcher = NaNWatcher(verbose=0)
    with pytest.raises(NonFiniteError) as info:
        model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    assert info.value.event.step == BAD_STEP
    # One update (micro-batches 0-3); 4 was accumulated, 5 bad, 6, 7 halted.
    assert int(model.optimizer.iterations.numpy()) == 1
    ref = _functional()
    ref.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    ref.train_on_batch(x[:20], y[:20])
    _assert_weights(model, ref.get_weights())


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_mirrored_strategy_stop_after_a_late_read(cls):
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    x, y = _long_data([BAD_STEP], batches=16)  # batch 10: bad step 2
    with strategy.scope():
        model = _functional(cls)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=2)
    watcher = NaNWatcher(verbose=0)
    with pytest.raises(NonFiniteError) as info:
        model.fit(x, y, batch_size=10, shuffle=False, verbose=0, callbacks=[watcher])
    assert (info.value.event.step, info.value.event.layer) == (2, "fault")
    assert int(model.optimizer.iterations.numpy()) == 2
    ref = _functional()
    ref.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    for b in range(2):
        ref.train_on_batch(x[b * 10 : b * 10 + 10], y[b * 10 : b * 10 + 10])
    _assert_weights(model, ref.get_weights())


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_mirrored_strategy_restore_rolls_back_and_goes_on(cls):
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    # Global batches of 10 (5 per replica): batch 2 holds the poisoned row.
    # Chunk (2, 3) has the bad step; chunk (4, 5) runs halted before the
    # read; then the rollback to the epoch's start (weights and optimizer
    # state), and steps 6..15 at half the learning rate.
    x, y = _long_data([BAD_STEP], batches=32)
    with strategy.scope():
        model = _functional(cls)
        model.compile(optimizer=keras.optimizers.SGD(0.001, momentum=0.9), loss="mse",
                      steps_per_execution=2)
    watcher = NaNWatcher(action="restore", verbose=0)
    model.fit(x, y, batch_size=10, shuffle=False, verbose=0, callbacks=[watcher])
    assert [(e.step, e.layer, e.action_taken) for e in watcher.events] == [(2, "fault", "restored")]
    np.testing.assert_allclose(float(model.optimizer.learning_rate.numpy()), 0.0005)
    ref = _functional()
    ref.compile(optimizer=keras.optimizers.SGD(0.0005, momentum=0.9), loss="mse")
    for b in range(6, 16):
        ref.train_on_batch(x[b * 10 : b * 10 + 10], y[b * 10 : b * 10 + 10])
    _assert_weights(model, ref.get_weights())
    # The momentum was rolled back too: the reference started from zero.
    momenta = [
        (a, b)
        for a, b in zip(model.optimizer.variables, ref.optimizer.variables)
        if "momentum" in a.path
    ]
    assert len(momenta) == 4  # two kernels, two biases
    for a, b in momenta:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


class LogOfMinLoss(keras.layers.Layer):
    """Passes its input on and adds log(min(x)) as a loss of its own: a
    NaN loss from a finite forward where x < 0."""

    def call(self, x):
        self.add_loss(1e-3 * tf.math.log(tf.reduce_min(x)))
        return x


@pytest.mark.parametrize("recompute", [None, ["fault"]])
def test_a_non_finite_loss_a_layer_adds_names_that_layer(recompute):
    x, y = _data()
    model = _functional(GradBoostModel, fault=LogOfMinLoss)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", recompute=recompute)
    watcher = NaNWatcher(verbose=0)
    with pytest.raises(NonFiniteError) as info:
        model.fit(x, y, batch_size=5, shuffle=False, verbose=0, callbacks=[watcher])
    event = info.value.event
    assert (event.step, event.phase, event.layer) == (BAD_STEP, "loss", "fault")
    _assert_weights(model, _weights_before_bad_step(
        lambda: _functional(fault=LogOfMinLoss), x, y))
