"""Which layers run a kernel other than Keras' own, here and now.

`compile(depthwise="native"/"chunked")` and `compile(pointwise="matmul")` mark layers
(`depthwise.apply`, `pointwise.apply`); a marked layer takes its other
kernel only inside `running(...)` with its id, which the boosted model
enters around each of its calls, and a recompute's replay around the
replay (it runs the kernels its forward ran). Elsewhere, such as in the
model given to `boost()`, which shares the layers, Keras' own kernel runs.
Per thread: MirroredStrategy traces its replicas in threads of their own.
"""

import contextlib
import threading

import keras

from keras_gradboost import hooks
from keras_gradboost import wrappers

_LOCAL = threading.local()


def check_setting(name, value, accepted, expected):
    """`value` of the compile argument `name` if it is None or one of the
    `accepted` strings.

    Raises:
        ValueError: naming the argument, the value and what is `expected`.
    """
    if value is None or (isinstance(value, str) and value in accepted):
        return value
    raise ValueError(
        f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
        f"Expected {expected}."
    )


def keeps_own_convolution(layer):
    """Whether `layer`'s class defines a `convolution_op` of its own (a
    weight-standardised convolution, say): neither option replaces it."""
    return type(layer).convolution_op is not keras.layers.Conv2D.convolution_op


def eligible_layers(model, eligible):
    """The layers of `model` (nested ones too) that `eligible(layer)`
    accepts (it returns `(True, None)` or `(False, reason)`)."""
    return [
        layer
        for layer in hooks.flatten_layers(model, include_self=False)
        if eligible(layer)[0]
    ]


def mark(layers, wrapper):
    """Wraps each layer's `convolution_op` with `wrapper(layer)`, which
    runs the other kernel inside `running` (idempotent; the marks do nothing
    outside it).

    Returns:
        A frozenset of the layers' ids, for `running`.
    """
    for layer in layers:
        if not any(isinstance(p.around, wrapper) for p in wrappers.patches(layer, "convolution_op")):
            wrappers.patch(layer, "convolution_op", wrapper(layer))
    return frozenset(id(layer) for layer in layers)


def current():
    """The ids of the layers running their other kernel here."""
    return getattr(_LOCAL, "layer_ids", frozenset())


@contextlib.contextmanager
def running(layer_ids):
    """Inside, the marked layers whose ids are in `layer_ids` run their
    other kernel."""
    previous = current()
    _LOCAL.layer_ids = previous | layer_ids
    try:
        yield
    finally:
        _LOCAL.layer_ids = previous
