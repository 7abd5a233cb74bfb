"""Drop-in Keras callbacks for any model."""

from keras_gradboost.callbacks.backup import BackupAndRestore
from keras_gradboost.callbacks.gradient_audit import AuditReport
from keras_gradboost.callbacks.gradient_audit import GradientAuditor
from keras_gradboost.callbacks.gradient_audit import MissingGradient
from keras_gradboost.callbacks.gradient_audit import MissingGradientError
from keras_gradboost.callbacks.nan_watcher import NaNEvent
from keras_gradboost.callbacks.nan_watcher import NaNReport
from keras_gradboost.callbacks.nan_watcher import NaNWatcher
from keras_gradboost.callbacks.nan_watcher import NonFiniteError
from keras_gradboost.callbacks.retrace import RetraceCounter
from keras_gradboost.callbacks.retrace import RetraceError
from keras_gradboost.callbacks.retrace import RetraceEvent
from keras_gradboost.callbacks.retrace import RetraceReport
from keras_gradboost.callbacks.step_time import StepSplit
from keras_gradboost.callbacks.step_time import StepTimeMonitor
from keras_gradboost.callbacks.step_time import StepTimeReport

__all__ = [
    "AuditReport",
    "BackupAndRestore",
    "GradientAuditor",
    "MissingGradient",
    "MissingGradientError",
    "NaNEvent",
    "NaNReport",
    "NaNWatcher",
    "NonFiniteError",
    "RetraceCounter",
    "RetraceError",
    "RetraceEvent",
    "RetraceReport",
    "StepSplit",
    "StepTimeMonitor",
    "StepTimeReport",
]
