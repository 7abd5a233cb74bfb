"""kgb.ops against their naive composites, and gradcheck's fast mode against
its full Jacobian.

Ops: forward + backward of each op and of its naive composite on a large
float32 tensor (`--size`, default 1024 x 1024), each a `tf.function` traced
and warmed up once. A pair times the naive composite and the stable op back
to back (`--calls` calls each, one host sync), in alternating order; a ratio
is the median over `--pairs` pairs of stable / naive, with a bootstrap 95%
confidence interval. The A/A row pairs the naive log1pexp with itself: how
close to 1.000 the method gets. Target: ratio <= 1.0.

gradcheck: `mode="fast"` against `mode="full"` on a 10^4-element input
(`log1pexp` reduced to 100 outputs), each run `--gradcheck-rounds` times in
alternating order; the ratio is the median of full / fast.

    python benchmarks/bench_ops.py [--size 1024] [--pairs 30] [--calls 5]
        [--gradcheck-rounds 3] [--jit] [--quick]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
import keras_gradboost as kgb  # noqa: E402
from fit_rounds import ratio  # noqa: E402
from keras_gradboost import ops  # noqa: E402


def naive_norm(x):
    return tf.sqrt(tf.reduce_sum(tf.square(x), axis=-1))


# name: (stable, naive, inputs maker)
def cases(size):
    shape = (size, size)
    x = tf.random.stateless_normal(shape, seed=[0, 1])
    positive = tf.random.stateless_uniform(shape, seed=[0, 2], minval=0.1, maxval=4.0)
    return {
        "log1pexp": (ops.log1pexp, lambda x: tf.math.log(1 + tf.exp(x)), (x,)),
        "safe_log": (ops.safe_log, tf.math.log, (positive,)),
        "safe_sqrt": (ops.safe_sqrt, tf.sqrt, (positive,)),
        "safe_norm": (ops.safe_norm, naive_norm, (x,)),
        "safe_divide": (ops.safe_divide, lambda a, b: a / b, (x, positive)),
        "logsumexp": (
            ops.logsumexp, lambda x: tf.math.log(tf.reduce_sum(tf.exp(x), -1)), (x,)),
    }


def forward_backward(fn, jit=False):
    """A tf.function: fn's value and the gradient of its sum, per input."""

    @tf.function(jit_compile=jit)
    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = tf.reduce_sum(fn(*xs))
        return y, tape.gradient(y, xs)

    return step


def timed(step, inputs, calls):
    start = time.perf_counter()
    for _ in range(calls):
        out = step(*inputs)
    float(out[0])  # one host sync
    return (time.perf_counter() - start) / calls


def paired(naive, stable, inputs, pairs, calls):
    """(naive seconds, stable seconds) per pair, alternating the order."""
    for step in (naive, stable):
        timed(step, inputs, 2)  # trace and warm up
    times = []
    for p in range(pairs):
        if p % 2:
            b = timed(stable, inputs, calls)
            a = timed(naive, inputs, calls)
        else:
            a = timed(naive, inputs, calls)
            b = timed(stable, inputs, calls)
        times.append((a, b))
    return times


def gradcheck_ratio(rounds):
    x = tf.random.stateless_normal((100, 100), seed=[3, 4])

    def fn(x):
        return tf.reduce_sum(ops.log1pexp(x), axis=1)  # 10^4 inputs, 100 outputs

    def run(mode):
        start = time.perf_counter()
        result = kgb.gradcheck(fn, x, mode=mode, forward=False, jit=False)
        assert result.ok, result
        return time.perf_counter() - start

    run("fast"), run("full")  # warm up
    times = []
    for r in range(rounds):
        if r % 2:
            full, fast = run("full"), run("fast")
        else:
            fast, full = run("fast"), run("full")
        times.append((fast, full))
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--gradcheck-rounds", type=int, default=3)
    parser.add_argument("--jit", action="store_true", help="jit_compile=True on both sides")
    parser.add_argument("--quick", action="store_true", help="small tensors, few pairs")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.pairs, args.calls, args.gradcheck_rounds = 128, 4, 2, 1
    print(
        f"TF {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPUs; "
        f"float32 {args.size}x{args.size}, forward + backward in tf.function"
        f"{'(jit_compile=True)' if args.jit else ''}, "
        f"{args.pairs} alternating pairs of {args.calls} calls"
    )
    rows = []
    all_cases = cases(args.size)
    naive_log1pexp = forward_backward(all_cases["log1pexp"][1], args.jit)
    rows.append(("A/A: naive log1pexp / itself", paired(
        naive_log1pexp, forward_backward(all_cases["log1pexp"][1], args.jit),
        all_cases["log1pexp"][2], args.pairs, args.calls)))
    for name, (stable, naive, inputs) in all_cases.items():
        times = paired(forward_backward(naive, args.jit), forward_backward(stable, args.jit), inputs,
                       args.pairs, args.calls)
        rows.append((f"{name} / naive", times))
    for label, times in rows:
        value, (low, high) = ratio(times)
        a_ms = 1000 * sorted(t[0] for t in times)[len(times) // 2]
        b_ms = 1000 * sorted(t[1] for t in times)[len(times) // 2]
        verdict = "" if label.startswith("A/A") else (
            "  ok" if value <= 1.0 else "  OVER TARGET (<= 1.00)")
        print(f"  {label:<30} {value:6.3f}x [95% CI {low:.3f}-{high:.3f}; "
              f"{a_ms:.2f} vs {b_ms:.2f} ms]{verdict}")
    if args.gradcheck_rounds < 1:
        return
    times = gradcheck_ratio(args.gradcheck_rounds)
    value, (low, high) = ratio(times)
    fast = 1000 * sorted(t[0] for t in times)[len(times) // 2]
    full = 1000 * sorted(t[1] for t in times)[len(times) // 2]
    print(f"  gradcheck full / fast, 10^4 inputs: {value:.1f}x [95% CI {low:.1f}-{high:.1f}; "
          f"full {full:.0f} ms, fast {fast:.0f} ms; {len(times)} rounds]")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
