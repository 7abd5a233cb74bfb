"""Sweeps kgb.gradcheck over a sample of TensorFlow's differentiable ops
with non-scalar parameters, and prints what it finds.

Each op runs at a point inside its domain and away from kinks, with every
check on (shape and dtype, float64 differences, None vs zero, forward vs
reverse mode, eager vs `jit_compile=True`) and default tolerances. An op
that cannot run in float64 is re-checked with `numeric_dtype=None`. Skipped
checks (XLA or forward mode unsupported) are listed, not counted as
failures.

    python benchmarks/sweep_gradcheck.py [--only NAME[,NAME]] [--second-order]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_gradboost as kgb  # noqa: E402

rng = np.random.default_rng(0)


def normal(*shape):
    return rng.normal(size=shape).astype("float32")


def uniform(low, high, *shape):
    return rng.uniform(low, high, size=shape).astype("float32")


def spd(n):
    a = normal(n, n)
    return (a @ a.T + n * np.eye(n)).astype("float32")


def distinct(*shape):
    """Values with no ties (for max, min, sort, top_k)."""
    return (rng.permutation(int(np.prod(shape))).reshape(shape) / 7.0 - 1.0).astype("float32")


M, V, P, C = normal(3, 4), normal(4), uniform(0.5, 2.0, 3, 4), uniform(-0.8, 0.8, 3, 4)
IMG = normal(1, 5, 5, 2)
LABELS = tf.constant([1, 0, 3])

# name: (fn, inputs)
OPS = {
    # elementwise
    "math.sin": (tf.math.sin, (M,)),
    "math.tan": (tf.math.tan, (C,)),
    "math.tanh": (tf.math.tanh, (M,)),
    "math.sigmoid": (tf.math.sigmoid, (M,)),
    "math.exp": (tf.math.exp, (M,)),
    "math.expm1": (tf.math.expm1, (M,)),
    "math.log": (tf.math.log, (P,)),
    "math.log1p": (tf.math.log1p, (P,)),
    "math.sqrt": (tf.math.sqrt, (P,)),
    "math.rsqrt": (tf.math.rsqrt, (P,)),
    "math.reciprocal": (tf.math.reciprocal, (P,)),
    "math.erf": (tf.math.erf, (M,)),
    "math.erfinv": (tf.math.erfinv, (C,)),
    "math.lgamma": (tf.math.lgamma, (P,)),
    "math.digamma": (tf.math.digamma, (P,)),
    "math.asin": (tf.math.asin, (C,)),
    "math.acosh": (tf.math.acosh, (P + 1.0,)),
    "math.atanh": (tf.math.atanh, (C,)),
    "math.softplus": (tf.math.softplus, (M,)),
    "math.bessel_i1e": (tf.math.bessel_i1e, (M,)),
    "math.log_sigmoid": (tf.math.log_sigmoid, (M,)),
    "nn.elu": (tf.nn.elu, (M,)),
    "nn.selu": (tf.nn.selu, (M,)),
    "nn.gelu": (tf.nn.gelu, (M,)),
    "nn.silu": (tf.nn.silu, (M,)),
    "nn.softsign": (tf.nn.softsign, (M,)),
    # broadcasting binary (a (3, 4) with a (4,) or (3, 1))
    "math.add": (tf.math.add, (M, V)),
    "math.multiply": (tf.math.multiply, (M, V)),
    "math.divide": (tf.math.divide, (M, P[:1])),
    "math.pow": (tf.math.pow, (P, V)),
    "math.maximum": (tf.math.maximum, (distinct(3, 4), distinct(4) + 0.03)),
    "math.squared_difference": (tf.math.squared_difference, (M, normal(3, 1))),
    "math.atan2": (tf.math.atan2, (M, P[:, :1])),
    "math.xlogy": (tf.math.xlogy, (M, P[0])),
    "math.xdivy": (tf.math.xdivy, (M, P[0])),
    "math.divide_no_nan": (tf.math.divide_no_nan, (M, P[:, :1])),
    "math.polyval": (lambda c0, c1, x: tf.math.polyval([c0, c1], x), (V, V + 1.0, M)),
    "math.igamma": (tf.math.igamma, (P, P[0] + 0.5)),
    "math.betainc": (lambda a, b, x: tf.math.betainc(a, b, x), (P, P + 0.5, uniform(0.2, 0.8, 3, 4))),
    "math.zeta": (tf.math.zeta, (P + 1.5, P[0] + 0.5)),
    # reductions and scans
    "reduce_prod": (lambda x: tf.reduce_prod(x, axis=0), (P,)),
    "reduce_max": (lambda x: tf.reduce_max(x, axis=1), (distinct(3, 4),)),
    "reduce_logsumexp": (lambda x: tf.reduce_logsumexp(x, axis=1), (M,)),
    "reduce_std": (lambda x: tf.math.reduce_std(x, axis=0), (M,)),
    "reduce_euclidean_norm": (lambda x: tf.math.reduce_euclidean_norm(x, axis=1), (M,)),
    "cumsum": (lambda x: tf.cumsum(x, axis=1, reverse=True), (M,)),
    "cumprod": (lambda x: tf.math.cumprod(x, axis=1, exclusive=True), (P,)),
    "cumulative_logsumexp": (lambda x: tf.math.cumulative_logsumexp(x, axis=1), (M,)),
    "norm(ord=1)": (lambda x: tf.norm(x, ord=1, axis=1), (P,)),
    "unsorted_segment_max": (lambda x: tf.math.unsorted_segment_max(x, [0, 1, 0], 2), (distinct(3, 4),)),
    # linear algebra
    "linalg.matmul": (tf.linalg.matmul, (M, normal(4, 2))),
    "linalg.inv": (tf.linalg.inv, (spd(3),)),
    "linalg.det": (tf.linalg.det, (spd(3),)),
    "linalg.slogdet": (lambda a: tf.linalg.slogdet(a)[1], (spd(3),)),
    "linalg.cholesky": (tf.linalg.cholesky, (spd(3),)),
    # The same, as a function of an unconstrained matrix (its symmetric part).
    "linalg.cholesky(sym(a))": (lambda a: tf.linalg.cholesky((a + tf.transpose(a)) / 2), (spd(3),)),
    "linalg.solve": (tf.linalg.solve, (spd(3), normal(3, 2))),
    "linalg.triangular_solve": (
        lambda a, b: tf.linalg.triangular_solve(tf.linalg.band_part(a, -1, 0), b), (spd(3), normal(3, 2))),
    "linalg.lstsq": (tf.linalg.lstsq, (normal(4, 3), normal(4, 2))),
    "linalg.qr": (lambda a: tf.linalg.qr(a)[1], (normal(4, 3),)),
    "linalg.svd": (lambda a: tf.linalg.svd(a, compute_uv=False), (normal(4, 3),)),
    "linalg.eigh": (lambda a: tf.linalg.eigh(a)[0], (spd(3),)),
    "linalg.expm": (tf.linalg.expm, (normal(3, 3) * 0.3,)),
    "linalg.logdet": (tf.linalg.logdet, (spd(3),)),
    "linalg.logdet(sym(a))": (lambda a: tf.linalg.logdet((a + tf.transpose(a)) / 2), (spd(3),)),
    "linalg.pinv": (tf.linalg.pinv, (normal(4, 3),)),
    "linalg.trace": (tf.linalg.trace, (normal(2, 3, 3),)),
    "linalg.einsum": (lambda a, b: tf.einsum("ij,jk->ik", a, b), (M, normal(4, 2))),
    "linalg.tensordot": (lambda a, b: tf.tensordot(a, b, axes=1), (M, V)),
    # neural-network ops
    "nn.softmax": (tf.nn.softmax, (M,)),
    "nn.log_softmax": (tf.nn.log_softmax, (M,)),
    "nn.l2_normalize": (lambda x: tf.nn.l2_normalize(x, axis=1), (M,)),
    "nn.moments(var)": (lambda x: tf.nn.moments(x, axes=[0])[1], (M,)),
    "nn.batch_normalization": (
        lambda x, m, v, o, s: tf.nn.batch_normalization(x, m, v, o, s, 1e-3), (M, V, P[0], V, P[1])),
    "nn.bias_add": (tf.nn.bias_add, (M, V)),
    "nn.conv2d": (lambda x, f: tf.nn.conv2d(x, f, 1, "SAME"), (IMG, normal(3, 3, 2, 3))),
    "nn.depthwise_conv2d": (
        lambda x, f: tf.nn.depthwise_conv2d(x, f, [1, 1, 1, 1], "VALID"), (IMG, normal(2, 2, 2, 1))),
    "nn.conv1d": (lambda x, f: tf.nn.conv1d(x, f, 1, "VALID"), (normal(1, 6, 2), normal(3, 2, 2))),
    "nn.avg_pool2d": (lambda x: tf.nn.avg_pool2d(x, 2, 2, "VALID"), (IMG,)),
    "nn.max_pool2d": (lambda x: tf.nn.max_pool2d(x, 2, 1, "VALID"), (distinct(1, 5, 5, 2),)),
    "nn.local_response_normalization": (tf.nn.local_response_normalization, (IMG,)),
    "nn.softmax_cross_entropy": (
        lambda z, y: tf.nn.softmax_cross_entropy_with_logits(tf.nn.softmax(y), z), (M, normal(3, 4))),
    "nn.sparse_softmax_cross_entropy": (
        lambda z: tf.nn.sparse_softmax_cross_entropy_with_logits(LABELS, z), (M,)),
    "nn.sigmoid_cross_entropy": (
        lambda z, y: tf.nn.sigmoid_cross_entropy_with_logits(tf.sigmoid(y), z), (M, normal(3, 4))),
    "nn.ctc_loss": None,  # filled below (needs int labels)
    # indexing and shapes
    "gather": (lambda p: tf.gather(p, [2, 0, 2], axis=1), (M,)),
    "gather_nd": (lambda p: tf.gather_nd(p, [[0, 1], [2, 3], [0, 1]]), (M,)),
    "tile": (lambda x: tf.tile(x, [2, 1]), (M,)),
    "pad(reflect)": (lambda x: tf.pad(x, [[1, 1], [2, 0]], mode="REFLECT"), (M,)),
    "roll": (lambda x: tf.roll(x, 1, axis=1), (M,)),
    "sort": (lambda x: tf.sort(x, axis=1), (distinct(3, 4),)),
    "top_k": (lambda x: tf.math.top_k(x, 2).values, (distinct(3, 4),)),
    "clip_by_norm": (lambda x: tf.clip_by_norm(x, 1.0, axes=[1]), (M,)),
    "image.resize(bilinear)": (lambda x: tf.image.resize(x, (7, 7)), (IMG,)),
    "broadcast_to": (lambda x: tf.broadcast_to(x, (3, 4)), (V,)),
    "where": (lambda a, b: tf.where(M > 0, a, b), (M, V)),
}


def _ctc(logits):
    labels = tf.constant([[1, 2], [2, 1]])
    return tf.nn.ctc_loss(labels, logits, label_length=[2, 2], logit_length=[5, 5],
                          logits_time_major=False, blank_index=0)


OPS["nn.ctc_loss"] = (_ctc, (normal(2, 5, 3),))


def check(fn, inputs, second_order):
    kwargs = dict(second_order=second_order)
    try:
        return kgb.gradcheck(fn, *inputs, **kwargs), ""
    except TypeError as error:  # cannot run in float64
        if "re-run" not in str(error) or "float64" not in str(error):
            raise
        return kgb.gradcheck(fn, *inputs, numeric_dtype=None, **kwargs), "float32 differences"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated op names")
    parser.add_argument("--second-order", action="store_true")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(OPS)
    print(f"TF {tf.__version__}; gradcheck over {len(names)} ops, default tolerances")
    failed, skipped = [], []
    start = time.perf_counter()
    for name in names:
        fn, inputs = OPS[name]
        try:
            result, note = check(fn, inputs, args.second_order)
        except Exception as error:  # the op itself fails (no gradient at all, ...)
            failed.append(name)
            print(f"  {name:<32} ERROR  {type(error).__name__}: {str(error).splitlines()[0][:150]}")
            continue
        gradients = ",".join(s.gradient for s in result.sources)
        worst = max((s.max_rel_error or 0.0) for s in result.sources)
        verdict = "ok" if result.ok else "FAIL"
        extra = f" ({note})" if note else ""
        print(f"  {name:<32} {verdict:<5} grads: {gradients:<20} max rel err {worst:.1e}{extra}")
        for problem in result.problems:
            print(f"      problem: {problem[:300]}")
        for n in result.notes:
            print(f"      note: {n[:200]}")
        if not result.ok:
            failed.append(name)
        if result.notes:
            skipped.append(name)
    print(
        f"{len(names) - len(failed)} of {len(names)} ops pass; failed: "
        f"{', '.join(failed) or 'none'}; with a skipped check: {', '.join(skipped) or 'none'} "
        f"({time.perf_counter() - start:.0f} s)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
