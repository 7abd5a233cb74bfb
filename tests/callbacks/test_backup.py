"""kgb.callbacks.BackupAndRestore: an interrupted fit(), restarted, ends with
the weights of a fit() that was never interrupted, wherever the backup was
taken (mid-epoch, mid-window, at a preemption), for a plain Keras model and
a GradBoostModel."""

import json
import os
import signal

import numpy as np
import pytest

import keras
from conftest import max_weight_diff
from conftest import rnn_states
from conftest import stateful_rnn_data
from conftest import stateful_rnn_model
from keras_gradboost import GradBoostModel
from keras_gradboost.callbacks import BackupAndRestore
from keras_gradboost.callbacks import NaNWatcher

N, BATCH, EPOCHS = 64, 4, 2  # 16 batches an epoch


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 5)).astype("float32"), rng.normal(size=(N, 3)).astype("float32")


def _model(kind, steps_per_execution=1):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Dense(3)(h)
    if kind == "keras":
        model = keras.Model(inputs, outputs)
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"],
                      steps_per_execution=steps_per_execution)
    else:  # accumulate 4: every backup below is taken mid-window
        model = GradBoostModel(inputs, outputs)
        model.compile(
            keras.optimizers.Adam(0.01), "mse", metrics=["mae"],
            steps_per_execution=steps_per_execution, accumulate_steps=4, loss_scale="dynamic",
        )
    return model


def _fit(model, callbacks, epochs=EPOCHS):
    x, y = _data()
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks)


class _At(keras.callbacks.Callback):
    """Calls `action()` at the end of the call that trains batch `batch` of
    epoch `epoch` (found from the call's first batch: Keras 3.8 ends a
    chunk of steps_per_execution batches at its first, 3.15 at its last)."""

    def __init__(self, epoch, batch, action):
        super().__init__()
        self.at, self.action = (epoch, batch), action

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.first = batch

    def on_train_batch_end(self, batch, logs=None):
        chunk = range(self.first, self.first + self.model.steps_per_execution)
        if self.epoch == self.at[0] and self.at[1] in chunk:
            self.action()


def _interrupt():
    raise RuntimeError("interrupted")


def _metadata(backup_dir):
    with open(os.path.join(backup_dir, "training_metadata.json")) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "kind, steps_per_execution", [("keras", 1), ("keras", 2), ("gradboost", 2)]
)
def test_a_mid_epoch_backup_resumes_exactly(tmp_path, kind, steps_per_execution):
    never = _model(kind, steps_per_execution)
    logs = _fit(never, []).history
    backup_dir = str(tmp_path / "backup")
    model = _model(kind, steps_per_execution)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(model, [BackupAndRestore(backup_dir, save_freq=6), _At(1, 9, _interrupt)])
    # Saved after batch 5 of epoch 1 (6, 12, 18 batches: 2 into epoch 1, then 8).
    saved = _metadata(backup_dir)
    assert (saved["epoch"], saved["batches_done"]) == (1, 8)
    restarted = _model(kind, steps_per_execution)  # new weights: all come from the backup
    history = _fit(restarted, [BackupAndRestore(backup_dir, save_freq=6)])
    assert len(history.history["loss"]) == 1  # epoch 1 only
    # The epoch's logs go on from the backup's metrics: over all its batches.
    assert {k: v[-1] for k, v in history.history.items()} == {k: v[-1] for k, v in logs.items()}
    assert int(restarted.optimizer.iterations.numpy()) == int(never.optimizer.iterations.numpy())
    assert max_weight_diff(restarted, never) == 0.0
    assert not os.path.exists(backup_dir)  # completed: deleted


def test_a_resumed_epoch_logs_as_uninterrupted_under_mirrored_strategy(tmp_path):
    """The metrics' states are sums over the replicas (read summed, put back
    spread over them): the resumed epoch's logs are the uninterrupted ones."""
    from conftest import shared_mirrored_strategy

    def model():
        with shared_mirrored_strategy().scope():
            return _model("keras")

    never = model()
    logs = _fit(never, []).history
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(model(), [BackupAndRestore(backup_dir, save_freq=6), _At(1, 9, _interrupt)])
    restarted = model()
    history = _fit(restarted, [BackupAndRestore(backup_dir, save_freq=6)])
    assert {k: v[-1] for k, v in history.history.items()} == pytest.approx(
        {k: v[-1] for k, v in logs.items()}, rel=1e-6
    )
    assert max_weight_diff(restarted, never) == 0.0


def test_a_backup_mid_window_keeps_the_window(tmp_path):
    never = _model("gradboost")
    _fit(never, [])
    backup_dir = str(tmp_path / "backup")
    model = _model("gradboost")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(model, [BackupAndRestore(backup_dir, save_freq=3), _At(0, 7, _interrupt)])
    assert _metadata(backup_dir)["batches_done"] == 6  # 2 of the window's 4 pending
    restarted = _model("gradboost")
    _fit(restarted, [BackupAndRestore(backup_dir, save_freq=3)])
    assert max_weight_diff(restarted, never) == 0.0


@pytest.mark.parametrize("kind", ["keras", "gradboost"])
def test_sigterm_saves_at_the_next_step_and_exits(tmp_path, kind):
    never = _model(kind)
    _fit(never, [])
    backup_dir = str(tmp_path / "backup")
    model = _model(kind)
    handler = signal.getsignal(signal.SIGTERM)
    terminate = _At(1, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(SystemExit) as stopped:
        _fit(model, [terminate, BackupAndRestore(backup_dir, save_freq=False,
                                                 save_before_preemption=True)])
    assert stopped.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is handler  # put back
    assert _metadata(backup_dir)["epoch"] == 1 and _metadata(backup_dir)["batches_done"] == 3
    restarted = _model(kind)
    _fit(restarted, [BackupAndRestore(backup_dir, save_freq=False, save_before_preemption=True)])
    assert max_weight_diff(restarted, never) == 0.0


def test_the_previous_backup_serves_when_the_latest_is_unreadable(tmp_path):
    never = _model("keras")
    _fit(never, [])
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_model("keras"), [BackupAndRestore(backup_dir, save_freq=4, double_checkpoint=True),
                               _At(0, 9, _interrupt)])
    latest = os.path.join(backup_dir, _metadata(backup_dir)["weights"])
    with open(latest, "wb") as f:
        f.write(b"not an h5 file")
    restarted = _model("keras")
    with pytest.warns(UserWarning, match="restoring the previous one"):
        _fit(restarted, [BackupAndRestore(backup_dir, save_freq=4, double_checkpoint=True)])
    assert max_weight_diff(restarted, never) == 0.0


def test_later_fits_start_at_their_own_initial_epoch(tmp_path):
    backup_dir = str(tmp_path / "backup")
    model = _model("keras")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(model, [BackupAndRestore(backup_dir), _At(1, 0, _interrupt)], epochs=3)
    assert len(_fit(model, [BackupAndRestore(backup_dir)], epochs=3).history["loss"]) == 2
    # Keras' own callback leaves epoch 1 as the start of every later fit().
    assert len(_fit(model, [], epochs=3).history["loss"]) == 3


def test_a_backup_inside_a_chunk_is_refused(tmp_path):
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_model("keras"), [BackupAndRestore(backup_dir, save_freq=3), _At(0, 4, _interrupt)])
    with pytest.raises(ValueError, match="steps_per_execution=2"):
        _fit(_model("keras", 2), [BackupAndRestore(backup_dir)])


@pytest.mark.parametrize("first", ["backup", "watcher"])
def test_skipped_batches_pass_other_callbacks_by(tmp_path, first):
    """A NaNWatcher beside it, before or after it in the list: the skipped
    batches reach neither its wrapper nor its watch, and it numbers the
    resumed epoch's steps from the epoch's start (a NaN in batch 10 of each
    epoch is step 10, as in the uninterrupted fit)."""
    x, y = _data()
    x[40] = np.nan  # batch 10

    def fit(model, *callbacks):
        watcher = NaNWatcher(action="skip", verbose=0)
        listed = [watcher, *callbacks] if first == "watcher" else [*callbacks[:1], watcher,
                                                                   *callbacks[1:]]
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=listed)
        return [(e.epoch, e.step, e.action_taken) for e in watcher.events]

    never = _model("gradboost")
    assert fit(never) == [(0, 10, "skipped"), (1, 10, "skipped")]
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(_model("gradboost"), BackupAndRestore(backup_dir, save_freq=5), _At(0, 7, _interrupt))
    assert _metadata(backup_dir)["batches_done"] == 5
    restarted = _model("gradboost")
    assert fit(restarted, BackupAndRestore(backup_dir, save_freq=5)) == [
        (0, 10, "skipped"), (1, 10, "skipped")
    ]
    assert max_weight_diff(restarted, never) == 0.0


def test_a_backup_waits_until_the_watcher_has_acted(tmp_path):
    """NaNWatcher reads a call's bad steps one call later: a backup due right
    after the bad batch 6 is held to batch 7 (else it would hold a halted
    step nobody acted on, and the restarted fit would never restore), so
    the fit is the same with and without backups, interrupted or not."""
    x, y = _data()
    x[24] = np.nan  # batch 6

    def fit(model, *callbacks):
        watcher = NaNWatcher(action="restore", verbose=0)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=[watcher, *callbacks])
        return [(e.epoch, e.step, e.action_taken) for e in watcher.events]

    never = _model("keras")
    events = fit(never)
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(_model("keras"), BackupAndRestore(backup_dir, save_freq=7), _At(0, 9, _interrupt))
    assert _metadata(backup_dir)["batches_done"] == 8  # due at 7, held one batch
    restarted = _model("keras")
    assert fit(restarted, BackupAndRestore(backup_dir, save_freq=7)) == events[1:]  # epoch 1's
    assert max_weight_diff(restarted, never) == 0.0


def test_a_restore_in_a_resumed_epoch_says_where_it_goes_back_to(tmp_path):
    """NaNWatcher(action="restore") keeps the weights from its epoch's start;
    in an epoch resumed at batch 5 it holds those of batch 5, and says so."""
    x, y = _data()
    x[40] = np.nan  # batch 10
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _model("keras").fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[
            BackupAndRestore(backup_dir, save_freq=5), _At(0, 7, _interrupt)])
    watcher = NaNWatcher(action="restore", verbose=0)
    _model("keras").fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                        callbacks=[BackupAndRestore(backup_dir, save_freq=5), watcher])
    (event,) = watcher.events
    assert (event.epoch, event.step, event.action_taken) == (0, 10, "restored")
    assert "restored to the weights at batch 5 of this epoch" in event.detail


def _dropout_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dropout(0.5)(keras.layers.Dense(8, activation="tanh")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_dropout_resumes_with_the_masks_of_the_uninterrupted_fit(tmp_path):
    """Keras' save_weights leaves out the seed generators' states: without
    them the resumed fit would draw epoch 0's masks again."""
    never = _dropout_model()
    _fit(never, [])
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_dropout_model(), [BackupAndRestore(backup_dir, save_freq=6), _At(1, 9, _interrupt)])
    restarted = _dropout_model()
    _fit(restarted, [BackupAndRestore(backup_dir, save_freq=6)])
    assert max_weight_diff(restarted, never) == 0.0


def test_a_stateful_rnn_resumes_from_the_states_of_the_uninterrupted_fit(tmp_path):
    """Keras' save_weights leaves out a stateful RNN's states: without them
    the resumed fit would go on from zeros."""
    x, y = stateful_rnn_data(N)

    def build():
        model = stateful_rnn_model()
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def fit(model, callbacks):
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=callbacks)

    never = build()
    fit(never, [])
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(build(), [BackupAndRestore(backup_dir, save_freq=6), _At(1, 9, _interrupt)])
    restarted = build()
    fit(restarted, [BackupAndRestore(backup_dir, save_freq=6)])
    assert max_weight_diff(restarted, never) == 0.0
    for a, b in zip(rnn_states(restarted), rnn_states(never)):
        np.testing.assert_array_equal(a, b)


def test_a_fit_that_raised_while_skipping_leaves_nothing_behind(tmp_path):
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_model("keras"), [BackupAndRestore(backup_dir, save_freq=6), _At(1, 9, _interrupt)])
    model = _model("keras")
    with pytest.raises(RuntimeError, match="interrupted"):  # raises while skipping
        _fit(model, [BackupAndRestore(backup_dir, save_freq=6), _At(1, 2, _interrupt)])
    before = int(model.optimizer.iterations.numpy())
    history = _fit(model, [])  # no backup: both epochs, every batch trained
    assert len(history.history["loss"]) == EPOCHS
    assert int(model.optimizer.iterations.numpy()) - before == EPOCHS * N // BATCH


def test_a_sigterm_after_a_fit_that_raised_goes_to_the_handler_from_before(tmp_path):
    """Keras calls no on_train_end when fit() raises, so the callback's
    handler stays; a SIGTERM then is not held for a fit() that is gone."""
    received = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        with pytest.raises(RuntimeError, match="interrupted"):
            _fit(_model("keras"), [BackupAndRestore(str(tmp_path / "b"), save_before_preemption=True),
                                   _At(0, 3, _interrupt)])
        mine = signal.getsignal(signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is not mine  # the one from before, again
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM] * 2
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_restart_with_other_steps_per_epoch_is_refused(tmp_path):
    import tensorflow as tf

    x, y = _data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _model("keras").fit(data.repeat(), steps_per_epoch=6, epochs=2, shuffle=False, verbose=0,
                            callbacks=[BackupAndRestore(backup_dir, save_freq=2),
                                       _At(1, 3, _interrupt)])
    with pytest.raises(ValueError, match="with `steps_per_epoch`.*this fit\\(\\) is without"):
        _model("keras").fit(data, epochs=2, shuffle=False, verbose=0,
                            callbacks=[BackupAndRestore(backup_dir)])


def test_an_initial_epoch_other_than_the_backups_is_refused(tmp_path):
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_model("keras"), [BackupAndRestore(backup_dir, save_freq=6), _At(0, 9, _interrupt)])
    x, y = _data()
    with pytest.raises(ValueError, match="resumes at epoch 0, but this fit\(\) starts at epoch 1"):
        _model("keras").fit(x, y, batch_size=BATCH, epochs=3, initial_epoch=1, shuffle=False,
                            verbose=0, callbacks=[BackupAndRestore(backup_dir)])


def test_a_backup_after_a_short_last_chunk_resumes(tmp_path):
    """60 samples: 15 batches, chunks of 2, the last one short; the backup
    after it holds the whole epoch."""
    x, y = _data()
    x, y = x[:60], y[:60]

    def fit(model, callbacks):
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=callbacks)

    never = _model("keras", 2)
    fit(never, [])
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(_model("keras", 2), [BackupAndRestore(backup_dir, save_freq=3), _At(1, 0, _interrupt)])
    restarted = _model("keras", 2)
    fit(restarted, [BackupAndRestore(backup_dir, save_freq=3)])
    assert max_weight_diff(restarted, never) == 0.0


@pytest.mark.parametrize(
    "repeat, save_freq, stop_at, saved_at",
    [
        # One data iterator over all epochs (6 of its batches an epoch).
        (True, 4, (1, 4), (1, 2, 8)),  # mid-epoch: 2 into epoch 1, 8 drawn
        (True, "epoch", (2, 1), (2, 0, 12)),  # an epoch's end: 12 drawn
        # 16 batches, 8 an epoch: epoch 2 starts the data again.
        (False, 3, (1, 5), (1, 4, 12)),
        (False, "epoch", (2, 3), (2, 0, 0)),
    ],
)
def test_epochs_that_go_on_from_each_other_resume_in_the_stream(
    tmp_path, repeat, save_freq, stop_at, saved_at
):
    """With `steps_per_epoch`, Keras keeps one data iterator across epochs
    (until the data runs out): a resumed epoch starts where the
    uninterrupted one drew its batches from, not at the data's start."""
    import tensorflow as tf

    x, y = _data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    data, steps = (data.repeat(), 6) if repeat else (data, 8)

    def fit(model, callbacks):
        return model.fit(data, steps_per_epoch=steps, epochs=3, shuffle=False, verbose=0,
                         callbacks=callbacks)

    never = _model("keras")
    fit(never, [])
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(_model("keras"), [BackupAndRestore(backup_dir, save_freq=save_freq),
                              _At(*stop_at, _interrupt)])
    saved = _metadata(backup_dir)
    assert (saved["epoch"], saved["batches_done"], saved["stream_batches"]) == saved_at
    restarted = _model("keras")
    fit(restarted, [BackupAndRestore(backup_dir, save_freq=save_freq)])
    assert max_weight_diff(restarted, never) == 0.0


def test_sigterm_after_the_last_step_keeps_a_backup_of_the_end(tmp_path):
    """The signal comes at the last epoch's end: the fit is done, the process
    must go; the backup of the end is kept, and the restarted fit returns at
    once with the finished weights."""
    never = _model("keras")
    _fit(never, [])

    class TermAtTheEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == EPOCHS - 1:
                os.kill(os.getpid(), signal.SIGTERM)

    backup_dir = str(tmp_path / "backup")
    model = _model("keras")
    with pytest.raises(SystemExit):
        _fit(model, [TermAtTheEnd(), BackupAndRestore(backup_dir, save_freq=False,
                                                      save_before_preemption=True)])
    assert _metadata(backup_dir)["epoch"] == EPOCHS
    restarted = _model("keras")
    history = _fit(restarted, [BackupAndRestore(backup_dir, save_before_preemption=True)])
    assert history.history.get("loss", []) == []  # nothing left to train
    assert max_weight_diff(restarted, never) == 0.0


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(backup_dir=None), ValueError),
        (dict(backup_dir=""), ValueError),
        (dict(backup_dir="b", save_freq=0), ValueError),
        (dict(backup_dir="b", save_freq=True), TypeError),
        (dict(backup_dir="b", save_freq="batch"), TypeError),
        (dict(backup_dir="b", save_before_preemption=1), TypeError),
        (dict(backup_dir="b", preemption_exit_code=-1), ValueError),
    ],
)
def test_bad_arguments_are_named(kwargs, error):
    name = [k for k in kwargs if k != "backup_dir"] or ["backup_dir"]
    with pytest.raises(error, match=f"`{name[0]}`"):
        BackupAndRestore(**kwargs)
