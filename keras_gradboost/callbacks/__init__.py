"""Drop-in Keras callbacks for any model."""

from keras_gradboost.callbacks.nan_watcher import NaNEvent
from keras_gradboost.callbacks.nan_watcher import NaNWatcher
from keras_gradboost.callbacks.nan_watcher import NonFiniteError

__all__ = ["NaNEvent", "NaNWatcher", "NonFiniteError"]
