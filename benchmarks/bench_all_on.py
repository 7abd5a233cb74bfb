"""All-on benchmark: why `compare`'s `all_on` row uses the "auto" choices.

Model: the `compare` default, `zoo.mlp()` (784-1024-1024-10), batch 256,
Adam, CPU. Every configuration is compiled once, warmed up, then timed in
interleaved rounds (each round times every configuration once, in a shuffled
order) in this one process; each timing runs `--steps` batches through the
model's compiled train function with one host sync. A ratio is the median
over rounds of the configuration's time over the baseline's in that round.

Configurations:
- `xla_recompute`: jit_compile=True, the precision `precision="auto"` starts
  from (its static rule: float32 under XLA on a CPU), accumulate_steps=4,
  recompute="auto".
- `xla`: the same without recompute.
- `auto`: `compare`'s `all_on`: jit_compile="auto" (no XLA on a CPU), the
  static rule's precision (mixed_bfloat16 on a CPU with bfloat16 instructions),
  accumulate_steps=4, recompute={"budget_mb": 8000} (nothing to recompute).

Measured (2-core CPU with AMX/avx512_bf16, shared with other jobs; TF 2.21,
Keras 3.15; 8 steps per timing): xla_recompute 0.98x, xla 0.86x, auto 0.51x
the baseline step (22.7 ms) in 9 rounds; 0.98x, 0.92x, 0.60x (24.8 ms) in a
second run of 5 rounds.

    python benchmarks/bench_all_on.py [--steps 8] [--rounds 9]
"""

import argparse
import os
import random
import statistics
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from keras_gradboost import zoo  # noqa: E402
from keras_gradboost.precision import gpu_available  # noqa: E402
from keras_gradboost.precision import static_pick  # noqa: E402

BATCH = 256
CONFIGS = {
    "baseline": dict(jit_compile=False),
    "xla_recompute": dict(
        jit_compile=True, precision=static_pick(True), accumulate_steps=4, recompute="auto"
    ),
    "xla": dict(jit_compile=True, precision=static_pick(True), accumulate_steps=4),
    "auto": dict(
        jit_compile="auto",
        precision=static_pick(gpu_available()),  # Keras' "auto": XLA on a GPU
        accumulate_steps=4,
        recompute={"budget_mb": 8000},
    ),
}


def make(kwargs):
    model = zoo.mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", **kwargs)
    x, y = zoo.classification_data(BATCH * 4)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    iterator = iter(data.repeat())
    model.make_train_function()
    for _ in range(3):
        model.train_function(iterator)
    return model, iterator


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    models = {name: make(kwargs) for name, kwargs in CONFIGS.items()}
    times = {name: [] for name in models}
    for _ in range(args.rounds):
        order = list(models)
        random.shuffle(order)
        for name in order:
            model, iterator = models[name]
            start = time.perf_counter()
            for _ in range(args.steps):
                logs = model.train_function(iterator)
            float(logs["loss"])
            times[name].append((time.perf_counter() - start) / args.steps)
    base = times["baseline"]
    print(f"{'config':<15}{'step ms':>9}{'vs baseline':>13}")
    for name, values in times.items():
        ratio = statistics.median(a / b for a, b in zip(values, base))
        print(f"{name:<15}{1000 * statistics.median(values):>9.2f}{ratio:>12.2f}x")


if __name__ == "__main__":
    main()
