"""A worker of tests/test_multi_worker_faults.py: GradBoostModel.fit under
MultiWorkerMirroredStrategy with keras_gradboost's BackupAndRestore on a
`backup_dir` both workers share, interrupted and restarted.

Run by `keras_gradboost.launch` with `out_dir` and a list of
`<case>:<phase>` arguments, done in order:

* `kill`: worker 1 SIGKILLs itself at the end of `KILL_AT` (epoch, batch);
* `interrupt`: every worker raises there (the backup on disk is the one a
  kill leaves), and the job goes on to its next phase;
* `term`: worker 1 sends itself SIGTERM there (the case saves before
  preemption: every worker saves at the same step and exits);
* `resume`: the same fit() with the same backup, to its end; each worker
  writes `<case>-worker<i>.npz` with its final weights and the optimizer's
  iterations;
* `midwindow` (no backup): every worker calls `save_weights` in the middle
  of a window, and writes the error it got to `midwindow-worker<i>.txt`;
* `split:interrupt` and `split:resume`: each worker has a `backup_dir` of
  its own (not shared); the first fit() raises on every worker at
  `SPLIT_AT` (only the chief's directory gets a backup), the second one
  restores: every worker writes the error it got to `split-worker<i>.txt`.

Each case's data is the regression data of tests/workers/exact_fit.py,
batched with the global batch size and sharded with AutoShardPolicy.DATA
(the same global batches as one process, checked by test_multi_worker.py).
"""

import json
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_fit  # noqa: E402

EPOCHS = 2
KILL_AT = (1, 5)  # after the backup at (1, 3): mid-epoch
SPLIT_AT = (0, 4)  # after the backup of 4 batches (save_freq=2)
TERM_AT = (1, 1)  # the agreed step is (1, 2): mid-window for k=4
# name: (accumulate_steps, BackupAndRestore kwargs)
CASES = {
    "k1": (1, dict(save_freq=3)),
    "k4": (4, dict(save_freq=3)),
    "k4_term": (4, dict(save_freq=False, save_before_preemption=True)),
}


class _At:
    """At the end of batch `at` of its epoch, calls `action` on worker 1."""

    def __init__(self, at, action, index, every_worker=False):
        import keras

        class At(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_end(self, batch, logs=None):
                if (self.epoch, batch) == at and (index == 1 or every_worker):
                    print("worker 1 at", at, flush=True)
                    action()

        self.callback = At()


def model(strategy, accumulate_steps):
    import keras

    from keras_gradboost import GradBoostModel

    with strategy.scope():
        m = exact_fit.build("dense", GradBoostModel)
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                  accumulate_steps=accumulate_steps, loss_scale="dynamic")
    return m


def _interrupt():
    raise RuntimeError("interrupted")


def _save_mid_window(m, out_dir, index):
    import keras

    path = os.path.join(out_dir, f"midwindow-worker{index}.weights.h5")

    class SaveAfterOneBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                try:
                    m.save_weights(path)
                    error = "saved"
                except ValueError as e:
                    error = str(e)
                with open(os.path.join(out_dir, f"midwindow-worker{index}.txt"), "w") as f:
                    f.write(error)

    m.fit(exact_fit.dataset("dense"), epochs=1, verbose=0, callbacks=[SaveAfterOneBatch()])


def _split(m, out_dir, index, phase):
    """Backups in a directory of each worker's own."""
    from keras_gradboost.callbacks import BackupAndRestore

    backup = BackupAndRestore(os.path.join(out_dir, f"split-{index}"), save_freq=2)
    if phase == "interrupt":
        callbacks = [backup, _At(SPLIT_AT, _interrupt, index, every_worker=True).callback]
        try:
            m.fit(exact_fit.dataset("dense"), epochs=EPOCHS, verbose=0, callbacks=callbacks)
        except RuntimeError:
            pass
        return
    try:
        m.fit(exact_fit.dataset("dense"), epochs=EPOCHS, verbose=0, callbacks=[backup])
        error = "trained"
    except ValueError as e:
        error = str(e)
    with open(os.path.join(out_dir, f"split-worker{index}.txt"), "w") as f:
        f.write(error)


def main(out_dir, jobs):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    from keras_gradboost.callbacks import BackupAndRestore

    for job in jobs:
        name, phase = job.split(":")
        if name == "split":
            _split(model(strategy, 1), out_dir, index, phase)
            continue
        k, kwargs = CASES[name]
        m = model(strategy, k)
        if phase == "midwindow":
            _save_mid_window(m, out_dir, index)
            continue
        callbacks = [BackupAndRestore(os.path.join(out_dir, name), **kwargs)]
        if phase == "kill":
            callbacks.append(_At(KILL_AT, lambda: os.kill(os.getpid(), signal.SIGKILL), index).callback)
        elif phase == "interrupt":
            callbacks.append(_At(KILL_AT, _interrupt, index, every_worker=True).callback)
        elif phase == "term":
            callbacks.insert(0, _At(TERM_AT, lambda: os.kill(os.getpid(), signal.SIGTERM), index).callback)
        if index == 0 and phase != "resume":
            np.savez(os.path.join(out_dir, f"{name}-init.npz"), *m.get_weights())
        try:
            m.fit(exact_fit.dataset("dense"), epochs=EPOCHS, verbose=0, callbacks=callbacks)
        except RuntimeError:
            if phase != "interrupt":
                raise
            print(name, phase, "done", flush=True)
            continue
        if phase == "interrupt":
            raise AssertionError(f"{name}: the fit was not interrupted at {KILL_AT}")
        np.savez(
            os.path.join(out_dir, f"{name}-worker{index}.npz"),
            *m.get_weights(),
            iterations=np.array(int(m.optimizer.iterations.numpy())),
        )
        print(name, phase, "done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
