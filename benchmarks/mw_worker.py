"""A worker of benchmarks/bench_multi_worker.py: GradBoostModel.fit of the
MLP 784-1024-1024-10 under MultiWorkerMirroredStrategy, with
accumulate_steps 1 and 4.

Run by `keras_gradboost.launch` (which sets TF_CONFIG) with two arguments:
the output directory and the settings as JSON (`batch`, `count_steps`,
`steps`, `pairs`; `"strategy": "mirrored"` runs one process instead,
MirroredStrategy over two logical CPU devices). Each worker writes `worker<index>.json`:

- `counts`: per `accumulate_steps`, the gradient all-reduces, their bytes
  and the updates in one fit of `count_steps` micro-batches (the first fit
  of that model, untimed: it traces);
- `times`: `fit_rounds.paired` pairs of seconds per micro-batch, k=4 against
  k=1 and an A/A pair (two k=1 models), in timed fits of `steps`
  micro-batches after the untimed ones.

Both workers run the same fits in the same order (the collectives of a fit
must match across workers): `paired` shuffles with a fixed seed.
"""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def dataset(global_batch, tf):
    """The MLP's data, batched with the global batch, sharded by data (each
    worker keeps its part of every global batch), repeated, autotuning off
    (see `fit_rounds.dataset`)."""
    from keras_gradboost import zoo

    x, y = zoo.classification_data(global_batch * 8)
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat().prefetch(2)
    return data.with_options(options)


def count_all_reduces(tf):
    """Counts, in the graph, each all-reduce of several tensors that runs, as
    tests/workers/exact_fit.py does (the optimizer all-reduces a step's
    gradients in one `ReplicaContext.all_reduce`; a scalar sum reduces one
    value), and its bytes: the tensors' sizes times their dtype's, known
    when the step is traced. Patches this worker process only.

    Returns:
        `{"gradient_all_reduces": ..., "gradient_bytes": ...}`, int64
        variables.
    """
    counters = {
        name: tf.Variable(0, dtype=tf.int64, trainable=False)
        for name in ("gradient_all_reduces", "gradient_bytes")
    }
    all_reduce = tf.distribute.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        tensors = tf.nest.flatten(value)
        if len(tensors) > 1:
            counters["gradient_all_reduces"].assign_add(1)
            counters["gradient_bytes"].assign_add(
                sum(t.shape.num_elements() * t.dtype.size for t in tensors)
            )
        return all_reduce(self, reduce_op, value, options=options)

    tf.distribute.ReplicaContext.all_reduce = counting
    return counters


def _strategy(tf, settings):
    """MultiWorkerMirroredStrategy (this worker's index from TF_CONFIG), or,
    with `settings["strategy"] == "mirrored"`, MirroredStrategy over two
    logical CPU devices of this one process (index 0)."""
    if settings.get("strategy") == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), 0
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return strategy, json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def main(out_dir, settings):
    # The strategy first: it configures the collectives before any op runs.
    import tensorflow as tf

    strategy, index = _strategy(tf, settings)
    import keras
    from fit_rounds import paired
    from keras_gradboost import zoo

    counters = count_all_reduces(tf)
    ds = dataset(settings["batch"], tf)

    def make(k):
        with strategy.scope():
            model = zoo.mlp()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.compile(
                    optimizer=keras.optimizers.Adam(1e-3),
                    loss="sparse_categorical_crossentropy",
                    accumulate_steps=k,
                )
        return model

    models = {"k1": make(1), "k4": make(4), "k1_again": make(1)}
    counts = {}
    for name in ("k1", "k4"):
        for variable in counters.values():
            variable.assign(0)
        models[name].fit(ds, steps_per_epoch=settings["count_steps"], epochs=1, verbose=0)
        # Each worker process counts its own replicas' calls: under
        # MirroredStrategy one process holds every replica, each calling the
        # all-reduce once per update.
        local_replicas = 1 if settings.get("strategy") != "mirrored" else strategy.num_replicas_in_sync
        counts[name] = {key: int(v.numpy()) // local_replicas for key, v in counters.items()}
        counts[name]["updates"] = int(models[name].optimizer.iterations.numpy())
        print(name, counts[name], flush=True)
    times = paired(
        {
            "k4": [((models["k1"], []), (models["k4"], []))],
            "aa": [((models["k1"], []), (models["k1_again"], []))],
        },
        ds,
        settings["steps"],
        settings["pairs"],
        warmup_steps=4,
    )
    result = {
        "replicas": strategy.num_replicas_in_sync,
        "parameters": models["k1"].count_params(),
        "counts": counts,
        "times": times,
    }
    with open(os.path.join(out_dir, f"worker{index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
