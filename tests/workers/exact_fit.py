"""A worker of tests/test_multi_worker.py: GradBoostModel.fit under
MultiWorkerMirroredStrategy, one model per case, on the same global batches.

Run by `keras_gradboost.launch` (which sets TF_CONFIG), with the output
directory as argument. Each worker writes `worker<index>.npz`: per case the
initial and final weights, the optimizer's iterations, the gradient
all-reduces that ran, the skipped steps and the logged losses; and, for the
sharding check, the rows of `x` this worker's replica received at each step
of the regression dataset. Then the four callbacks' fits
(tests/workers/callbacks_fit.py) write theirs in `<out_dir>/callbacks`.

The dataset is batched with the global batch size and sharded with
`tf.data.experimental.AutoShardPolicy.DATA`: every worker reads the whole
dataset and keeps its part of each global batch (worker i the i-th slice of
`GLOBAL_BATCH / workers` rows), so the global batches are the same as one
process's.

The test process imports this file for `CASES`, `build`, `compile_case`
and the data, to compute the single-process reference.
"""

import json
import os
import sys

import numpy as np

N = 128  # regression samples: 8 global batches
GLOBAL_BATCH = 16
MASKED_N = 32  # masked samples: 4 global batches of 8
MASKED_BATCH = 8
T = 6  # masked time steps

# name: (model kind, compile arguments of GradBoostModel)
CASES = {
    "k1_sgd": ("dense", dict(optimizer=("sgd", 0.1), accumulate_steps=1)),
    "k4_sgd": ("dense", dict(optimizer=("sgd", 0.1), accumulate_steps=4)),
    # 8 micro-batches in windows of 3, 3 and 2: the last one flushed at the
    # epoch end.
    "k3_adam": ("dense", dict(optimizer=("adam", 0.01), accumulate_steps=3)),
    "k4_dynamic_scale": (
        "dense",
        dict(optimizer=("sgd", 0.1), accumulate_steps=4, loss_scale="dynamic"),
    ),
    # A NaN in one row of worker 1's part of global batch 0 (loss_scale=1.0
    # checks every micro-batch): every worker skips that micro-batch, and
    # the first window's update is the mean over the other three.
    "k4_nan_skip": ("nan", dict(optimizer=("sgd", 0.1), accumulate_steps=4, loss_scale=1.0)),
    # A last global batch of 9 (worker 0 gets 5 rows, worker 1 gets 4), and
    # of 1 (worker 1's part is empty), in a last window of 2 micro-batches.
    "k3_tail_5_4": ("tail:121", dict(optimizer=("sgd", 0.1), accumulate_steps=3)),
    "k3_tail_1_0": ("tail:113", dict(optimizer=("sgd", 0.1), accumulate_steps=3)),
    # The same NaN, found by a NaNWatcher's watch (no loss scale).
    "k4_nan_watcher": ("nan", dict(optimizer=("sgd", 0.1), accumulate_steps=4)),
    # The same NaN with action="stop": every worker stops at that step, with
    # the weights it started with (no update was applied before it).
    "k4_nan_stop": ("nan", dict(optimizer=("sgd", 0.1), accumulate_steps=4)),
    # Recompute: each replica recomputes its own blocks in the backward pass.
    # Named: "auto" estimates at each replica's share of the batch, where
    # this small model has nothing to save, and recomputes nothing.
    "k2_recompute": (
        "dense", dict(optimizer=("sgd", 0.1), accumulate_steps=2, recompute=["hidden"])
    ),
    # Keras divides a masked loss by the valid entries of each replica's
    # batch; the window normalises by the valid entries of all workers.
    "masked_k2": ("masked", dict(optimizer=("sgd", 0.5), accumulate_steps=2)),
    # Mixed precision: bfloat16 (no loss scale) and float16 with the dynamic
    # loss scale, each replica's scaled gradients summed over the workers.
    "k2_bf16": ("dense", dict(optimizer=("sgd", 0.1), accumulate_steps=2, precision="mixed_bfloat16")),
    "k2_f16": ("dense", dict(optimizer=("sgd", 0.1), accumulate_steps=2, precision="mixed_float16")),
}


NAN_ROW = 12  # in global batch 0, the second half: worker 1's part


def callbacks(name):
    """The callbacks of case `name`'s fit."""
    from keras_gradboost.callbacks import NaNWatcher

    if name == "k4_nan_watcher":
        return [NaNWatcher(action="skip", verbose=0)]
    if name == "k4_nan_stop":
        return [NaNWatcher(action="stop", verbose=0)]
    return []


def regression_data(nan=False):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 5)).astype("float32")
    y = rng.normal(size=(N, 3)).astype("float32")
    if nan:
        x[NAN_ROW] = np.nan
    return x, y


def masked_data():
    """Ids padded with 0 after a length of 1..T per row: valid counts differ
    between replicas and micro-batches."""
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 20, size=(MASKED_N, T))
    lengths = rng.integers(1, T + 1, size=MASKED_N)
    lengths[:4] = 1  # one replica's first part with few valid steps
    ids[np.arange(T)[None, :] >= lengths[:, None]] = 0
    labels = rng.integers(0, 3, size=(MASKED_N, T))
    return ids.astype("int32"), labels.astype("int32")


def build(kind, cls):
    """The case's model as `cls` (GradBoostModel, or keras.Model for the
    reference)."""
    import keras

    keras.utils.set_random_seed(0)
    if kind != "masked":
        inputs = keras.Input((5,))
        h = keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2", name="hidden")(inputs)
        return cls(inputs, keras.layers.Dense(3)(h))
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(20, 6, mask_zero=True)(inputs)
    h = keras.layers.Dense(8, activation="tanh")(h)
    return cls(inputs, keras.layers.Dense(3)(h))


def loss(kind):
    import keras

    if kind != "masked":
        return "mse"
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer(spec):
    import keras

    name, rate = spec
    return {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[name](rate)


def data(kind):
    """`(x, y, global batch size)` of a model kind; `"tail:<n>"`: the first
    n regression samples, whose last global batch is split unevenly."""
    if kind == "masked":
        return (*masked_data(), MASKED_BATCH)
    x, y = regression_data(nan=kind == "nan")
    if kind.startswith("tail:"):
        n = int(kind.split(":")[1])
        x, y = x[:n], y[:n]
    return x, y, GLOBAL_BATCH


def dataset(kind):
    import tensorflow as tf

    x, y, batch = data(kind)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).with_options(options)


def count_gradient_all_reduces():
    """Counts, in the graph, each all-reduce of several tensors that runs
    (the optimizer all-reduces a step's gradients in one
    `ReplicaContext.all_reduce`; the step's scalar sums and Keras' logs
    reduce one value each). Patches this worker process only."""
    import tensorflow as tf

    counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    all_reduce = tf.distribute.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        if len(tf.nest.flatten(value)) > 1:
            counter.assign_add(1)
        return all_reduce(self, reduce_op, value, options=options)

    tf.distribute.ReplicaContext.all_reduce = counting
    return counter


def main(out_dir):
    # The strategy first: it configures the collectives before any op runs.
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    from keras_gradboost import GradBoostModel
    from keras_gradboost.callbacks import NonFiniteError

    counter = count_gradient_all_reduces()
    saved = {"replicas": np.array(strategy.num_replicas_in_sync)}
    for step, (x, _) in enumerate(strategy.experimental_distribute_dataset(dataset("dense"))):
        saved[f"shard/{step}"] = np.concatenate(
            [np.asarray(v) for v in strategy.experimental_local_results(x)]
        )
    for name, (kind, kwargs) in CASES.items():
        kwargs = dict(kwargs)
        if kind.startswith("tail:"):  # the rows of this worker's last part
            for x, _ in strategy.experimental_distribute_dataset(dataset(kind)):
                pass
            saved[f"{name}/last_part"] = np.array(
                sum(len(v) for v in strategy.experimental_local_results(x))
            )
        with strategy.scope():
            model = build(kind, GradBoostModel)
            model.compile(optimizer=optimizer(kwargs.pop("optimizer")), loss=loss(kind), **kwargs)
        for i, w in enumerate(model.get_weights()):
            saved[f"{name}/init/{i}"] = w
        counter.assign(0)
        try:
            history = model.fit(dataset(kind), epochs=1, verbose=0, callbacks=callbacks(name))
            losses = history.history["loss"]
        except NonFiniteError:
            losses = []
        saved[f"{name}/stopped"] = np.array(not losses)
        if kwargs.get("recompute"):
            saved[f"{name}/recomputed"] = np.array(model.recompute_plan().recomputed)
        saved[f"{name}/gradient_all_reduces"] = np.array(int(counter.numpy()))
        for i, w in enumerate(model.get_weights()):
            saved[f"{name}/final/{i}"] = w
        saved[f"{name}/iterations"] = np.array(int(model.optimizer.iterations.numpy()))
        saved[f"{name}/loss"] = np.array(losses)
        saved[f"{name}/skipped"] = np.array(model.step_facts.read()["skipped_steps"])
        print(name, "iterations", int(model.optimizer.iterations.numpy()), flush=True)
    # XLA: TensorFlow has no collectives on CPU devices; the plan says so
    # and trains without it (compiled only: no step runs).
    import warnings

    with strategy.scope():
        model = build("dense", GradBoostModel)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.compile(optimizer="sgd", loss="mse", jit_compile=True, accumulate_steps=2)
    saved["xla_blocked"] = np.array(str(model.xla_blocked_reason))
    saved["xla_warning"] = np.array(" ".join(str(w.message) for w in caught))
    saved["jit_compile"] = np.array(bool(model.jit_compile))
    np.savez(os.path.join(out_dir, f"worker{index}.npz"), **saved)
    # The four callbacks, in this job's processes (tests/workers/callbacks_fit.py,
    # beside this script; on the path even with PYTHONSAFEPATH set).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import callbacks_fit

    callbacks_dir = os.path.join(out_dir, "callbacks")
    os.makedirs(callbacks_dir, exist_ok=True)
    callbacks_fit.run_cases(strategy, callbacks_dir, index)


if __name__ == "__main__":
    main(sys.argv[1])
