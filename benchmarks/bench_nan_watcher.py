"""NaNWatcher overhead: step time with vs without the callback.

MLP 784-1024-1024-10, batch 256, Adam, CPU, `model.fit` (so callback costs
count). Each model instance is timed without and with the watcher in fits
run back to back (a pair), once per round, after a warm-up; a ratio is the
median over all pairs (several instances, many rounds) of the time with over
the time without, with a bootstrap 95% confidence interval. The same pairs
with no watcher on either side (A/A) show how close to 1.000 the method
gets. The anchor is Keras' own guarantee: the same MLP with its Adam in
`keras.optimizers.LossScaleOptimizer(initial_scale=1, no growth)`, whose
finiteness guard alone acts; the target is NaNWatcher <= that guard,
measured in the same run (the "/ Keras LSO guard" rows, on both model
classes). `tf.debugging.enable_check_numerics()` is printed for comparison (its
model is traced while it is on; its checks stay in that model's graph only).

    python benchmarks/bench_nan_watcher.py [--steps 16] [--rounds 40] [--instances 3]
        [--inter-op-threads N]

Where the overhead comes from, on a CPU: the watcher's update waits until
every gradient is checked, while Keras without it starts updating the last
layers while the first layer's backward pass still runs (TensorFlow runs
independent ops side by side, `inter_op_parallelism_threads`). With
`--inter-op-threads 1` nothing runs side by side, so the ratio shows the
watcher's own ops alone.
"""

import argparse
import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
from fit_rounds import BATCH  # noqa: E402
from fit_rounds import dataset  # noqa: E402
from fit_rounds import make  # noqa: E402
from fit_rounds import paired  # noqa: E402
from fit_rounds import ratio  # noqa: E402
from fit_rounds import step_ms  # noqa: E402
from fit_rounds import time_fit  # noqa: E402
from keras_gradboost import step as step_lib  # noqa: E402
from keras_gradboost.callbacks import NaNWatcher  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument(
        "--inter-op-threads", type=int, default=None,
        help="tf.config.threading.set_inter_op_parallelism_threads (default: TF's)",
    )
    args = parser.parse_args(argv)
    if args.inter_op_threads is not None:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    ds = dataset()

    # name: [((model, callbacks), (model, callbacks)), one per instance]. One
    # watcher per model, as in one long fit: its guarded train function is
    # traced once (in the warm-up), not once per round. The anchor: the same
    # MLP whose Adam is in Keras' LossScaleOptimizer (scale 1, no growth),
    # whose finiteness guard gives Keras' own "no non-finite update".
    pairs = {name: [] for name in (
        "keras A/A", "keras", "keras anchor", "keras vs anchor",
        "gradboost", "gradboost anchor", "gradboost vs anchor",
        "keras in turn", "gradboost in turn")}
    for _ in range(args.instances):
        for kind in ("keras", "gradboost"):
            model, guarded = make(kind), make(kind, keras_guard=True)
            watcher = [NaNWatcher(verbose=0)]
            pairs[kind].append(((model, []), (model, watcher)))
            pairs[f"{kind} anchor"].append(((model, []), (guarded, [])))
            pairs[f"{kind} vs anchor"].append(((guarded, []), (model, watcher)))
            pairs[f"{kind} in turn"].append((_all_at_once(kind, ds), (model, watcher)))
            if kind == "keras":
                pairs["keras A/A"].append(((model, []), (model, [])))
    tf.debugging.enable_check_numerics()
    checked = make("keras")
    time_fit(checked, ds, 2, [])  # traced with the checks in
    tf.debugging.disable_check_numerics()
    pairs["enable_check_numerics"] = [((pairs["keras"][0][0][0], []), (checked, []))]

    times = paired(pairs, ds, args.steps, args.rounds)

    print(
        f"TF {tf.__version__}, Keras {keras.__version__}; MLP 784-1024-1024-10, "
        f"batch {BATCH}, Adam, fit; {args.steps} steps per fit, "
        f"{args.rounds} rounds x {args.instances} model instances of each kind; "
        f"inter-op threads {tf.config.threading.get_inter_op_parallelism_threads() or 'TF default'}"
    )
    # The target: NaNWatcher costs no more than Keras' own guard, measured
    # here in the same run (the direct "vs anchor" rows, <= 1.00).
    rows = [
        ("GradBoostModel + NaNWatcher / GradBoostModel", "gradboost", None),
        ("GradBoostModel, Keras LSO guard / GradBoostModel", "gradboost anchor", None),
        ("GradBoostModel + NaNWatcher / Keras LSO guard", "gradboost vs anchor", 1.0),
        ("keras.Model + NaNWatcher / keras.Model", "keras", None),
        ("keras.Model, Keras LSO guard / keras.Model", "keras anchor", None),
        ("keras.Model + NaNWatcher / Keras LSO guard", "keras vs anchor", 1.0),
        ("GradBoostModel + NaNWatcher: updates in turn / at once", "gradboost in turn", None),
        ("keras.Model + NaNWatcher: updates in turn / at once", "keras in turn", None),
        ("keras.Model / keras.Model (A/A: the method's floor)", "keras A/A", None),
        ("keras.Model + enable_check_numerics / keras.Model", "enable_check_numerics", None),
    ]
    for label, name, target in rows:
        value, (low, high) = ratio(times[name])
        a_ms, b_ms = step_ms(times[name])
        verdict = ""
        if target is not None:
            verdict = f"  target <= {target:.2f}: " + ("ok" if value <= target else "OVER TARGET")
        print(
            f"  {label:<52} {value:6.3f}x [95% CI {low:.3f}-{high:.3f}; "
            f"{a_ms:.1f} vs {b_ms:.1f} ms/step; {len(times[name])} pairs]{verdict}"
        )
    sys.stdout.flush()


def _all_at_once(kind, ds):
    """`(model, callbacks)`: a watched model whose checked update was traced
    with every variable's update started at once, as before
    `step.updates_in_turn` (the "in turn" rows: same step time?)."""
    model, watcher = make(kind), [NaNWatcher(verbose=0)]
    in_turn = step_lib.updates_in_turn
    step_lib.updates_in_turn = lambda optimizer: contextlib.nullcontext()
    try:
        time_fit(model, ds, 2, watcher)  # traced now, as in one long fit
    finally:
        step_lib.updates_in_turn = in_turn
    return model, watcher


if __name__ == "__main__":
    main()
