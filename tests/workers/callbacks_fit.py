"""The callbacks part of the job of tests/test_multi_worker.py:
GradBoostModel.fit under MultiWorkerMirroredStrategy with the four
callbacks, a NaN in worker 1's part of one global batch, a variable whose
gradient is cut.

tests/workers/exact_fit.py calls `run_cases` after its own cases, in the
same worker processes (a job of its own would start two more processes:
about 20 s of CI); run alone (`keras_gradboost.launch`, the output
directory as argument), `main` does the same. Each worker writes
`callbacks-worker<i>.npz`: its final weights, the optimizer's iterations,
what each callback reported; then the same with
`NaNWatcher(action="warn")` (in `<out_dir>/warn`), `warn-worker<i>.npz`.
`run(strategy, out_dir)` is also called by the test in its own process
(the default strategy, no sharding) for the single-process reference.
"""

import json
import os
import sys

import numpy as np

N, GLOBAL_BATCH, EPOCHS = 96, 16, 2
NAN_ROW = 3 * GLOBAL_BATCH + 12  # global batch 3, in its second half: worker 1's part


def data():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(N, 5)).astype("float32")
    y = rng.normal(size=(N, 3)).astype("float32")
    x[NAN_ROW] = np.nan
    return x, y


def dataset(shard):
    import tensorflow as tf

    x, y = data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    if shard:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        ds = ds.with_options(options)
    return ds


def build():
    """An MLP whose "cut" layer's output is behind a stop_gradient: its
    variables get no gradient (GradientAuditor names them)."""
    import keras

    from keras_gradboost import GradBoostModel

    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    out = keras.layers.Dense(3, name="out")(h)
    cut = keras.ops.stop_gradient(keras.layers.Dense(3, name="cut")(inputs))
    model = GradBoostModel(inputs, keras.layers.Add(name="add")([out, cut]))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", accumulate_steps=2)
    return model


def run(strategy, out_dir, index=0, shard=True, action="restore"):
    from keras_gradboost.callbacks import GradientAuditor
    from keras_gradboost.callbacks import NaNWatcher
    from keras_gradboost.callbacks import RetraceCounter
    from keras_gradboost.callbacks import StepTimeMonitor

    with strategy.scope():
        model = build()
    watcher = NaNWatcher(action=action, dump_dir=os.path.join(out_dir, "dumps"), verbose=0)
    monitor = StepTimeMonitor(window=2, log_dir=os.path.join(out_dir, "tensorboard"))
    counter = RetraceCounter()
    auditor = GradientAuditor(on_missing="ignore")
    model.fit(dataset(shard), epochs=EPOCHS, verbose=0,
              callbacks=[watcher, monitor, counter, auditor])
    report = {
        "nan_events": [[e.epoch, e.step, e.action_taken] for e in watcher.events],
        "missing": sorted(m.variable for m in auditor.report().missing),
        "retraces": counter.report().retraces,
        "steps_timed": monitor.report().steps,
        "iterations": int(model.optimizer.iterations.numpy()),
    }
    return model.get_weights(), report


def run_cases(strategy, out_dir, index):
    """Both actions' fits on every worker, their files in `out_dir`."""
    for action, name in (("restore", "callbacks"), ("warn", "warn")):
        where = out_dir if action == "restore" else os.path.join(out_dir, action)
        weights, report = run(strategy, where, index, action=action)
        np.savez(os.path.join(out_dir, f"{name}-worker{index}.npz"), *weights,
                 report=np.array(json.dumps(report)))


def main(out_dir):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    run_cases(strategy, out_dir, json.loads(os.environ["TF_CONFIG"])["task"]["index"])


if __name__ == "__main__":
    main(sys.argv[1])
