"""NaNWatcher overhead: step time with vs without the callback.

MLP 784-1024-1024-10, batch 256, Adam, CPU, `model.fit` (so callback costs
count). Every configuration is warmed up, then timed in interleaved rounds
(every configuration once per round, in a shuffled order) in this one
process; a ratio A/B is the median over rounds of A's time over B's time in
the same round. `tf.debugging.enable_check_numerics()` is printed for
comparison (its model is traced while it is on; its checks stay in that
model's graph only).

    python benchmarks/bench_nan_watcher.py [--steps 32] [--rounds 11]
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
from fit_rounds import BATCH  # noqa: E402
from fit_rounds import dataset  # noqa: E402
from fit_rounds import interleaved  # noqa: E402
from fit_rounds import make  # noqa: E402
from fit_rounds import ratio as median_ratio  # noqa: E402
from fit_rounds import ratios  # noqa: E402
from fit_rounds import time_fit  # noqa: E402
from keras_gradboost.callbacks import NaNWatcher  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args(argv)
    ds = dataset()

    # name: (model, callbacks)
    configs = {}
    for kind in ("keras", "gradboost"):
        # One model with and without the watcher (a model instance can
        # settle in a slower mode for its lifetime on this machine: steps
        # of 39.6 ms instead of 26 ms, whatever runs), and one watcher, as in
        # one long fit: its guarded train function is traced once (in the
        # warm-up), not once per round.
        model = make(kind)
        configs[f"{kind}"] = (model, [])
        configs[f"{kind}+watcher"] = (model, [NaNWatcher(verbose=0)])
    tf.debugging.enable_check_numerics()
    checked = make("keras")
    time_fit(checked, ds, 2, [])  # traced with the checks in
    tf.debugging.disable_check_numerics()
    configs["keras+enable_check_numerics"] = (checked, [])

    samples = interleaved(configs, ds, args.steps, args.rounds)

    def ratio(a, b):
        return median_ratio(samples, a, b)

    def spread(a, b):
        q1, _, q3 = statistics.quantiles(ratios(samples, a, b), n=4)
        return f"[IQR {q1:.3f}-{q3:.3f}]"

    print(
        f"TF {tf.__version__}, Keras {keras.__version__}; MLP 784-1024-1024-10, "
        f"batch {BATCH}, Adam, fit; {args.steps} steps x {args.rounds} rounds"
    )
    pairs = [
        ("GradBoostModel + NaNWatcher / GradBoostModel", "gradboost+watcher", "gradboost", 1.02),
        ("keras.Model + NaNWatcher / keras.Model", "keras+watcher", "keras", 1.03),
        ("keras.Model + enable_check_numerics / keras.Model", "keras+enable_check_numerics", "keras", None),
    ]
    for label, a, b, target in pairs:
        value = ratio(a, b)
        verdict = "" if target is None else (f"  (target <= {target:.2f}) " + ("ok" if value <= target else "OVER TARGET"))
        print(f"  {label:<52} {value:6.3f}x {spread(a, b)}{verdict}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
