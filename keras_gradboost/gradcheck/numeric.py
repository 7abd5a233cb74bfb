"""Numeric derivatives by central differences, and the tolerances they are
compared with.

Steps follow the dtype the differences are computed in: `cbrt(eps) *
max(1, |x|)` per element (6e-6 for float64, 5e-3 for float32), which balances
the truncation error (~h^2) against rounding (~eps/h). Each difference is
divided by the step actually taken, `(x + h) - (x - h)` in that dtype.
"""

import numpy as np
import tensorflow as tf

# Default (atol, rtol) by the dtype the analytic gradient is computed in.
TOLERANCES = {
    "float64": (1e-6, 1e-5),
    "float32": (1e-4, 1e-3),
    "float16": (5e-3, 1e-2),
    "bfloat16": (5e-2, 5e-2),
}


def tolerances(dtype):
    """`(atol, rtol)` for gradients computed in `dtype`."""
    return TOLERANCES.get(tf.as_dtype(dtype).name, TOLERANCES["float32"])


def step_scale(dtype):
    """`cbrt(eps)` of `dtype`: the relative step of a central difference."""
    return float(np.finfo(tf.as_dtype(dtype).as_numpy_dtype).eps) ** (1.0 / 3.0)


def steps(value, step=None):
    """Per-element steps for `value`: `step` if given (absolute), else
    `cbrt(eps) * max(1, |x|)` in `value`'s dtype."""
    if step is not None:
        return tf.fill(tf.shape(value), tf.cast(step, value.dtype))
    scale = step_scale(value.dtype)
    return tf.cast(scale, value.dtype) * tf.maximum(tf.ones_like(value), tf.abs(value))


def _replaced(values, i, x):
    values = list(values)
    values[i] = x
    return values


def columns(f, values, i, step=None):
    """The Jacobian columns of `f` (values -> vector) for source `i`, by
    central differences: a float64 `(m, size of source i)` matrix.

    Runs as one `tf.function` (a loop over the elements of source `i`) when
    `f` can be traced, else eagerly, element by element.
    """
    x = values[i]
    flat = tf.reshape(x, [-1])
    h = tf.reshape(steps(x, step), [-1])
    n = int(flat.shape[0])

    def column(j):
        index = tf.reshape(j, [1, 1])
        up = tf.tensor_scatter_nd_add(flat, index, tf.reshape(h[j], [1]))
        down = tf.tensor_scatter_nd_sub(flat, index, tf.reshape(h[j], [1]))
        plus = f(_replaced(values, i, tf.reshape(up, tf.shape(x))))
        minus = f(_replaced(values, i, tf.reshape(down, tf.shape(x))))
        taken = tf.cast(up[j] - down[j], tf.float64)
        return (tf.cast(plus, tf.float64) - tf.cast(minus, tf.float64)) / taken

    def loop():
        return tf.map_fn(
            column, tf.range(n), fn_output_signature=tf.float64, parallel_iterations=1
        )

    try:
        cols = tf.function(loop, autograph=False)()
    except (TypeError, ValueError, NotImplementedError, tf.errors.OperatorNotAllowedInGraphError):
        cols = tf.stack([column(tf.constant(j)) for j in range(n)])
    return tf.transpose(cols)


def directional(f, values, i, direction, step=None):
    """`J_i @ direction` by one central difference along `direction`
    (float64 vector of length m). The step is `cbrt(eps) * max(1, max |x|)
    / max |direction|`, or `step` times that scale when given."""
    x = values[i]
    d = tf.cast(direction, x.dtype)
    biggest = max(1.0, float(tf.reduce_max(tf.abs(tf.cast(x, tf.float64)))))
    scale = step if step is not None else step_scale(x.dtype) * biggest
    t = tf.cast(scale / max(float(tf.reduce_max(tf.abs(tf.cast(d, tf.float64)))), 1e-300), x.dtype)
    up, down = x + t * d, x - t * d
    plus = tf.cast(f(_replaced(values, i, up)), tf.float64)
    minus = tf.cast(f(_replaced(values, i, down)), tf.float64)
    # The step actually taken along d, in the dtype of x.
    taken = tf.reduce_sum(tf.cast(up - down, tf.float64) * tf.cast(d, tf.float64)) / tf.reduce_sum(
        tf.cast(d, tf.float64) ** 2
    )
    return (plus - minus) / taken


def close(analytic, numeric, atol, rtol):
    """`(max abs error, max rel error, ok)` of two float64 arrays: ok when
    every `|a - n| <= atol + rtol * |n|`; the relative error is to the
    largest `|n|` (1 when all are zero)."""
    a, n = np.asarray(analytic, np.float64), np.asarray(numeric, np.float64)
    if a.size == 0:
        return 0.0, 0.0, True
    diff = np.abs(a - n)
    diff = np.where(np.isnan(diff), np.inf, diff)
    scale = float(np.max(np.abs(n)))
    scale = scale if np.isfinite(scale) and scale > 0 else 1.0
    ok = bool(np.all(diff <= atol + rtol * np.abs(n)))
    return float(np.max(diff)), float(np.max(diff)) / scale, ok


def probe_close(a, n, d_norm, w_norm, atol, rtol):
    """`(abs error, rel error, ok)` of two scalars `a ~ n ~ u^T J d`.

    `u` is standard normal, so `u^T J d` is of the size of `|J d|` (`w_norm`,
    numeric): the tolerance is `atol * |d| + rtol * |J d|`, and the relative
    error is to `|J d|`.
    """
    diff = abs(float(a) - float(n))
    if not np.isfinite(diff):
        return float("inf"), float("inf"), False
    rel = diff / w_norm if w_norm > 0 else (0.0 if diff == 0 else float("inf"))
    return diff, rel, diff <= atol * d_norm + rtol * w_norm
