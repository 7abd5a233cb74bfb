"""`kgb.ops`: each op against its naive composite where both are finite
(values and gradients), finite where the naive one is not (0, huge, tiny,
rows of -inf), verified with gradcheck, in float16/bfloat16 and under
`jit_compile=True`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gradboost as kgb
from keras_gradboost import ops

INF = float("inf")


def value_and_grad(fn, *xs, upstream=None):
    """`fn(*xs)` and the gradient of `sum(upstream * fn(*xs))` per input."""
    xs = [tf.convert_to_tensor(x) for x in xs]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        y = fn(*xs)
    grads = tape.gradient(y, xs, output_gradients=upstream)
    return y, grads


def naive_norm(x, axis=-1):
    return tf.sqrt(tf.reduce_sum(tf.square(x), axis=axis))


# name: (op, naive composite, inputs where both are finite)
rng = np.random.default_rng(0)
MODERATE = rng.normal(size=(3, 5)).astype("float32")
POSITIVE = rng.uniform(0.1, 4.0, size=(3, 5)).astype("float32")
CASES = {
    "log1pexp": (ops.log1pexp, lambda x: tf.math.log(1 + tf.exp(x)), (MODERATE * 4,)),
    "safe_log": (ops.safe_log, tf.math.log, (POSITIVE,)),
    "safe_sqrt": (ops.safe_sqrt, tf.sqrt, (POSITIVE,)),
    "safe_norm": (ops.safe_norm, naive_norm, (MODERATE,)),
    "safe_divide": (ops.safe_divide, lambda x, y: x / y, (MODERATE, POSITIVE[0])),
    "logsumexp": (ops.logsumexp, lambda x: tf.math.log(tf.reduce_sum(tf.exp(x), -1)), (MODERATE,)),
}


@pytest.mark.parametrize("name", CASES)
def test_equal_to_the_naive_composite_where_both_are_finite(name):
    op, naive, inputs = CASES[name]
    ours, our_grads = value_and_grad(op, *inputs)
    theirs, their_grads = value_and_grad(naive, *inputs)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    for a, b in zip(our_grads, their_grads):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_every_op_passes_gradcheck_with_second_order(name):
    op, _, inputs = CASES[name]
    result = kgb.gradcheck(op, *inputs, jit=False, second_order=True)
    assert result.ok, result


def test_the_ops_with_axes_pass_gradcheck():
    x = MODERATE.reshape(3, 5, 1) * np.ones((1, 1, 2), "float32")
    for fn, inputs in (
        (lambda x: ops.safe_norm(x, axis=(0, 2), keepdims=True), (x,)),
        (lambda x: ops.logsumexp(x, axis=None), (x,)),
        (ops.safe_divide, (x, POSITIVE[:, :1, None])),  # y broadcast along 2 axes
    ):
        result = kgb.gradcheck(fn, *inputs, jit=False)
        assert result.ok, result


# name: (op, naive, inputs where the naive one fails, expected values, expected gradients)
FAILURES = {
    "log1pexp, huge": (
        ops.log1pexp, lambda x: tf.math.log(1 + tf.exp(x)),
        ([100.0, 1e30, -1e30],), [100.0, 1e30, 0.0], [[1.0, 1.0, 0.0]],
    ),
    "safe_log, zero and tiny": (
        lambda x: ops.safe_log(x, eps=1e-6), tf.math.log,
        ([0.0, 1e-45, 2.0],), [np.log(1e-6), np.log(1e-6), np.log(2.0)], [[0.0, 0.0, 0.5]],
    ),
    "safe_sqrt, zero": (
        ops.safe_sqrt, tf.sqrt, ([0.0, 0.0, 4.0],), [0.0, 0.0, 2.0], [[0.0, 0.0, 0.25]],
    ),
    "safe_norm, zero vector": (
        ops.safe_norm, naive_norm, ([[0.0, 0.0], [3.0, 4.0]],), [0.0, 5.0], [[[0.0, 0.0], [0.6, 0.8]]],
    ),
    "safe_divide, zero denominator": (
        ops.safe_divide, lambda x, y: x / y,
        ([1.0, 0.0, 3.0], [0.0, 0.0, 2.0]), [0.0, 0.0, 1.5], [[0.0, 0.0, 0.5], [0.0, 0.0, -0.75]],
    ),
    "logsumexp, huge and rows of -inf": (
        ops.logsumexp, lambda x: tf.math.log(tf.reduce_sum(tf.exp(x), -1)),
        ([[1000.0, 1000.0], [-INF, -INF]],), [1000.0 + np.log(2.0), -INF], [[[0.5, 0.5], [0.0, 0.0]]],
    ),
    "logsumexp, sums that underflow": (
        ops.logsumexp, lambda x: tf.math.log(tf.reduce_sum(tf.exp(x), -1)),
        ([[-120.0, -120.0], [1.0, 1.0]],), [-120.0 + np.log(2.0), 1.0 + np.log(2.0)],
        [[[0.5, 0.5], [0.5, 0.5]]],
    ),
}


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("name", FAILURES)
def test_finite_where_the_naive_composite_is_not(name, traced):
    """Eagerly the guards run as plain ops; in a traced function as fused
    XLA kernels (see test_in_a_traced_function_forward_and_backward_are_fused_kernels
    for which): both are checked."""
    op, naive, inputs, values, grads = FAILURES[name]
    inputs = [tf.constant(x, tf.float32) for x in inputs]
    theirs, their_grads = value_and_grad(naive, *inputs)
    bad = [theirs] + [g for g in their_grads if g is not None]
    assert not all(bool(tf.reduce_all(tf.math.is_finite(t))) for t in bad), "the naive op is fine here"
    run = tf.function(value_and_grad) if traced else value_and_grad
    ours, our_grads = run(op, *inputs)
    np.testing.assert_allclose(ours, values, rtol=1e-6)
    for g, expected in zip(our_grads, grads):
        assert bool(tf.reduce_all(tf.math.is_finite(g)))
        np.testing.assert_allclose(g, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_safe_sqrt_gradient_is_zero_at_and_below_zero_and_nan_at_nan(traced):
    """The guard covers x <= 0 only: a NaN input gives a NaN gradient, as
    the naive sqrt does (NaNWatcher then sees it)."""
    x = tf.constant([-1.0, 0.0, np.nan, 4.0])
    run = tf.function(value_and_grad) if traced else value_and_grad
    values, (grad,) = run(ops.safe_sqrt, x)
    np.testing.assert_array_equal(values.numpy(), [0.0, 0.0, np.nan, 2.0])
    np.testing.assert_array_equal(grad.numpy(), [0.0, 0.0, np.nan, 0.25])


def test_tf_reduce_logsumexp_gives_nan_gradients_on_a_row_of_minus_inf():
    x = tf.constant([[-INF, -INF], [1.0, 2.0]])
    _, (theirs,) = value_and_grad(lambda x: tf.reduce_logsumexp(x, -1), x)
    _, (ours,) = value_and_grad(ops.logsumexp, x)
    assert np.isnan(theirs[0]).all() and (ours[0].numpy() == 0).all()
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", CASES)
def test_half_precision_is_computed_in_float32(name, dtype):
    op, _, inputs = CASES[name]
    half = [tf.cast(x, dtype) for x in inputs]
    exact = [tf.cast(x, tf.float64) for x in half]  # the same numbers
    ours, our_grads = value_and_grad(op, *half)
    reference, ref_grads = value_and_grad(op, *exact)
    assert ours.dtype == dtype and all(g.dtype == dtype for g in our_grads)
    # Within one rounding of the half dtype of the exact result.
    rtol = 8e-3 if dtype == "bfloat16" else 1e-3
    np.testing.assert_allclose(tf.cast(ours, tf.float64), reference, rtol=rtol, atol=rtol)
    for a, b in zip(our_grads, ref_grads):
        np.testing.assert_allclose(tf.cast(a, tf.float64), b, rtol=rtol, atol=rtol)


def test_half_precision_stays_finite_where_float16_overflows():
    x = tf.constant([300.0, 60000.0], tf.float16)  # x**2 overflows float16
    norm, (grad,) = value_and_grad(lambda x: ops.safe_norm(x, axis=0), x)
    assert float(norm) == pytest.approx(60000.75, rel=1e-3)
    assert bool(tf.reduce_all(tf.math.is_finite(grad)))
    assert not bool(tf.math.is_finite(naive_norm(x, axis=0)))
    assert float(ops.log1pexp(tf.constant(20.0, tf.float16))) == pytest.approx(20.0)


def test_under_jit_compile_values_and_gradients_equal_eager():
    def all_ops(a, p):
        return [
            ops.log1pexp(a), ops.safe_log(p), ops.safe_sqrt(p), ops.safe_norm(a),
            ops.safe_divide(a, p), ops.logsumexp(a),
        ]

    def run(a, p):
        with tf.GradientTape() as tape:
            tape.watch([a, p])
            outputs = all_ops(a, p)
            total = tf.add_n([tf.reduce_sum(o * (i + 1.0)) for i, o in enumerate(outputs)])
        return outputs, tape.gradient(total, [a, p])

    a = tf.constant(np.concatenate([MODERATE, [[0.0] * 5]]))
    p = tf.constant(np.concatenate([POSITIVE, [[0.0] * 5]]))  # zeros: the safe branches
    eager = run(a, p)
    jitted = tf.function(run, jit_compile=True)(a, p)
    for x, y in zip(tf.nest.flatten(eager), tf.nest.flatten(jitted)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_usable_as_keras_activations_and_saved_by_name():
    keras.utils.set_random_seed(0)
    for activation in (ops.log1pexp, ops.safe_sqrt, ops.safe_log):
        layer = keras.layers.Dense(3, activation=activation)
        restored = keras.layers.Dense.from_config(
            keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer)).get_config()
        )
        assert restored.activation is activation
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation=ops.log1pexp)])
    config = keras.saving.serialize_keras_object(model)
    clone = keras.saving.deserialize_keras_object(config)
    assert clone.layers[0].activation is ops.log1pexp
    assert kgb.gradcheck(model, tf.constant(MODERATE[:, :4]), jit=False).ok


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda: ops.log1pexp(tf.constant([1, 2])), TypeError, "argument `x`. Received: x of dtype int32"),
        (lambda: ops.safe_log(tf.constant([1.0]), eps=0.0), ValueError, "Received: eps=0.0"),
        (lambda: ops.safe_divide(tf.constant([1.0]), tf.constant([1.0], tf.float64)), TypeError,
         "argument `y`. Received: y of dtype float64. Expected float32"),
        (lambda: ops.safe_divide(tf.constant([1.0]), tf.constant([1.0]), eps=-1.0), ValueError,
         "Received: eps=-1.0"),
        (lambda: ops.safe_norm(tf.constant([1.0]), axis="0"), TypeError, "argument `axis`"),
        (lambda: ops.logsumexp(tf.constant([1.0]), keepdims=1), TypeError, "argument `keepdims`"),
    ],
)
def test_invalid_arguments_are_refused_naming_them(call, error, text):
    with pytest.raises(error, match=text):
        call()


@pytest.mark.parametrize("name", [n for n in CASES if n != "safe_divide"] + ["safe_divide eps"])
def test_in_a_traced_function_forward_and_backward_are_fused_kernels(name):
    """The guards cost extra passes unless fused: in a graph, the op's
    forward and its backward are each one XLA-compiled function call.
    (safe_divide with eps=0 is TensorFlow's `divide_no_nan` kernel, as few
    passes as the naive division: not fused; nor is safe_sqrt's backward,
    two TensorFlow kernels, on a CPU faster than XLA's one.)"""
    if name == "safe_divide eps":
        op, inputs = (lambda a, b: ops.safe_divide(a, b, eps=1e-6)), CASES["safe_divide"][2]
    else:
        op, _, inputs = CASES[name]
    inputs = [tf.constant(x) for x in inputs]
    graph = tf.function(value_and_grad).get_concrete_function(op, *inputs).graph
    compiled = [
        o for o in graph.get_operations()
        if "PartitionedCall" in o.type and o.get_attr("_XlaMustCompile")
    ]
    types = [o.type for o in graph.get_operations()]
    if name == "safe_sqrt":  # the forward fused; the backward divide_no_nan
        assert len(compiled) == 1 and "DivNoNan" in types, types
        return
    assert len(compiled) >= 2, types


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_safe_divide_with_eps_is_zero_below_it_and_naive_above(traced):
    x = tf.constant([[1.0, 2.0, 3.0]])
    y = tf.constant([[1e-4, -0.5, 4.0]])
    run = tf.function(value_and_grad) if traced else value_and_grad
    out, (dx, dy) = run(lambda a, b: ops.safe_divide(a, b, eps=1e-3), x, y)
    np.testing.assert_allclose(out, [[0.0, -4.0, 0.75]], rtol=1e-6)
    np.testing.assert_allclose(dx, [[0.0, -2.0, 0.25]], rtol=1e-6)
    np.testing.assert_allclose(dy, [[0.0, -8.0, -3.0 / 16]], rtol=1e-6)
    assert kgb.gradcheck(lambda a, b: ops.safe_divide(a, b, eps=1e-3), x, y, jit=False).ok


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_log1pexp_is_exact_to_a_few_ulps_over_the_whole_range(traced, dtype):
    """Against `logaddexp(0, x)` and `1 / (1 + exp(-x))` in float64 (in
    float128 for float64 inputs, where the platform has it), wherever the
    result is a normal number of the dtype: the clamp (at 17; 37 in
    float64), the correction of `1 + exp(x)`'s rounding (x far below 0,
    where the naive composite loses every digit) and the linear tail."""
    x = np.concatenate([
        np.linspace(-100.0, 100.0, 20001), np.geomspace(1e-30, 100.0, 2001),
        -np.geomspace(1e-30, 87.0, 2001), [16.9, 17.0, 17.1, 36.9, 37.0, 37.1],
    ]).astype(dtype)
    run = tf.function(value_and_grad) if traced else value_and_grad
    y, (g,) = run(ops.log1pexp, x)
    wide = np.longdouble if np.finfo(np.longdouble).eps < np.finfo("float64").eps else np.float64
    if dtype == "float64" and wide is np.float64:
        pytest.skip("no wider float than float64 here")
    xw = x.astype(wide)
    exact = np.logaddexp(wide(0), xw)
    exact_grad = 1 / (1 + np.exp(-xw))

    def ulps(ours, exact):
        normal = exact > np.finfo(dtype).tiny
        ulp = np.spacing(exact[normal].astype(dtype)).astype(wide)
        return float(np.max(np.abs(ours.numpy().astype(wide)[normal] - exact[normal]) / ulp))

    assert ulps(y, exact) <= 4
    assert ulps(g, exact_grad) <= 4


def test_log1pexp_gradient_does_not_overflow_with_a_huge_upstream():
    x = tf.constant([30.0, -30.0, 0.0])
    _, (g,) = value_and_grad(ops.log1pexp, x, upstream=tf.constant([1e32, 1e32, 1e32]))
    np.testing.assert_allclose(g, [1e32, 1e32 * np.exp(-30.0), 0.5e32], rtol=1e-6)
