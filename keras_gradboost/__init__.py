"""keras_gradboost: faster, lighter, debuggable backward passes for Keras 3.

Public API:
    GradBoostModel: a `keras.Model` whose `compile()` adds `accumulate_steps`,
        `precision`, `loss_scale`, `recompute`, `recompute_check` and
        `accumulate_check`.
    boost: turns any built Keras model into a GradBoostModel.
    GradBoostConfig: the validated gradboost compile arguments.
    RecomputePlan: what `GradBoostModel.recompute_plan()` returns.
    RecomputeCheckError: raised by `recompute_check=True`.
    Recompute: wraps a layer so its backward recomputes its forward (the
        mechanism of `compile(recompute=...)`); `recompute_function(fn)` for a
        function.
    AccumulationCheckError: raised by `accumulate_check=True`.
    JitMeasurement: what `compile(jit_compile="measure")` chose
        (`GradBoostModel.jit_measurement`).
    PrecisionMeasurement: what `compile(precision="auto")` chose
        (`GradBoostModel.precision_measurement`).
    XLAUnsupportedOpError: XLA cannot compile the training step.
    StepFacts: what the training step publishes (`GradBoostModel.step_facts`).
    TrainPlan: what `compile()` decided (`GradBoostModel.train_plan`).
    callbacks: drop-in callbacks (NaNWatcher, StepTimeMonitor,
        RetraceCounter, GradientAuditor).
    data: input-pipeline helpers (bucket_by_length).
    launch: runs a script in N local worker processes of one
        MultiWorkerMirroredStrategy cluster (TF_CONFIG each, free ports,
        prefixed output, bounded in time); `keras-gradboost launch`.
    gradcheck: checks every gradient of a function or Keras layer against
        float64 numeric differences, shape- and dtype-strict
        (`GradCheckResult`); `assert_gradients_close` raises on failure.
    ops: numerically stable ops with hand-written gradients (log1pexp,
        safe_log, safe_sqrt, safe_norm, safe_divide, logsumexp).
    tracing: the trace-time wrappers of the callbacks (`tracing.uninstall`).
"""

__version__ = "0.1.0.dev0"

from keras_gradboost import callbacks
from keras_gradboost import data
from keras_gradboost import ops
from keras_gradboost import tracing
from keras_gradboost.accumulate_check import AccumulationCheckError
from keras_gradboost.config import GradBoostConfig
from keras_gradboost.gradcheck import GradCheckResult
from keras_gradboost.gradcheck import assert_gradients_close
from keras_gradboost.gradcheck import gradcheck
from keras_gradboost.jit_measure import JitMeasurement
from keras_gradboost.jit_measure import XLAUnsupportedOpError
from keras_gradboost.launcher import launch
from keras_gradboost.model import GradBoostModel
from keras_gradboost.model import boost
from keras_gradboost.plan import TrainPlan
from keras_gradboost.precision_measure import PrecisionMeasurement
from keras_gradboost.recompute import Recompute
from keras_gradboost.recompute import RecomputeCheckError
from keras_gradboost.recompute import RecomputePlan
from keras_gradboost.recompute import recompute_function
from keras_gradboost.state import StepFacts

__all__ = [
    "AccumulationCheckError",
    "GradBoostConfig",
    "GradBoostModel",
    "GradCheckResult",
    "JitMeasurement",
    "PrecisionMeasurement",
    "Recompute",
    "RecomputeCheckError",
    "RecomputePlan",
    "StepFacts",
    "TrainPlan",
    "XLAUnsupportedOpError",
    "assert_gradients_close",
    "boost",
    "callbacks",
    "data",
    "gradcheck",
    "launch",
    "ops",
    "recompute_function",
    "tracing",
    "__version__",
]
