"""StepTimeMonitor + RetraceCounter + GradientAuditor overhead: step time with
all three callbacks vs none, on keras.Model and on GradBoostModel.

MLP 784-1024-1024-10, batch 256, Adam, CPU, `model.fit` (so callback costs
count). Each model instance is timed without and with the callbacks in
fits run back to back (a pair), once per round, after a warm-up; a ratio is
the median over all pairs (several instances, many rounds) of the time with
over the time without, with a bootstrap 95% confidence interval. One
callback set per model, as in one long fit: its functions are traced once,
in the warm-up. The monitor's split probe is off in the timed runs; its
one-off cost is measured on its own afterwards.
The auditor checks gradient norms every 16 steps here (its default is 100),
so every timed fit includes its runtime checks (their count is printed).
The same comparison runs with `steps_per_execution=4` too.

    python benchmarks/bench_callbacks.py [--steps 16] [--rounds 20] [--instances 2]
"""

import argparse
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
from keras_gradboost.callbacks import GradientAuditor  # noqa: E402
from keras_gradboost.callbacks import RetraceCounter  # noqa: E402
from keras_gradboost.callbacks import StepTimeMonitor  # noqa: E402


AUDIT_EVERY = 16


def three(split_at=None):
    return [
        StepTimeMonitor(split_at=split_at),
        RetraceCounter(),
        GradientAuditor(every_n_steps=AUDIT_EVERY, verbose=0),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--instances", type=int, default=2)
    args = parser.parse_args(argv)
    ds = dataset()

    pairs = {}  # name: [((model, []), (model, callbacks)), one per instance]
    for kind in ("keras", "gradboost"):
        for spe in (1, 4):
            name = kind if spe == 1 else f"{kind}/spe4"
            pairs[name] = []
            for _ in range(args.instances):
                model = make(kind, spe)
                pairs[name].append(((model, []), (model, three())))

    times = paired(pairs, ds, args.steps, args.rounds)

    # The split probe, once per kind, on a warmed-up model.
    probes = {}
    for kind in ("keras", "gradboost"):
        model = pairs[kind][0][0][0]
        monitor = StepTimeMonitor(window=10, split_at=10)
        model.fit(ds, steps_per_epoch=24, epochs=1, verbose=0, callbacks=[monitor])
        probes[kind] = monitor.report()

    print(
        f"TF {tf.__version__}, Keras {keras.__version__}; MLP 784-1024-1024-10, "
        f"batch {BATCH}, Adam, fit; {args.steps} steps per fit, "
        f"{args.rounds} rounds x {args.instances} model instances per row"
    )
    print("  +3 = StepTimeMonitor + RetraceCounter + GradientAuditor; target <= 1.03")
    for kind, label in (("keras", "keras.Model"), ("gradboost", "GradBoostModel")):
        for suffix, mode in (("", ""), ("/spe4", ", spe=4")):
            name = kind + suffix
            value, (low, high) = ratio(times[name])
            a_ms, b_ms = step_ms(times[name])
            verdict = "ok" if value <= 1.03 else "OVER TARGET"
            text = f"{label}{mode} +3 / {label}{mode}"
            print(
                f"  {text:<50} {value:6.3f}x [95% CI {low:.3f}-{high:.3f}; "
                f"{a_ms:.1f} vs {b_ms:.1f} ms/step; {len(times[name])} pairs] {verdict}"
            )
    checks = {
        name: instances[0][1][1][2].report().checks for name, instances in pairs.items()
    }
    print(
        f"  auditor runtime checks (every {AUDIT_EVERY} steps) in the last timed fit: "
        + ", ".join(f"{k} {v}" for k, v in checks.items())
    )
    print("  split probe (one-off, outside the step windows):")
    for kind, report in probes.items():
        split = report.split
        print(
            f"    {kind:<10} probe {1000 * report.probe_seconds:7.0f} ms "
            f"(of which compile {split.compile_ms:6.0f} ms) = "
            f"{1000 * report.probe_seconds / report.median_step_ms:5.1f} steady steps; "
            f"step {split.step_ms:.1f} ms: forward {split.forward_ms:.1f}, "
            f"backward {split.backward_ms:.1f} ({100 * split.backward_share:.0f}%), "
            f"optimizer {split.optimizer_ms:.1f}, input+overhead {split.input_ms:.1f}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
