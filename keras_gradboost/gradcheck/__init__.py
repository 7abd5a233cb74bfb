"""Gradient checking, shape-strict: `gradcheck(fn, *inputs)` and
`assert_gradients_close(fn, *inputs)`.

* `target`: the function or layer, its gradient sources, and how each kind
  of derivative is run (reverse, forward, float64 re-run);
* `numeric`: central differences, steps per dtype, tolerances;
* `result`: `GradCheckResult` and `SourceCheck`;
* `check`: the checks themselves.
"""

from keras_gradboost.gradcheck.check import assert_gradients_close
from keras_gradboost.gradcheck.check import gradcheck
from keras_gradboost.gradcheck.result import GradCheckResult
from keras_gradboost.gradcheck.result import SourceCheck
