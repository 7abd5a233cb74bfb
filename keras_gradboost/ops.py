"""Numerically stable ops with hand-written gradients.

Each op is finite where its naive composite gives inf or NaN (in its value
or its gradient), equal to the composite where both are finite, and works
under `jit_compile=True`. float16 and bfloat16 inputs are computed in
float32 and the result cast back (the gradient flows through the casts), so
a half-precision model gets float32 accuracy inside the op.

| op                         | naive composite               | where the naive one fails        |
|----------------------------|-------------------------------|----------------------------------|
| `log1pexp(x)`              | `log(1 + exp(x))`             | x > 88 (float32): inf, NaN grad  |
| `safe_log(x, eps)`         | `log(x)`                      | x = 0: -inf, inf grad            |
| `safe_sqrt(x)`             | `sqrt(x)`                     | x = 0: inf grad (NaN with 0 up)  |
| `safe_norm(x, axis)`       | `sqrt(reduce_sum(x**2))`      | zero vector: NaN grad            |
| `safe_divide(x, y)`        | `x / y`                       | y = 0: inf/NaN, value and grads  |
| `logsumexp(x, axis)`       | `log(reduce_sum(exp(x)))`     | x > 88: inf; all -inf row: NaN grad |

Inside a traced function (`tf.function`, Keras' `fit`) each op's forward and
backward run as one fused XLA kernel each, so the guards cost no extra pass
over the tensor; eagerly they run as plain TensorFlow ops. (`safe_divide`
with `eps=0` runs TensorFlow's `divide_no_nan` kernels instead: as few passes
as the naive division; `safe_sqrt`'s backward runs two TensorFlow kernels,
which on a CPU were faster than XLA's one.)

`log1pexp`, `safe_sqrt` and `safe_log` take one tensor, so they serve as Keras
activations (`Dense(8, activation=kgb.ops.log1pexp)`); they are registered
for saving.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import hooks

_HALF = (tf.float16, tf.bfloat16)
_PACKAGE = "keras_gradboost"


def _kernel(fn):
    """`fn` (element-wise ops and reductions) as one XLA kernel inside a
    traced function, and as the plain ops eagerly.

    The guards that keep an op finite (a clamp, a `where`) are extra passes
    over the tensor; TensorFlow's graph runs each op as a kernel of its own,
    so unfused they cost 1.4-2.3x the naive composite. Fused, the forward and
    the backward each read and write the tensor once, as the naive one's
    kernels do. Under an outer `jit_compile=True` the kernel is inlined.
    Eagerly, and where TensorFlow has no XLA (`hooks.no_xla_device`), the
    same ops run unfused.
    """
    fused = tf.function(fn, jit_compile=True, autograph=False, reduce_retracing=True)

    @functools.wraps(fn)
    def call(*args):
        if tf.inside_function() and not _no_xla():
            return fused(*args)
        return fn(*args)

    return call


@functools.lru_cache(maxsize=None)
def _no_xla():
    return hooks.no_xla_device() is not None


def _float_tensor(name, x):
    x = tf.convert_to_tensor(x)
    if not x.dtype.is_floating:
        raise TypeError(
            f"Invalid dtype for argument `{name}`. Received: {name} of dtype "
            f"{x.dtype.name}. Expected a float tensor (cast it first, e.g. "
            f"tf.cast({name}, 'float32'))."
        )
    return x


def _in_float32(fn, *tensors):
    """`fn(*tensors)`, computed in float32 when the first is float16 or
    bfloat16, and cast back to its dtype."""
    dtype = tensors[0].dtype
    if dtype not in _HALF:
        return fn(*tensors)
    return tf.cast(fn(*[tf.cast(t, tf.float32) for t in tensors]), dtype)


def _reduced(dx, dy, x, y):
    """The gradients of a broadcasting binary op, each summed over the axes
    its argument was broadcast along, in its argument's shape."""
    sx, sy = tf.shape(x), tf.shape(y)
    rx, ry = tf.raw_ops.BroadcastGradientArgs(s0=sx, s1=sy)
    return (
        tf.reshape(tf.reduce_sum(dx, axis=rx), sx),
        tf.reshape(tf.reduce_sum(dy, axis=ry), sy),
    )


def _axis_arg(axis):
    if axis is None or isinstance(axis, int) and not isinstance(axis, bool):
        return axis
    if isinstance(axis, (tuple, list)) and all(
        isinstance(a, int) and not isinstance(a, bool) for a in axis
    ):
        return tuple(axis)  # hashable: the kernels are cached per axis
    raise TypeError(
        f"Invalid type for argument `axis`. Received: axis={axis!r} of type "
        f"{type(axis).__name__}. Expected an int, a tuple of ints or None."
    )


# ------------------------------------------------------------------ log1pexp


# Above these, log(1 + exp(x)) rounds to x and sigmoid(x) to 1 (exp(-x)
# under half an ulp of 1). Half-precision inputs are computed in float32.
_LOG1PEXP_LINEAR = {tf.float32: 17.0, tf.float64: 37.0}


@_kernel
def _log1pexp_forward(x):
    # The naive composite's own passes (an exponential, a log), kept finite
    # by clamping x at the cut, and exact to a few ulps by one correction:
    # the rounding c = e - (u - 1) of u = 1 + e, where log1p(e) = log(u) +
    # c / u, and c / u = c * (1 - e) to within c * e^2 for e < 1 (for
    # e >= 1 the correction is under an ulp of the result). log1p itself, or
    # a Kahan division, measured 1.1-1.9x the naive composite under XLA.
    # The exponential is kept: the backward needs only it.
    linear = _LOG1PEXP_LINEAR[x.dtype]
    e = tf.exp(tf.minimum(x, linear))
    u = 1 + e
    log1p_e = tf.math.log(u) + (e - (u - 1)) * tf.nn.relu(1 - e)
    return tf.where(x > linear, x, log1p_e), e


@_kernel
def _log1pexp_grad(upstream, e):
    return upstream * (e / (1 + e))  # sigmoid(x), rounding to 1 above the cut


@tf.custom_gradient
def _log1pexp(x):
    y, e = _log1pexp_forward(x)

    def grad(upstream):
        return _log1pexp_grad(upstream, e)

    return y, grad


@keras.saving.register_keras_serializable(package=_PACKAGE)
def log1pexp(x):
    """`log(1 + exp(x))` (softplus), finite for every finite `x`, with the
    hand-written gradient `sigmoid(x)`.

    The naive composite overflows to inf for `x > 88` (float32; 11 in
    float16) and its gradient `exp(x) / (1 + exp(x))` is then NaN. A Keras
    activation: `Dense(8, activation=kgb.ops.log1pexp)`.

    Args:
        x: a float tensor.

    Returns:
        A tensor of `x`'s shape and dtype.

    Example:

    ```python
    import tensorflow as tf
    import keras_gradboost as kgb

    x = tf.constant([-100.0, 0.0, 100.0])
    print(kgb.ops.log1pexp(x))        # [0, 0.693, 100]; naive: [0, 0.693, inf]
    ```
    """
    return _in_float32(_log1pexp, _float_tensor("x", x))


# ------------------------------------------------------------------ safe_log


@keras.saving.register_keras_serializable(package=_PACKAGE)
def safe_log(x, eps=None):
    """`log(max(x, eps))`: finite at 0 and below, `log(x)` above `eps`.

    The gradient is `1 / x` where `x > eps` and 0 where `x <= eps` (the
    derivative of the clamped function). The naive `log(x)` is -inf at 0,
    with an inf gradient (NaN times a zero upstream gradient).

    Args:
        x: a float tensor.
        eps: the clamp, a positive float. Defaults to `None`: the smallest
            normal number of float32 (1.2e-38; of float64 for float64
            inputs), so `safe_log(x)` equals `log(x)` for every normal
            positive `x`.

    Returns:
        A tensor of `x`'s shape and dtype.

    Example:

    ```python
    import tensorflow as tf
    import keras_gradboost as kgb

    print(kgb.ops.safe_log(tf.constant([0.0, 1.0]), eps=1e-6))   # [-13.8, 0]
    ```
    """
    x = _float_tensor("x", x)
    if eps is not None and (
        not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0
    ):
        raise ValueError(
            f"Invalid value for argument `eps`. Received: eps={eps!r}. "
            "Expected a positive float or None."
        )

    def compute(x):
        floor = eps if eps is not None else float(np.finfo(x.dtype.as_numpy_dtype).tiny)
        return _clamped_log(x, tf.constant(floor, x.dtype))

    return _in_float32(compute, x)


@_kernel
def _clamped_log_forward(x, floor):
    return tf.math.log(tf.maximum(x, floor))


@_kernel
def _clamped_log_grad(upstream, x, floor):
    above = x > floor
    return tf.where(above, upstream / tf.where(above, x, tf.ones_like(x)), 0)


@tf.custom_gradient
def _clamped_log(x, floor):
    def grad(upstream):
        return _clamped_log_grad(upstream, x, floor), None

    return _clamped_log_forward(x, floor), grad


# ----------------------------------------------------------------- safe_sqrt


@_kernel
def _sqrt_forward(x):
    return tf.sqrt(tf.nn.relu(x))


def _sqrt_grad(upstream, y):
    # 0 where y == 0 (x <= 0; NaN where x is NaN, as the naive one).
    # TensorFlow's own two kernels, not one XLA kernel: forward + backward
    # on a 4096 x 4096 tensor took 1.47x the naive sqrt with XLA's, 0.97x
    # with these on an AVX2 CPU; 1.29x and 1.23x on an AVX-512 one, where
    # the naive SqrtGrad's single pass stays ahead (benchmarks/bench_ops.py).
    return tf.math.divide_no_nan(0.5 * upstream, y)


@tf.custom_gradient
def _sqrt(x):
    y = _sqrt_forward(x)

    def grad(upstream):
        return _sqrt_grad(upstream, y)

    return y, grad


@keras.saving.register_keras_serializable(package=_PACKAGE)
def safe_sqrt(x):
    """`sqrt(max(x, 0))` with a finite gradient at 0.

    The gradient is `0.5 / sqrt(x)` where `x > 0` and 0 where `x <= 0`. The
    naive `sqrt(x)` has an inf gradient at 0 (NaN times a zero upstream
    gradient, e.g. a padded entry), and NaN below 0.

    Args:
        x: a float tensor.

    Returns:
        A tensor of `x`'s shape and dtype.

    Example:

    ```python
    import tensorflow as tf
    import keras_gradboost as kgb

    x = tf.constant([0.0, 4.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = kgb.ops.safe_sqrt(x)
    print(tape.gradient(y, x))        # [0, 0.25]; naive: [inf, 0.25]
    ```
    """
    return _in_float32(_sqrt, _float_tensor("x", x))


# ----------------------------------------------------------------- safe_norm


def safe_norm(x, axis=-1, keepdims=False):
    """The Euclidean norm `sqrt(sum(x**2, axis))`, with a finite gradient
    (0) at the zero vector.

    The gradient is `x / norm` where the norm is positive. The naive
    composite's gradient at the zero vector is 0/0 = NaN (a zero-padded
    row, a collapsed embedding).

    Args:
        x: a float tensor.
        axis: an int, a tuple of ints, or None (all axes). Defaults to `-1`.
        keepdims: keep the reduced axes with size 1. Defaults to `False`.

    Returns:
        The norms, in `x`'s dtype.

    Example:

    ```python
    import tensorflow as tf
    import keras_gradboost as kgb

    x = tf.constant([[0.0, 0.0], [3.0, 4.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        n = kgb.ops.safe_norm(x)
    print(n, tape.gradient(n, x))     # [0, 5], [[0, 0], [0.6, 0.8]]
    ```
    """
    x = _float_tensor("x", x)
    axis = _axis_arg(axis)
    _keepdims_arg(keepdims)

    forward, backward = _norm_kernels(axis, keepdims)

    @tf.custom_gradient
    def norm(x):
        kept, out = forward(x)

        def grad(upstream):
            return backward(upstream, x, kept)

        return out, grad

    return _in_float32(norm, x)


@functools.lru_cache(maxsize=None)
def _norm_kernels(axis, keepdims):
    @_kernel
    def forward(x):
        # Not tf.math.reduce_euclidean_norm: XLA has no kernel for it.
        kept = tf.sqrt(tf.reduce_sum(tf.square(x), axis=axis, keepdims=True))
        return kept, _dropped(kept, x, axis, keepdims)

    @_kernel
    def backward(upstream, x, kept):
        return x * _upstream_over(upstream, kept, kept, keepdims)

    return forward, backward


def _dropped(kept, x, axis, keepdims):
    """`kept` (reduced with `keepdims=True`) as `keepdims` asks."""
    return kept if keepdims else tf.squeeze(kept, axis=_squeeze_axes(x, axis))


def _keepdims_arg(keepdims):
    if not isinstance(keepdims, bool):
        raise TypeError(
            f"Invalid type for argument `keepdims`. Received: keepdims="
            f"{keepdims!r} of type {type(keepdims).__name__}. Expected a bool."
        )


def _upstream_over(upstream, denominator, kept, keepdims):
    """`upstream / denominator` where the denominator is positive, else 0:
    the backward of a reduction, with `upstream` given the reduced axes back
    (`kept`'s shape) when `keepdims` dropped them."""
    if not keepdims:
        upstream = tf.reshape(upstream, tf.shape(kept))
    positive = denominator > 0
    return tf.where(positive, upstream / tf.where(positive, denominator, 1), 0)


def _squeeze_axes(x, axis):
    rank = x.shape.rank
    if axis is None:
        return list(range(rank))
    axes = [axis] if isinstance(axis, int) else axis
    return [a % rank for a in axes]


# --------------------------------------------------------------- safe_divide


def _safe_denominator(y, eps):
    ok = tf.abs(y) > eps
    return ok, tf.where(ok, y, tf.ones_like(y))


@_kernel
def _divide_forward(x, y, eps):
    ok, safe_y = _safe_denominator(y, eps)
    quotient = x / safe_y
    return tf.where(ok, quotient, tf.zeros_like(quotient))


@_kernel
def _divide_grad(upstream, x, y, out, eps):
    ok, safe_y = _safe_denominator(y, eps)
    dx = tf.where(ok, upstream / safe_y, 0)
    dy = tf.where(ok, -(upstream * out) / safe_y, 0)
    return _reduced(dx, dy, x, y)


@tf.custom_gradient
def _divide(x, y, eps):
    out = _divide_forward(x, y, eps)

    def grad(upstream):
        return (*_divide_grad(upstream, x, y, out, eps), None)

    return out, grad


@tf.custom_gradient
def _divide_no_nan(x, y):
    """`_divide` at eps=0 in TensorFlow's own `divide_no_nan` kernel (0
    where y == 0), as few passes as the naive division: measured faster
    than it and than the fused kernels without XLA."""
    out = tf.math.divide_no_nan(x, y)

    def grad(upstream):
        dx = tf.math.divide_no_nan(upstream, y)
        dy = -dx * out  # -upstream * x / y**2, and 0 where y == 0
        if x.shape.is_fully_defined() and x.shape == y.shape:
            return dx, dy
        return _reduced(dx, dy, x, y)

    return out, grad


def safe_divide(x, y, eps=0.0):
    """`x / y` where `|y| > eps`, and 0 elsewhere (values and gradients).

    Broadcasts like `x / y`; each gradient has exactly its argument's shape
    (summed over the broadcast axes). With `eps=0` it is
    `tf.math.divide_no_nan` with a gradient that is finite too: the naive
    `x / y` is inf or NaN at `y = 0`, and so are both of its gradients.

    Args:
        x: a float tensor, the numerator.
        y: a float tensor of the same dtype, the denominator.
        eps: denominators with `|y| <= eps` give 0. A float >= 0. Defaults
            to `0.0`.

    Returns:
        A tensor of the broadcast shape, in `x`'s dtype.

    Example:

    ```python
    import tensorflow as tf
    import keras_gradboost as kgb

    print(kgb.ops.safe_divide(tf.constant([1.0, 1.0]), tf.constant([0.0, 4.0])))
    ```
    """
    x, y = _float_tensor("x", x), _float_tensor("y", y)
    if y.dtype != x.dtype:
        raise TypeError(
            f"Invalid dtype for argument `y`. Received: y of dtype "
            f"{y.dtype.name}. Expected {x.dtype.name}, the dtype of `x`."
        )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(
            f"Invalid value for argument `eps`. Received: eps={eps!r}. "
            "Expected a float >= 0."
        )
    if eps == 0:
        return _in_float32(_divide_no_nan, x, y)
    return _in_float32(lambda a, b: _divide(a, b, tf.constant(eps, a.dtype)), x, y)


# ----------------------------------------------------------------- logsumexp


def logsumexp(x, axis=-1, keepdims=False):
    """`log(sum(exp(x), axis))`, stable, with rows of -inf handled.

    Shifted by the row's maximum, so large values do not overflow (the naive
    composite is inf for x > 88 in float32). A row that is all -inf (a fully
    masked row) gives -inf, the exact `log(0)`, and a zero gradient; the
    gradient is NaN there for `tf.reduce_logsumexp` and the naive composite.
    The gradient is `softmax(x)`, from the forward's own exponentials.

    Args:
        x: a float tensor.
        axis: an int, a tuple of ints, or None (all axes). Defaults to `-1`.
        keepdims: keep the reduced axes with size 1. Defaults to `False`.

    Returns:
        A tensor in `x`'s dtype.

    Example:

    ```python
    import tensorflow as tf
    import keras_gradboost as kgb

    x = tf.constant([[1000.0, 1000.0], [-float("inf"), -float("inf")]])
    print(kgb.ops.logsumexp(x))       # [1000.693, -inf]
    ```
    """
    x = _float_tensor("x", x)
    axis = _axis_arg(axis)
    _keepdims_arg(keepdims)

    forward, backward = _logsumexp_kernels(axis, keepdims)

    @tf.custom_gradient
    def lse(x):
        e, total, kept, out = forward(x)

        def grad(upstream):
            return backward(upstream, e, total, kept)

        return out, grad

    return _in_float32(lse, x)


@functools.lru_cache(maxsize=None)
def _logsumexp_kernels(axis, keepdims):
    @_kernel
    def forward(x):
        biggest = tf.reduce_max(x, axis=axis, keepdims=True)
        shift = tf.where(tf.math.is_finite(biggest), biggest, tf.zeros_like(biggest))
        e = tf.exp(x - shift)
        total = tf.reduce_sum(e, axis=axis, keepdims=True)
        kept = tf.math.log(total) + shift
        return e, total, kept, _dropped(kept, x, axis, keepdims)

    @_kernel
    def backward(upstream, e, total, kept):
        return e * _upstream_over(upstream, total, kept, keepdims)

    return forward, backward


__all__ = ["log1pexp", "logsumexp", "safe_divide", "safe_log", "safe_norm", "safe_sqrt"]
