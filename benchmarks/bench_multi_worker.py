"""Multi-worker benchmark: what accumulate_steps=4 saves under
MultiWorkerMirroredStrategy, two workers on 127.0.0.1, and under
MirroredStrategy over two logical CPU devices of one process.

`keras_gradboost.launch` starts two worker processes (benchmarks/mw_worker.py,
one CPU thread each) that fit GradBoostModel's MLP 784-1024-1024-10 (1.86M
parameters, Adam) on the same global batches (`--batch`, sharded by data),
with accumulate_steps 1 and 4. It measures:

1. the all-reduces of gradients in `--count-steps` micro-batches (100 by
   default; expected 100 and 25), counted in the graph by patching
   `tf.distribute.ReplicaContext.all_reduce` as tests/workers/exact_fit.py
   does, in the first fit of each configuration (untimed: it traces);
2. the bytes those all-reduces carry: the gradient tensors' sizes times
   their dtype's, per update and per `--count-steps` micro-batches;
3. the time per micro-batch of k=4 against k=1: fits of `--steps`
   micro-batches, timed back to back in pairs whose order alternates
   (`fit_rounds.paired`: A B, then B A), `--pairs` of them after an untimed
   warm-up fit of each model, tf.data autotuning off. A ratio is the median
   of k=4 / k=1 over the pairs with a bootstrap 95% confidence interval;
   the A/A row pairs two k=1 models, the noise of the method. The time of
   an update is all of it: the all-reduce and the optimizer's step.

Times are worker 0's (the collectives keep both workers in step). The
default run takes about 2.5 minutes on 2 idle cores (3.5 beside a test
run), `--quick` under one.

    python benchmarks/bench_multi_worker.py [--pairs 20] [--steps 16]
        [--count-steps 100] [--batch 256] [--quick]
        [--strategy both|multi_worker|mirrored]
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
import keras_gradboost  # noqa: E402
from fit_rounds import ratio  # noqa: E402
from fit_rounds import step_ms  # noqa: E402
from keras_gradboost import launch  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "mw_worker.py"
WORKERS = 2
K = 4  # the accumulate_steps compared with 1


def _env():
    """The workers import this checkout's package, quietly, on the CPU, one
    thread each: two workers on two cores (as tests/test_multi_worker.py)."""
    env = dict(os.environ)
    root = str(pathlib.Path(keras_gradboost.__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["TF_NUM_INTRAOP_THREADS"] = "1"
    env["TF_NUM_INTEROP_THREADS"] = "1"
    return env


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20, help="timed pairs per row")
    parser.add_argument("--steps", type=int, default=16, help="micro-batches per timed fit")
    parser.add_argument("--count-steps", type=int, default=100,
                        help="micro-batches of the counted fit")
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the job")
    parser.add_argument("--quick", action="store_true", help="a tiny run, to check the set-up")
    parser.add_argument("--strategy", choices=("both", "multi_worker", "mirrored"),
                        default="both",
                        help="2 workers, 2 logical devices in one process, or both")
    return parser


def _check(parser, args):
    # Whole windows of k=4 in every fit: each fit ends on an update.
    for name in ("steps", "count_steps"):
        value = getattr(args, name)
        if value < K or value % K:
            parser.error(
                f"Invalid value for argument `--{name.replace('_', '-')}`. Received: "
                f"--{name.replace('_', '-')}={value}. Expected a positive multiple of "
                f"{K} (whole windows of accumulate_steps={K})."
            )
    if args.pairs < 2:
        parser.error(f"Invalid value for argument `--pairs`. Received: --pairs={args.pairs}. "
                     "Expected an int >= 2 (one of each order).")
    if args.batch < WORKERS or args.batch % WORKERS:
        parser.error(f"Invalid value for argument `--batch`. Received: --batch={args.batch}. "
                     f"Expected a multiple of the {WORKERS} workers.")


def run_job(settings, timeout):
    """Runs the two workers, their output on standard error (the table alone
    goes to standard output); returns their results, or exits when one
    fails."""
    with tempfile.TemporaryDirectory() as tmp:
        codes = launch(WORKER, [tmp, json.dumps(settings)], workers=WORKERS,
                       timeout=timeout, env=_env(), output=sys.stderr)
        if codes != [0] * WORKERS:
            sys.exit(f"the workers exited with {codes}")
        results = []
        for i in range(WORKERS):
            with open(os.path.join(tmp, f"worker{i}.json")) as f:
                results.append(json.load(f))
    return results


def run_mirrored(settings, timeout):
    """Runs mw_worker.py as one process with MirroredStrategy over two
    logical CPU devices (one intra-op thread, two inter-op: each replica's
    ops side by side, as the two one-thread workers); returns its result."""
    import subprocess

    env = dict(_env(), TF_NUM_INTEROP_THREADS="2")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, str(WORKER), tmp, json.dumps(dict(settings, strategy="mirrored"))],
            env=env, timeout=timeout, stdout=sys.stderr, stderr=sys.stderr,
        )
        if done.returncode:
            sys.exit(f"the MirroredStrategy process exited with {done.returncode}")
        with open(os.path.join(tmp, "worker0.json")) as f:
            return [json.load(f)]


def megabytes(n):
    return f"{n / 1e6:.2f} MB"


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.steps, args.count_steps = 2, 8, 20
    _check(parser, args)
    settings = {"batch": args.batch, "count_steps": args.count_steps,
                "steps": args.steps, "pairs": args.pairs}
    print(f"TF {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPUs; "
          f"MLP 784-1024-1024-10 (float32), global batch {args.batch}, Adam")
    if args.strategy in ("both", "multi_worker"):
        report(run_job(settings, args.timeout), args,
               f"MultiWorkerMirroredStrategy, {WORKERS} workers on 127.0.0.1, 1 thread each")
    if args.strategy in ("both", "mirrored"):
        report(run_mirrored(settings, args.timeout), args,
               "MirroredStrategy, 2 logical CPU devices in one process")


def report(results, args, title):
    """Prints one strategy's tables."""
    first = results[0]
    counts = first["counts"]
    if any(r["counts"] != counts for r in results[1:]):
        sys.exit(f"the workers counted differently: {[r['counts'] for r in results]}")
    n = args.count_steps
    print(f"\n== {title}: {first['replicas']} replicas, "
          f"{first['parameters']:,} parameters")
    k1, k4 = counts["k1"], counts["k4"]
    rows = [
        (f"gradient all-reduces per {n} micro-batches",
         str(k1["gradient_all_reduces"]), str(k4["gradient_all_reduces"]),
         k4["gradient_all_reduces"] / k1["gradient_all_reduces"]),
        (f"updates per {n} micro-batches", str(k1["updates"]), str(k4["updates"]),
         k4["updates"] / k1["updates"]),
        ("bytes all-reduced per update",
         megabytes(k1["gradient_bytes"] / k1["gradient_all_reduces"]),
         megabytes(k4["gradient_bytes"] / k4["gradient_all_reduces"]), None),
        (f"bytes all-reduced per {n} micro-batches", megabytes(k1["gradient_bytes"]),
         megabytes(k4["gradient_bytes"]), k4["gradient_bytes"] / k1["gradient_bytes"]),
    ]
    print("Communication (counted in the graph per replica, the same on every worker)")
    print(f"  {'':<40} {'k=1':>10} {f'k={K}':>10}  k={K} / k=1")
    for label, a, b, r in rows:
        print(f"  {label:<40} {a:>10} {b:>10}  {'' if r is None else f'{r:.3f}x'}".rstrip())
    print(f"Time per micro-batch, worker 0: median of {args.pairs} alternating pairs of "
          f"{args.steps}-micro-batch fits, bootstrap 95% CI")
    for label, key in ((f"k={K} / k=1", "k4"), ("A/A: k=1 / k=1", "aa")):
        times = first["times"][key]
        value, (low, high) = ratio(times)
        a_ms, b_ms = step_ms(times)
        print(f"  {label:<16} {value:6.3f}x [95% CI {low:.3f}-{high:.3f}; "
              f"{a_ms:.1f} vs {b_ms:.1f} ms]")
    sys.stdout.flush()

if __name__ == "__main__":
    main()
