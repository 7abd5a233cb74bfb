"""StepTimeMonitor + RetraceCounter + GradientAuditor overhead: step time with
all three callbacks vs none, on keras.Model and on GradBoostModel.

MLP 784-1024-1024-10, batch 256, Adam, CPU, `model.fit` (so callback costs
count). Every configuration is warmed up, then timed in interleaved rounds
(every configuration once per round, in a shuffled order) in this one
process; a ratio A/B is the median over rounds of A's time over B's time in
the same round. Each model runs with and without the callbacks (one
callback set, as in one long fit); its functions are traced once, in the
warm-up. The monitor's split probe is
off in the timed runs; its one-off cost is measured on its own afterwards.
The auditor checks gradient norms every 16 steps here (its default is 100),
so every timed fit includes its runtime checks (their count is printed).
The same comparison runs with `steps_per_execution=4` too.

    python benchmarks/bench_callbacks.py [--steps 32] [--rounds 11]
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
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args(argv)
    ds = dataset()

    configs = {}  # name: (model, callbacks)
    for kind in ("keras", "gradboost"):
        for spe in (1, 4):
            name = kind if spe == 1 else f"{kind}/spe4"
            # One model with and without the callbacks: on this machine a
            # model instance can settle in a slower mode for its lifetime
            # (steps of 39.6 ms instead of 26 ms, callbacks or not), which
            # two instances would turn into a ratio of 1.4 either way.
            model = make(kind, spe)
            configs[name] = (model, [])
            configs[f"{name}+3"] = (model, three())

    samples = interleaved(configs, ds, args.steps, args.rounds)

    def ratio(a, b):
        return median_ratio(samples, a, b)

    # The split probe, once per kind, on a warmed-up model.
    probes = {}
    for kind in ("keras", "gradboost"):
        model = configs[kind][0]
        monitor = StepTimeMonitor(window=10, split_at=10)
        model.fit(ds, steps_per_epoch=24, epochs=1, verbose=0, callbacks=[monitor])
        probes[kind] = monitor.report()

    print(
        f"TF {tf.__version__}, Keras {keras.__version__}; MLP 784-1024-1024-10, "
        f"batch {BATCH}, Adam, fit; {args.steps} steps x {args.rounds} rounds"
    )
    print(f"  {'comparison (+3 = StepTimeMonitor + RetraceCounter + GradientAuditor)':<72} {'ratio':>7}   target")
    for kind, label in (("keras", "keras.Model"), ("gradboost", "GradBoostModel")):
        for suffix, mode in (("", ""), ("/spe4", ", spe=4")):
            name = kind + suffix
            value = ratio(f"{name}+3", name)
            verdict = "ok" if value <= 1.03 else "OVER TARGET"
            text = f"{label}{mode} +3 / {label}{mode}"
            print(f"  {text:<72} {value:6.3f}x   <= 1.03 {verdict}")
    checks = {
        name: callbacks[2].report().checks
        for name, (_, callbacks) in configs.items()
        if callbacks
    }
    print(
        f"  auditor runtime checks (every {AUDIT_EVERY} steps) in the last timed fit: "
        + ", ".join(f"{k} {v}" for k, v in checks.items())
    )
    step_ms = {k: 1000 * statistics.median(v) for k, v in samples.items()}
    print("  median step (ms, fit time / steps): " + ", ".join(f"{k} {v:.1f}" for k, v in step_ms.items()))
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
