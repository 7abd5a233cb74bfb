"""keras_gradboost: faster, lighter, debuggable backward passes for Keras 3.

Public API:
    GradBoostModel: a `keras.Model` whose `compile()` adds `accumulate_steps`,
        `precision`, `loss_scale`, `recompute` and `recompute_check`.
    boost: turns any built Keras model into a GradBoostModel.
    GradBoostConfig: the validated gradboost compile arguments.
    RecomputePlan: what `GradBoostModel.recompute_plan()` returns.
    RecomputeCheckError: raised by `recompute_check=True`.
    callbacks: drop-in callbacks (NaNWatcher, StepTimeMonitor,
        RetraceCounter, GradientAuditor).
    data: input-pipeline helpers (bucket_by_length).
"""

__version__ = "0.1.0.dev0"

from keras_gradboost import callbacks
from keras_gradboost import data
from keras_gradboost.config import GradBoostConfig
from keras_gradboost.model import GradBoostModel
from keras_gradboost.model import boost
from keras_gradboost.recompute import RecomputeCheckError
from keras_gradboost.recompute import RecomputePlan

__all__ = [
    "GradBoostConfig",
    "GradBoostModel",
    "RecomputeCheckError",
    "RecomputePlan",
    "boost",
    "callbacks",
    "data",
    "__version__",
]
