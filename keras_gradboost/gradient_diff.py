"""Which gradients differ between two computations of the same step (the
accumulation and recompute checks)."""

import numpy as np

# A gradient that is zero in exact arithmetic (an attention key's bias: the
# softmax does not see it) comes out as round-off, 1e-12 to 3e-11 where the
# model's largest gradient is ~1 (a BERT, a GPT-2): compared with its own
# largest magnitude, any two computations of it "differ". Differences below
# this share of the tolerance, scaled by the largest gradient of all, are
# round-off: a real error that small would move no weight measurably.
ROUND_OFF_SHARE = 1e-3


def differing(variables, want, got, rtol):
    """`(path, difference)` of the gradients in `got` that differ from `want`
    by more than `rtol` of their largest magnitude, largest first.

    A None on one side only differs by inf. A difference below
    `rtol * ROUND_OFF_SHARE` of the largest gradient magnitude over all the
    variables (or 1e-12) is round-off and never counts. Nor, for a gradient
    no larger than the gradients' machine epsilon times that magnitude, is
    a difference below that: such a gradient is round-off itself (zero in
    exact arithmetic, it cancels terms as large as the largest gradient,
    each rounded to that epsilon).

    Args:
        variables: the variables, for their paths.
        want: the reference gradients (NumPy arrays or None), in order.
        got: the gradients to check, in the same order.
        rtol: the tolerance, a share of each reference gradient's largest
            magnitude.

    Returns:
        A list of `(variable path, largest absolute difference)`.
    """
    scale = max(
        (float(np.max(np.abs(a), initial=0.0)) for a in want if a is not None),
        default=0.0,
    )
    floor = max(1e-12, rtol * ROUND_OFF_SHARE * scale)
    round_off = _epsilon(want) * scale
    found = []
    for variable, a, b in zip(variables, want, got):
        if (a is None) != (b is None):
            found.append((variable.path, float("inf")))
            continue
        if a is None:
            continue
        difference = float(np.max(np.abs(a - b), initial=0.0))
        magnitude = float(np.max(np.abs(a), initial=0.0))
        allowed = rtol * magnitude + floor
        if magnitude <= round_off:  # round-off itself: zero in exact arithmetic
            allowed = max(allowed, round_off)
        if not np.isfinite(difference) or difference > allowed:
            found.append((variable.path, difference))
    return sorted(found, key=lambda pair: -pair[1])


def _epsilon(arrays):
    """The machine epsilon of the least precise float array (0: none)."""
    found = 0.0
    for a in arrays:
        if a is None:
            continue
        if a.dtype.name == "bfloat16":  # ml_dtypes' type: NumPy has no finfo for it
            found = max(found, 2.0**-7)
        elif np.issubdtype(a.dtype, np.floating):
            found = max(found, float(np.finfo(a.dtype).eps))
    return found
