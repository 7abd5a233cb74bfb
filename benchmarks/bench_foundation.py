"""Foundation benchmark: GradBoostModel overhead, accumulation, precision.

MLP 784-1024-1024-10, batch 256, Adam, CPU. Every configuration is compiled
once, warmed up, then timed in interleaved rounds (each round times every
configuration once, in a shuffled order) in this one process; each timing
runs `--steps` batches through the model's compiled train function (what
`fit` calls per batch) from a repeated tf.data pipeline, with one host sync. A ratio A/B is the median
over rounds of A's time over B's time in the same round. Only ratios measured
side by side are printed.

The precision section ends with the measured `precision="auto"` on the MLP,
the small `zoo.cnn` (32x32x3, batch 128) and ResNet50 (weights=None, 64x64x3
images, batch 32): one `fit` of the measured calls each, printing both
medians, the choice, and what the static rule it starts from would have
picked (`--only measure` runs just this).

    python benchmarks/bench_foundation.py [--steps 20] [--rounds 7] [--quick]
        [--only overhead|accumulate|precision|measure]
"""

import argparse
import os
import random
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
from keras_gradboost import precision as precision_lib  # noqa: E402
from keras_gradboost import precision_measure  # noqa: E402
from keras_gradboost import zoo  # noqa: E402

BATCH = 256


def dataset():
    x, y = zoo.classification_data(BATCH * 8)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat().prefetch(2)


def make(kind, jit, optimizer_kwargs=None, **gradboost):
    cls = keras.Model if kind == "keras" else None
    model = zoo.mlp(cls=cls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3, **(optimizer_kwargs or {})),
            loss="sparse_categorical_crossentropy",
            jit_compile=jit,
            **gradboost,
        )
    return model


def time_per_batch(model, iterator, steps):
    """Seconds per batch of `steps` calls of the model's compiled train
    function (what `fit` calls per batch), with one host sync at the end."""
    start = time.perf_counter()
    for _ in range(steps):
        logs = model.train_function(iterator)
    float(logs["loss"])
    return (time.perf_counter() - start) / steps


class Timings:
    """Seconds per batch of each model in each round."""

    def __init__(self, samples):
        self.samples = samples

    def __getitem__(self, name):
        return statistics.median(self.samples[name])

    def ratio(self, a, b):
        """Median over rounds of the within-round ratio a / b."""
        return statistics.median(
            x / y for x, y in zip(self.samples[a], self.samples[b])
        )


def measure(models, steps, rounds, seed=0):
    """Times every model in each round, in a shuffled order per round, so
    slow drifts of the machine hit all models alike."""
    ds = dataset()
    iterators = {}
    for name, model in models.items():  # warm-up: trace, compile, allocate
        model.fit(ds, steps_per_epoch=4, epochs=1, verbose=0)
        iterators[name] = iter(ds)
        time_per_batch(model, iterators[name], 4)
    samples = {name: [] for name in models}
    order = list(models)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            samples[name].append(time_per_batch(models[name], iterators[name], steps))
    return Timings(samples)


def table(title, rows):
    print(f"\n{title}")
    width = max(len(r[0]) for r in rows)
    for label, ratio, target in rows:
        verdict = "" if target is None else ("  ok" if ratio <= target else "  OVER TARGET")
        limit = "" if target is None else f"  (target <= {target:.2f})"
        print(f"  {label:<{width}}  {ratio:6.3f}x{limit}{verdict}")
    sys.stdout.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument(
        "--only",
        choices=["overhead", "accumulate", "precision", "measure"],
        help="run one section",
    )
    args = parser.parse_args(argv)
    steps, rounds = (6, 3) if args.quick else (args.steps, args.rounds)
    print(
        f"TF {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPUs; "
        f"MLP 784-1024-1024-10, batch {BATCH}, Adam; {steps} steps x {rounds} "
        "interleaved rounds, median per batch"
    )

    sections = [args.only] if args.only else ["overhead", "accumulate", "precision"]
    if "overhead" in sections:
        overhead(steps, rounds)
    if "accumulate" in sections:
        accumulation(steps, rounds)
    if "precision" in sections:
        precision(steps, rounds)
    if "precision" in sections or "measure" in sections:
        measured_precision()


def overhead(steps, rounds):
    rows = []
    for jit in (False, True):
        t = measure({"keras": make("keras", jit), "gradboost": make("gb", jit)}, steps, rounds)
        rows.append((f"jit_compile={jit}", t.ratio("gradboost", "keras"), 1.02))
    table("GradBoostModel (no kwargs) / keras.Model, step time", rows)


def accumulation(steps, rounds):
    rows = []
    for jit in (False, True):
        t = measure(
            {
                "plain": make("keras", jit),
                "keras_acc": make("keras", jit, {"gradient_accumulation_steps": 4}),
                "gb_acc": make("gb", jit, accumulate_steps=4),
            },
            steps,
            rounds,
        )
        rows.append((f"gradboost accumulate_steps=4 / Keras' own, jit={jit}", t.ratio("gb_acc", "keras_acc"), 1.00))
        rows.append((f"  (Keras' own / plain step, jit={jit})", t.ratio("keras_acc", "plain"), None))
        rows.append((f"  (gradboost / plain step, jit={jit})", t.ratio("gb_acc", "plain"), None))
    table("Accumulation, time per micro-batch", rows)


def precision(steps, rounds):
    rows = []
    for jit in (False, True):
        static = precision_lib.static_pick(jit)
        policies = ["mixed_bfloat16"] + (["mixed_float16"] if jit else [])
        if static not in policies + ["float32"]:  # mixed_float16 on a GPU without XLA
            policies.append(static)
        models = {"float32": make("gb", jit, precision="float32")}
        models.update({p: make("gb", jit, precision=p) for p in policies})
        t = measure(models, steps, rounds)
        for p in policies:
            rows.append((f"precision={p} / float32, jit={jit}", t.ratio(p, "float32"), None))
        # precision="auto" measures in fit (the section below); it starts
        # from this pick, its answer where it cannot measure.
        rows.append((f"  (the static rule picks {static}, jit={jit})",
                     t.ratio(static, "float32") if static in policies else 1.0, None))
    # mixed_float16 without XLA is hundreds of times slower on CPU: a few steps.
    slow = measure(
        {"float32": make("gb", False, precision="float32"), "f16": make("gb", False, precision="mixed_float16")},
        2,
        1,
    )
    rows.append(("precision=mixed_float16 / float32, jit=False (2 steps)", slow.ratio("f16", "float32"), None))
    table("Precision, step time relative to float32 (backs the static rule)", rows)



CNN_BATCH = 32
CNN_SHAPE = (64, 64, 3)


def _resnet50():
    keras.utils.set_random_seed(0)
    from keras_gradboost import boost

    return boost(keras.applications.ResNet50(weights=None, input_shape=CNN_SHAPE, classes=10))


def _measure_once(model, data, batch):
    """One fit of exactly the measured calls of `precision="auto"`;
    returns the `PrecisionMeasurement` and the static rule's pick."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss="sparse_categorical_crossentropy",
            precision="auto",
        )
    static = model.train_plan.policy  # the static rule's pick here
    calls = 2 * (precision_measure.WARMUP_CALLS + precision_measure.TIMED_CALLS)
    ds = tf.data.Dataset.from_tensor_slices(data).batch(batch).repeat().prefetch(2)
    model.fit(ds, steps_per_epoch=calls, epochs=1, shuffle=False, verbose=0)
    return model.precision_measurement, static


def measured_precision():
    """`precision="auto"` on the MLP and two CNNs: both medians (per train
    call, `TIMED_CALLS` timed calls of each candidate, interleaved) and the
    choice, beside the static rule's pick."""
    cases = [
        (f"MLP 784-1024-1024-10, batch {BATCH}", lambda: zoo.mlp(), zoo.classification_data(BATCH * 8), BATCH),
        (
            "zoo.cnn 32x32x3 (16, 32 filters), batch 128",
            lambda: zoo.cnn(),
            zoo.image_data(128 * 4),
            128,
        ),
        (
            f"ResNet50 {CNN_SHAPE[0]}x{CNN_SHAPE[1]}x3, batch {CNN_BATCH}",
            _resnet50,
            zoo.image_data(CNN_BATCH * 4, shape=CNN_SHAPE),
            CNN_BATCH,
        ),
    ]
    print('\nprecision="auto" measured (jit off), median ms per train call, interleaved')
    for label, make_model, data, batch in cases:
        m, static = _measure_once(make_model(), data, batch)
        speed = m.float32_ms / m.mixed_ms
        print(
            f"  {label}: float32 {m.float32_ms:.1f} ms, {m.mixed_policy} "
            f"{m.mixed_ms:.1f} ms ({speed:.2f}x float32's speed) -> {m.policy}; "
            f"the static rule: {static}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
