"""A worker of benchmarks/bench_faults.py: GradBoostModel.fit of the MLP
784-1024-1024-10 (accumulate_steps=4) under MultiWorkerMirroredStrategy
with keras_gradboost's BackupAndRestore on a shared `backup_dir`.

Arguments: the output directory, the phase, and the settings as JSON
(`batch`, `steps`, `save_freq`, `kill_at`). Phases:

* `fresh`: the fit from the start, no backup;
* `kill`: the same fit with backups; worker 1 writes the time and SIGKILLs
  itself at the end of batch `kill_at`; the survivor writes the time and
  the error its fit raised when TensorFlow notices;
* `resume`: the same fit with the same backup: it restores and goes on.

Each worker writes `<phase>-worker<i>.json`: the wall-clock time the process
started (before TensorFlow is imported), and the time of each batch end
with its batch index (and, for the survivor of `kill`, the error).
"""

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(out_dir, phase, settings):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    import keras

    import mw_worker
    from keras_gradboost import zoo
    from keras_gradboost.callbacks import BackupAndRestore

    record = {"started": STARTED, "batch_ends": []}

    class Times(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            record["batch_ends"].append([batch, time.time()])
            if phase == "kill" and index == 1 and batch == settings["kill_at"]:
                record["killed"] = time.time()
                write()
                os.kill(os.getpid(), signal.SIGKILL)

    def write():
        with open(os.path.join(out_dir, f"{phase}-worker{index}.json"), "w") as f:
            json.dump(record, f)

    with strategy.scope():
        model = zoo.mlp()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss="sparse_categorical_crossentropy", accumulate_steps=4)
    callbacks = [Times()]
    if phase != "fresh":
        callbacks.insert(0, BackupAndRestore(os.path.join(out_dir, "backup"),
                                             save_freq=settings["save_freq"]))
    try:
        model.fit(mw_worker.dataset(settings["batch"], tf), steps_per_epoch=settings["steps"],
                  epochs=1, verbose=0, callbacks=callbacks)
    except Exception as error:  # the survivor of `kill`
        record["error"] = type(error).__name__
        record["error_at"] = time.time()
        write()
        sys.exit(1)
    record["ended"] = time.time()
    write()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
