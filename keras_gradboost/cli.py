"""Command line: `keras-gradboost compare` (also `python -m keras_gradboost`).

For now `compare` trains the built-in MLP on synthetic data under a few
GradBoostModel configurations and prints, per configuration, what each feature
did: updates applied, dtype policy chosen, loss scale, final loss and steady
step time. (The side-by-side table with per-configuration subprocesses comes
with the "compare" issue.)
"""

import argparse
import os
import sys
import time

CONFIGS = {
    "baseline": {},
    "accumulate": {"accumulate_steps": 4},
    "precision_auto": {"precision": "auto"},
    "loss_scale": {"loss_scale": "dynamic"},
}


def _parser():
    parser = argparse.ArgumentParser(
        prog="keras-gradboost",
        description="Faster, lighter, debuggable Keras training.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser(
        "compare",
        help="train a built-in model under each configuration and report",
    )
    compare.add_argument("--batch-size", type=int, default=64)
    compare.add_argument("--steps", type=int, default=24)
    compare.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, from: {', '.join(CONFIGS)}",
    )
    return parser


def _positive(parser, name, value):
    if value < 1:
        parser.error(f"argument --{name}: expected an int >= 1, got {value}")


def run_config(name, kwargs, batch_size, steps):
    import keras

    from keras_gradboost import zoo

    x, y = zoo.classification_data(batch_size * steps, input_dim=784)
    model = zoo.mlp(hidden=(256, 256))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        **kwargs,
    )
    times = []

    class _Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.t)

    history = model.fit(
        x, y, batch_size=batch_size, epochs=1, verbose=0, callbacks=[_Clock()]
    )
    steady = sorted(times[2:] or times)[len(times[2:] or times) // 2]
    facts = model.step_facts.read()
    return {
        "config": name,
        "kwargs": kwargs,
        "policy": model.dtype_policy_applied or model.dtype_policy.name,
        "updates": int(model.optimizer.iterations.numpy()),
        "micro_batches": len(times),
        "loss_scale": history.history.get("loss_scale", [None])[-1],
        "skipped": facts["skipped_steps"],
        "final_loss": history.history["loss"][-1],
        "step_ms": steady * 1000,
    }


def compare(args, parser):
    _positive(parser, "batch-size", args.batch_size)
    _positive(parser, "steps", args.steps)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        parser.error(
            f"argument --configs: unknown configuration(s) {unknown or names}; "
            f"choose from {', '.join(CONFIGS)}"
        )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rows = []
    for name in names:
        print(f"[{len(rows) + 1}/{len(names)}] {name} {CONFIGS[name]}", flush=True)
        rows.append(run_config(name, CONFIGS[name], args.batch_size, args.steps))
    header = (
        f"{'config':<16}{'policy':<16}{'micro-batches':>14}{'updates':>9}"
        f"{'loss scale':>12}{'skipped':>9}{'final loss':>12}{'step ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        scale = "-" if r["loss_scale"] is None else f"{r['loss_scale']:g}"
        print(
            f"{r['config']:<16}{r['policy']:<16}{r['micro_batches']:>14}"
            f"{r['updates']:>9}{scale:>12}{r['skipped']:>9}"
            f"{r['final_loss']:>12.4f}{r['step_ms']:>9.2f}"
        )
    return rows


# The rows of the last `compare` run, for tests and notebooks.
LAST_ROWS = []


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "compare":
        LAST_ROWS[:] = compare(args, parser)
    return 0


if __name__ == "__main__":
    sys.exit(main())
