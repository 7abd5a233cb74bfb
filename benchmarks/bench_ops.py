"""kgb.ops against their naive composites, and gradcheck's fast mode against
its full Jacobian.

Ops: forward + backward of each op and of its naive composite on a large
float32 tensor (`--size`, default 1024 x 1024), each a `tf.function` traced
and warmed up once. A pair times the naive composite and the stable op back
to back (`--calls` calls each, one host sync), with a second copy of the naive
composite (its own `tf.function`), each round in a rotated order; a ratio is
the median over `--pairs` rounds of stable / naive, with a bootstrap 95%
confidence interval. Each row's A/A column is the copy / naive ratio of the
same rounds: how close to 1.000 the method gets for that op (two traced
copies of one function differ by up to ~6% on some CPUs). Target: ratio
<= 1.0.

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


def rounds(steps, inputs, count, calls):
    """Seconds per call of each step, per round; each round starts at the
    next step in turn, so every step takes every position equally often."""
    for step in steps:
        timed(step, inputs, 2)  # trace and warm up
    times = []
    for r in range(count):
        order = [(r + i) % len(steps) for i in range(len(steps))]
        seconds = {i: timed(steps[i], inputs, calls) for i in order}
        times.append(tuple(seconds[i] for i in range(len(steps))))
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
        f"{args.pairs} rotated rounds of {args.calls} calls"
    )
    for name, (stable, naive, inputs) in cases(args.size).items():
        steps = [forward_backward(f, args.jit) for f in (naive, naive, stable)]
        times = rounds(steps, inputs, args.pairs, args.calls)
        value, (low, high) = ratio([(t[0], t[2]) for t in times])
        aa, (aa_low, aa_high) = ratio([(t[0], t[1]) for t in times])
        naive_ms = 1000 * sorted(t[0] for t in times)[len(times) // 2]
        stable_ms = 1000 * sorted(t[2] for t in times)[len(times) // 2]
        verdict = "  ok" if value <= 1.0 else "  OVER TARGET (<= 1.00)"
        print(f"  {name + ' / naive':<22} {value:6.3f}x [95% CI {low:.3f}-{high:.3f}; "
              f"{naive_ms:.2f} vs {stable_ms:.2f} ms]  A/A {aa:.3f}x "
              f"[{aa_low:.3f}-{aa_high:.3f}]{verdict}")
        sys.stdout.flush()
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
