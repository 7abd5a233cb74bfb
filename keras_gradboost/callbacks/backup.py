"""BackupAndRestore: Keras' callback, resuming exactly where the backup was
taken, under several workers too, and saving before a preemption."""

import itertools
import json
import os
import signal
import warnings
import weakref

import tensorflow as tf

from keras_gradboost import checkpoint
from keras_gradboost import cluster
from keras_gradboost import hooks
from keras_gradboost import preemption
from keras_gradboost import wrappers
from keras_gradboost.callbacks import args
from keras_gradboost.callbacks.gate import RunGate

_METADATA = "training_metadata.json"
_KERAS_WEIGHTS = "latest.weights.h5"  # the weights file of Keras' callback
_FORMAT = "keras_gradboost.BackupAndRestore/1"
_UNKNOWN = object()  # a backup that does not say where in the data it was
# The same sequence on every worker (each runs the same fit() calls).
_fits = itertools.count()
# model -> (epoch, batches) of the fit() that resumed it mid-epoch.
_RESUMED = weakref.WeakKeyDictionary()


# model -> callables that hold a backup of it back (see `hold_backups`).
_HOLDS = weakref.WeakKeyDictionary()


def hold_backups(model, holding):
    """Holds backups of `model` back while `holding()` is true: a callback
    that acts on a step late (NaNWatcher reads a call's bad steps one call
    later) would otherwise see a backup of a step nobody has acted on yet,
    and a restart from it would never act on it. The held backup is written
    at the first step end after, so the callbacks' own timing (and so the
    training) is the same with and without backups.

    Returns:
        A function that takes `holding` away again.
    """
    holds = _HOLDS.setdefault(model, [])
    holds.append(holding)

    def undo():
        if holding in holds:
            holds.remove(holding)

    return undo


def resumed_at(model):
    """`(epoch, batches)` while a `fit()` of `model` resumed mid-epoch from a
    backup: the first `batches` batches of `epoch` were trained before the
    interruption, and are skipped (other callbacks number the epoch's steps
    from there); None otherwise."""
    return _RESUMED.get(model)


class BackupAndRestore(RunGate):
    """Backs up the training state, and resumes an interrupted `fit()`
    exactly where the backup was taken.

    A drop-in for `keras.callbacks.BackupAndRestore` (the same arguments,
    the same use: pass the same instance, or one with the same
    `backup_dir`, to the `fit()` that restarts the interrupted one), for any
    Keras model, that fixes what Keras' callback gets silently wrong:

    * **Mid-epoch backups resume mid-epoch.** With an integer `save_freq`
      Keras restores the weights of batch `b` and then trains the epoch
      from its first batch, so batches `0..b` are applied twice. This
      callback skips the batches the backup has seen (it draws them from
      the data without training on them) and trains on from batch `b + 1`.
      For a GradBoostModel the backup holds the accumulation window and the
      loss scale too, so no micro-batch is lost or applied twice.
    * **Several workers** (`MultiWorkerMirroredStrategy`) **share one
      `backup_dir`**: only the chief writes (and deletes) it, and every
      worker restores from it. Each worker checks, through the cluster's
      coordination service, that it restored what the chief restored (a
      `backup_dir` that is a local path on each machine would start the
      workers from different steps): a difference raises on every worker
      before the first step. Under several workers a GradBoostModel's
      backup waits for an update boundary (each worker holds only its own
      part of a pending window).
    * **A backup is never half written**: the weights go to a new file
      first, and the metadata naming it is replaced in one rename, so an
      interruption while saving leaves the previous backup whole.
    * **A second `fit()` starts where asked**: Keras leaves the restored
      epoch in place for every later `fit()` of the model; it is cleared
      when this `fit()` ends.
    * **`save_before_preemption=True`** (Keras 2 had it; Keras 3 dropped
      it): on SIGTERM to any worker, every worker saves at the same next
      step (for a GradBoostModel under several workers, the next update
      boundary) and exits with `preemption_exit_code`, so the restarted
      job resumes from that step instead of the last backup.

    Exactness needs the data to give the same batches, in the same order,
    each time `fit()` starts it (`shuffle=False`, or a `tf.data` pipeline
    with a fixed seed that does not reshuffle). With `steps_per_epoch`
    Keras keeps one data iterator across epochs (a repeated dataset goes on
    from epoch to epoch): the backup notes how many batches it had drawn,
    and the restarted `fit()` draws as many before it trains, so it resumes
    at the same place in the data; a restart with or without
    `steps_per_epoch` where the interrupted `fit()` had the other is
    refused. The metrics of a resumed epoch go on from the backup's, so
    they cover the whole epoch as uninterrupted; under several workers
    they cover the batches trained after the resume.

    Args:
        backup_dir: the directory of the backup (created when needed).
            Keep it for this training run only: it is deleted when `fit()`
            completes (see `delete_checkpoint`).
        save_freq: `"epoch"` (at each epoch's end), an int `n` >= 1 (after
            every `n` batches), or `False` (only before a preemption).
            Defaults to `"epoch"`.
        double_checkpoint: keep the previous backup too, and restore it
            when the latest one cannot be read. Defaults to `False`.
        delete_checkpoint: delete the backup when `fit()` completes.
            Defaults to `True`.
        save_before_preemption: on SIGTERM, save at the next step every
            worker agrees on, and exit. Defaults to `False`.
        preemption_exit_code: the exit status after that save (143, what a
            process ended by SIGTERM reports, so a cluster manager restarts
            the job). Defaults to `143`.

    Raises:
        ValueError: for an argument out of range; at `fit()`, for a model
            that is not built, a backup taken inside a chunk of
            `steps_per_execution` batches other than this model's, or one
            taken with `steps_per_epoch` restored without it (or the other
            way round); under several workers, when a worker restored
            another backup than the chief (or none).

    Example:

    ```python
    import numpy as np, keras, tempfile
    from keras_gradboost.callbacks import BackupAndRestore

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                raise RuntimeError("interrupted")

    x, y = np.random.rand(64, 3), np.random.rand(64, 1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    backup = BackupAndRestore(tempfile.mkdtemp(), save_freq=2)
    try:
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0,
                  callbacks=[backup, Interrupt()])
    except RuntimeError:
        pass
    # Restarted: batches 0-5 are not trained again (the backup after
    # batch 5 holds them), training goes on from batch 6.
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[backup])
    ```
    """

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint=False,
        delete_checkpoint=True,
        save_before_preemption=False,
        preemption_exit_code=143,
    ):
        super().__init__()
        self.backup_dir = args.check_directory("backup_dir", backup_dir)
        if self.backup_dir is None:
            raise args.value_error("backup_dir", backup_dir, "a directory path")
        self.save_freq = _check_save_freq(save_freq)
        self.double_checkpoint = args.check_bool("double_checkpoint", double_checkpoint)
        self.delete_checkpoint = args.check_bool("delete_checkpoint", delete_checkpoint)
        self.save_before_preemption = args.check_bool(
            "save_before_preemption", save_before_preemption
        )
        self.preemption_exit_code = args.check_int("preemption_exit_code", preemption_exit_code, 0)
        self._metadata_path = os.path.join(self.backup_dir, _METADATA)
        self._previous_path = self._metadata_path + ".bkp"
        self._notice = None
        self._undo_skip = None
        self._set_epoch = False
        self._epoch_iterator = None

    # ------------------------------------------------------------ hooks

    def on_train_begin(self, logs=None):
        self._cleanup()  # what a fit() that raised left
        model = self.model
        if not model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be built "
                f"before you call `fit()`. Model {model.name} is unbuilt. You can "
                "build it beforehand by calling it on a batch of data."
            )
        strategy = model.distribute_strategy
        self._chief = cluster.is_chief(strategy)
        self._several_workers = cluster.is_multi_worker(strategy)
        self._epoch = 0
        self._batches_done = 0  # in the current epoch
        self._since_save = 0
        self._step_ends = 0  # this fit()'s step ends, the same on every worker
        self._skip_left = 0
        self._skipped_call = False
        self._preempting = False
        self._save_due = False
        self._chunk_begin = 0
        self._stream_left = 0
        # Keras' epoch iterator of this fit(): where its data iterator is.
        self._epoch_iterator = hooks.fit_epoch_iterator(model)
        self._restored_file = None
        self._metric_states = None  # to put back at the resumed epoch's start
        restored = self._restore()
        if self._several_workers:
            _agree_on_restore(strategy, self.backup_dir, restored, self._restored_file)
        if restored is not None:
            epoch, batches, stream = restored
            hooks.set_initial_epoch(model, epoch)
            self._set_epoch = True
            self._epoch = epoch
            self._start_skipping(batches, stream)
        if self.save_before_preemption:
            self._notice = preemption.PreemptionNotice(
                strategy, running=lambda frame: hooks.fit_epoch_iterator(model, frame) is not None
            )
            self._notice.start()

    def on_epoch_begin(self, epoch, logs=None):
        if self._set_epoch:
            # fit() has read it by now: cleared at once, so no later fit()
            # starts there, even if this one raises.
            hooks.set_initial_epoch(self.model, None)
            self._set_epoch = False
            if epoch != self._epoch:
                raise ValueError(
                    f"The backup in {self.backup_dir!r} resumes at epoch "
                    f"{self._epoch}, but this fit() starts at epoch {epoch} (its "
                    "`initial_epoch` argument): the batches skipped would be "
                    "another epoch's. Pass initial_epoch=0 (the backup sets the "
                    "start), or delete the backup."
                )
        self._epoch = epoch
        self._batches_done = self._skip_left  # those the backup has seen

    def on_train_batch_end(self, batch, logs=None):
        self._step_ends += 1
        if self._skipped_call:
            self._skipped_call = False
            if self._skip_left == 0:
                self._stop_skipping()
            return
        done = self._chunk_begin + int(self.model.steps_per_execution)
        steps = (self.params or {}).get("steps")
        if steps:  # a short last chunk counts its real batches
            done = min(done, steps)
        self._since_save += done - self._batches_done
        self._batches_done = done
        # (save_freq is an int >= 1 here, or "epoch", or False.)
        if self.save_freq not in ("epoch", False) and self._since_save >= self.save_freq:
            self._save_due = True
        if self._notice is not None and self._notice.due(self._step_ends):
            self._save_due = self._preempting = True
        self._save_if_due()

    def on_epoch_end(self, epoch, logs=None):
        # (A GradBoostModel applied the epoch's last window before this.)
        self._epoch = epoch + 1
        self._batches_done = 0
        if self.save_freq == "epoch":
            self._save_due = True
        self._save_if_due()

    def _save_if_due(self):
        """Saves when a save is due and nothing holds it back (else at the
        next step end); exits after a preemption's save."""
        if self._save_due and self._can_save_now():
            self._save()
            if self._preempting:
                self._exit_for_preemption()

    def on_train_end(self, logs=None):
        if self._notice is not None and self._notice.signalled and not self._preempting:
            # SIGTERM after the last step end: training is done, but the
            # process is asked to go before fit() returns. A backup of the
            # end, kept: the restarted fit() returns at once, and the code
            # after it runs then.
            self._cleanup()
            self._save()
            raise SystemExit(self.preemption_exit_code)
        self._cleanup()
        if self.delete_checkpoint and self._chief and tf.io.gfile.exists(self.backup_dir):
            tf.io.gfile.rmtree(self.backup_dir)

    # -------------------------------------------------------- skipping

    def _start_skipping(self, batches, stream):
        chunk = int(self.model.steps_per_execution)
        steps = (self.params or {}).get("steps")
        if batches % chunk and batches != steps:  # (the epoch's short last chunk is whole)
            raise ValueError(
                f"The backup in {self.backup_dir!r} was taken after {batches} "
                f"batches of epoch {self._epoch}, inside a chunk of "
                f"steps_per_execution={chunk} batches: the restarted fit() cannot "
                "start there. Compile the model with the steps_per_execution it "
                "was trained with."
            )
        self._skip_left = batches
        if batches:
            _RESUMED[self.model] = (self._epoch, batches)
        now = self._stream_position()
        if stream is _UNKNOWN:
            if now is not None and (self._epoch or batches):
                warnings.warn(
                    f"The backup in {self.backup_dir!r} does not say where in the "
                    "data the interrupted fit() was (it was written by Keras' own "
                    "BackupAndRestore), and with `steps_per_epoch` the epochs go "
                    "on from each other through the data: resumed at the data's "
                    "start, which the interrupted fit() was not at.",
                    stacklevel=3,
                )
            return
        if (stream is None) != (now is None):
            raise ValueError(
                f"The backup in {self.backup_dir!r} was taken in a fit() "
                + ("with" if stream is not None else "without")
                + " `steps_per_epoch`, where the epochs "
                + ("go on from each other through the data" if stream is not None
                   else "each start the data again")
                + "; this fit() is "
                + ("without" if stream is not None else "with")
                + " one: it would resume at other batches. Pass the "
                "`steps_per_epoch` the interrupted fit() had, or delete the backup."
            )
        if stream is not None:
            # The batches earlier epochs drew from the data iterator, which
            # the interrupted fit() went on with and this one starts again.
            self._stream_left = stream - batches

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch, logs)  # the run gate's mark
        # The call's first batch: Keras 3.15 ends it at its last batch,
        # Keras 3.8 at its first; counted from here the same in both.
        self._chunk_begin = batch
        if (self._skip_left or self._stream_left) and self._undo_skip is None:
            # Put in place at the first call, over the wrappers other
            # callbacks put on the train function at on_train_begin: a
            # skipped batch reaches none of them.
            self._undo_skip = wrappers.patch(self.model, "train_function", self._skip_or_train)

    def _skip_or_train(self, train_function, iterator):
        if not self._in_run("train"):  # not this callback's fit(): one that raised
            self._cleanup()
            return train_function(iterator)
        first = None
        if self._stream_left > 0:
            for _ in range(self._stream_left):
                first = _draw(iterator)
                if first is None:
                    raise ValueError(
                        f"The backup in {self.backup_dir!r} was taken after the "
                        "data iterator had given more batches than this fit()'s "
                        "data has: the restarted fit() has other data than the "
                        "interrupted one."
                    )
            hooks.advance_stream(self._epoch_iterator, self._stream_left)
            self._stream_left = 0
        if self._skip_left <= 0:
            self._stop_skipping()
            return train_function(iterator)
        count = min(int(self.model.steps_per_execution), self._skip_left)
        for drawn in range(count):
            batch = _draw(iterator)
            first = batch if first is None else first
            if batch is None:
                if drawn and count == self._skip_left:
                    # A backup after the short last chunk of an epoch of
                    # unknown length (Keras numbered it as a whole chunk):
                    # the epoch ends here, as Keras' function ends it.
                    self._skip_left = 0
                    if self._metric_states is not None:
                        self._restore_metric_states(first)
                    raise StopIteration
                raise ValueError(
                    f"The backup in {self.backup_dir!r} was taken after "
                    f"{self._batches_done} batches of epoch {self._epoch}, but "
                    "this epoch's data has fewer: the restarted fit() has other "
                    "data than the interrupted one."
                )
        self._skip_left -= count
        self._skipped_call = True
        if self._metric_states is not None:  # (Keras reset them at the epoch's start)
            self._restore_metric_states(first)
        return {}

    def _restore_metric_states(self, batch):
        """Puts the backup's metric states in, at the resumed epoch's first
        call: the epoch's logs cover every batch of the epoch, as
        uninterrupted. Keras builds a model's compiled metrics at the first
        trace when no strategy is set: they are built here first, from the
        shapes of `batch` (one the skipping drew)."""
        states, self._metric_states = self._metric_states, None
        model = self.model
        if len(states) != len(model.metrics_variables) and batch is not None:
            hooks.symbolic_build(model, batch)
        variables = model.metrics_variables
        if len(states) != len(variables):
            warnings.warn(
                f"The backup in {self.backup_dir!r} holds {len(states)} metric "
                f"states, this model has {len(variables)}: the metrics of the "
                "resumed epoch cover the batches after the resume only.",
                stacklevel=2,
            )
            return
        for variable, value in zip(variables, states):
            variable.assign(value)

    def _stop_skipping(self):
        if self._undo_skip is not None:
            self._undo_skip()
            self._undo_skip = None

    # ------------------------------------------------------ save, load

    def _can_save_now(self):
        # Under several workers a GradBoostModel's pending window is spread
        # over the workers: wait for the update (the same step on each).
        if self._several_workers and checkpoint.pending_micro_batches(self.model):
            return False
        return not any(holding() for holding in list(_HOLDS.get(self.model, ())))

    def _save(self):
        self._since_save = 0
        self._save_due = False
        # The epoch's metrics so far (a resumed epoch goes on from them).
        # Under several workers a metric's value is all-reduced when read,
        # which only the chief does here: not kept.
        metrics = None
        if self._batches_done and not self._several_workers:
            metrics = [v.numpy().tolist() for v in self.model.metrics_variables]
        if not self._chief:
            return
        tf.io.gfile.makedirs(self.backup_dir)
        name = f"epoch{self._epoch}-batch{self._batches_done}.weights.h5"
        path = os.path.join(self.backup_dir, name)
        staging = os.path.join(self.backup_dir, "staging-" + name)
        self.model.save_weights(staging, overwrite=True)
        tf.io.gfile.rename(staging, path, overwrite=True)
        seeds = _seed_states(self.model)
        metadata = {
            "epoch": self._epoch,
            "batch": max(self._batches_done - 1, 0),  # what Keras' callback writes
            "batches_done": self._batches_done,
            # Batches drawn from the data iterator the next batch comes from,
            # where epochs go on from each other (None: each starts it again).
            "stream_batches": self._stream_position(),
            "steps_per_execution": int(self.model.steps_per_execution),
            "weights": name,
            "format": _FORMAT,
            # Keras' save_weights leaves out the seed generators' states:
            # without them a resumed Dropout draws the masks of epoch 0.
            "seed_states": [v.numpy().tolist() for v in seeds],
            # And a stateful RNN's states: without them it resumes from zeros.
            "rnn_states": [v.numpy().tolist() for v in hooks.untracked_state(self.model)],
            "metric_states": metrics,
        }
        kept = {name}
        if self.double_checkpoint and tf.io.gfile.exists(self._metadata_path):
            tf.io.gfile.copy(self._metadata_path, self._previous_path, overwrite=True)
            kept.add(_read(self._previous_path).get("weights", _KERAS_WEIGHTS))
        _write_atomically(self._metadata_path, json.dumps(metadata))
        for old in tf.io.gfile.listdir(self.backup_dir):
            if old.endswith(".weights.h5") and old not in kept:
                tf.io.gfile.remove(os.path.join(self.backup_dir, old))

    def _restore(self):
        """Loads the backup, if any: `(epoch, batches done in it, batches drawn
        from the data iterator)`, or None."""
        try:
            return self._load(self._metadata_path)
        except (OSError, ValueError, KeyError) as error:
            if not tf.io.gfile.exists(self._previous_path):
                raise
            warnings.warn(
                f"The latest backup in {self.backup_dir!r} cannot be read "
                f"({error}); restoring the previous one.",
                stacklevel=2,
            )
            restored = self._load(self._previous_path)
            # The previous backup is the latest now (the next save keeps it as
            # the previous one, not the unreadable one).
            tf.io.gfile.copy(self._previous_path, self._metadata_path, overwrite=True)
            return restored

    def _load(self, metadata_path):
        metadata = _read(metadata_path) if tf.io.gfile.exists(metadata_path) else None
        name = _KERAS_WEIGHTS if metadata is None else metadata.get("weights", _KERAS_WEIGHTS)
        weights = os.path.join(self.backup_dir, name)
        if metadata is not None and not tf.io.gfile.exists(weights):
            raise OSError(f"{metadata_path} names {name}, which is not in {self.backup_dir!r}")
        if tf.io.gfile.exists(weights):
            optimizer = self.model.optimizer
            if optimizer is not None and not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            self.model.load_weights(weights)
            self._restored_file = name
        if metadata is None:
            return None
        saved_states, states = metadata.get("seed_states", []), _seed_states(self.model)
        if len(saved_states) == len(states):
            for variable, value in zip(states, saved_states):
                variable.assign(value)
        else:
            warnings.warn(
                f"The backup in {self.backup_dir!r} holds {len(saved_states)} "
                f"random seed states, this model has {len(states)} random "
                "layers: their seeds are not restored (the random layers draw "
                "other values than the interrupted fit would have).",
                stacklevel=3,
            )
        saved_states, states = metadata.get("rnn_states"), hooks.untracked_state(self.model)
        if saved_states is not None and len(saved_states) == len(states):
            for variable, value in zip(states, saved_states):
                variable.assign(value)
        elif states or saved_states:
            warnings.warn(
                f"The backup in {self.backup_dir!r} holds "
                + ("no stateful RNN states" if saved_states is None else f"{len(saved_states)} stateful RNN states")
                + f", this model has {len(states)}: they are not restored (the "
                "stateful RNN layers go on from other states than the "
                "interrupted fit would have).",
                stacklevel=3,
            )
        self._metric_states = metadata.get("metric_states")
        if "batches_done" in metadata:
            batches = int(metadata["batches_done"])
        else:  # Keras' own callback: "batch" is the last batch seen, 0 at an epoch's end
            batches = int(metadata.get("batch", 0)) + 1 if metadata.get("batch", 0) else 0
            if not batches and int(metadata["epoch"]):
                warnings.warn(
                    f"The backup in {self.backup_dir!r} was written by Keras' own "
                    "BackupAndRestore, whose `batch: 0` means either an epoch's "
                    "end or its first batch: resumed at the start of epoch "
                    f"{int(metadata['epoch'])}. If it was taken after that epoch's "
                    "first batch, that batch is trained twice.",
                    stacklevel=3,
                )
        return int(metadata["epoch"]), batches, metadata.get("stream_batches", _UNKNOWN)

    def _stream_position(self):
        """Where the data iterator is: `hooks.stream_position` of this fit()'s
        epoch iterator (None: each epoch starts the data again)."""
        if self._epoch_iterator is None:
            return None
        return hooks.stream_position(self._epoch_iterator)

    # ---------------------------------------------------------- ending

    def _exit_for_preemption(self):
        self._cleanup()
        raise SystemExit(self.preemption_exit_code)

    def _cleanup(self):
        """Undoes what a fit() put in place; returns whether a SIGTERM came
        that was not acted on."""
        self._stop_skipping()
        self._epoch_iterator = None
        if self.model is not None:
            _RESUMED.pop(self.model, None)
        signalled = False
        if self._notice is not None:
            signalled = self._notice.stop() and not self._preempting
            self._notice = None
        if self._set_epoch:  # Keras would start every later fit() there
            hooks.set_initial_epoch(self.model, None)
            self._set_epoch = False
        return signalled


def _agree_on_restore(strategy, backup_dir, restored, weights_file):
    """Checks that every worker restored what the chief restored.

    A `backup_dir` that is not one shared directory (a local path on each
    machine), or a worker whose read of the latest backup failed and fell
    back to the previous one, would start the workers from different
    weights and steps: their all-reduced steps would mix them silently. The
    chief publishes what it restored through the coordination service;
    every other worker compares and answers; any difference raises on every
    worker, before the first step.
    """
    key = f"keras_gradboost/backup/{next(_fits)}"
    at = None if restored is None else [None if v is _UNKNOWN else v for v in restored]
    mine = json.dumps({"weights": weights_file, "at": at})
    index = cluster.worker_index(strategy)
    if cluster.is_chief(strategy):
        hooks.coordination_set(key, mine)
        for other in range(1, cluster.worker_count(strategy)):
            try:
                answer = hooks.coordination_get(f"{key}/{other}", preemption.ACK_TIMEOUT_SECONDS)
            except TimeoutError:
                continue  # a worker that died: TensorFlow notices it at the first step
            if answer:
                raise ValueError(answer)
        return
    chief = hooks.coordination_get(key, preemption.ACK_TIMEOUT_SECONDS * 3)
    problem = ""
    if chief != mine:
        def say(text):
            found = json.loads(text)
            if found["at"] is None:
                return "no backup" if found["weights"] is None else f"{found['weights']}"
            epoch, batches, _ = found["at"]
            return f"{found['weights']} (epoch {epoch}, after {batches} batches)"

        problem = (
            f"Worker {index} restored {say(mine)} from {backup_dir!r}, but the "
            f"chief restored {say(chief)}: the workers would start from "
            "different weights and steps. `backup_dir` must be one directory "
            "every worker reads (a shared file system, or a cloud bucket "
            "path), not a local path on each machine."
        )
    hooks.coordination_set(f"{key}/{index}", problem)
    if problem:
        raise ValueError(problem)


def _seed_states(model):
    """The states of the model's seed generators (the random layers':
    Dropout, GaussianNoise, ...), in the order of `model.variables` (their
    paths get a suffix when a process builds the model twice)."""
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


def _check_save_freq(value):
    expected = "'epoch', an int >= 1 (a number of batches) or False"
    if value is False or value == "epoch":
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise args.type_error("save_freq", value, expected)
    if value < 1:
        raise args.value_error("save_freq", value, expected)
    return value


def _draw(iterator):
    """Draws one batch from a train function's iterator; None at its end."""
    if hasattr(iterator, "get_next_as_optional"):
        optional = iterator.get_next_as_optional()
        return optional.get_value() if bool(optional.has_value()) else None
    try:
        return next(iterator)
    except (StopIteration, tf.errors.OutOfRangeError):
        return None


def _read(path):
    with tf.io.gfile.GFile(path, "r") as f:
        return json.loads(f.read())


def _write_atomically(path, text):
    staging = path + ".staging"
    with tf.io.gfile.GFile(staging, "w") as f:
        f.write(text)
    tf.io.gfile.rename(staging, path, overwrite=True)
