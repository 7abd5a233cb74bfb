"""Which layers run a kernel other than Keras' own, here and now.

`compile(depthwise="native")` and `compile(pointwise="matmul")` mark layers
(`depthwise.apply`, `pointwise.apply`); a marked layer takes its other
kernel only inside `running(...)` with its id, which the boosted model
enters around each of its calls, and a recompute's replay around the
replay (it runs the kernels its forward ran). Elsewhere, such as in the
model given to `boost()`, which shares the layers, Keras' own kernel runs.
Per thread: MirroredStrategy traces its replicas in threads of their own.
"""

import contextlib
import threading

_LOCAL = threading.local()


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
