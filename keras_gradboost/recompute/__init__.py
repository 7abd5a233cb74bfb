"""Block-level activation recompute (gradient checkpointing), one module per
idea:

* `mechanism`: `recomputed(fn, state)`, the custom gradient that runs a
  block's forward again in its backward, and `mark(layer)`, the dispatcher
  that lets a layer recompute inside `active(...)`;
* `choice`: which blocks a `recompute` setting names (patterns, "auto", the
  budget's candidates, graph segments between cut points);
* `estimates`: what each block keeps for the backward pass, and the
  `RecomputePlan` that reports them;
* `budget`: the plans a `{"budget_mb": N}` setting chooses among (auto's
  among them, recomputing nothing too), and its choice;
* `setup`: `RecomputeSetup`, a model's setting turned into blocks, its
  training forward, and when each decision is made;
* `check`: `recompute_check=True`, gradients with and without each block
  recomputed must agree (`RecomputeCheckError`);
* `decorator`: `Recompute(layer)` and `recompute_function(fn)`, the mechanism for a
  user's own block or training loop.
"""

from keras_gradboost.recompute.budget import Candidate
from keras_gradboost.recompute.budget import auto_choice
from keras_gradboost.recompute.budget import budget_choice
from keras_gradboost.recompute.budget import candidates
from keras_gradboost.recompute.budget import estimated_peak
from keras_gradboost.recompute.budget import groups_of
from keras_gradboost.recompute.budget import merge
from keras_gradboost.recompute.check import RecomputeCheckError
from keras_gradboost.recompute.choice import Segment
from keras_gradboost.recompute.decorator import Recompute
from keras_gradboost.recompute.decorator import recompute_function
from keras_gradboost.recompute.choice import auto_layer_blocks
from keras_gradboost.recompute.choice import budget_candidates
from keras_gradboost.recompute.choice import choose
from keras_gradboost.recompute.choice import cut_points
from keras_gradboost.recompute.choice import match_blocks
from keras_gradboost.recompute.choice import nested_blocks
from keras_gradboost.recompute.choice import segment_layouts
from keras_gradboost.recompute.choice import search_families
from keras_gradboost.recompute.choice import segments
from keras_gradboost.recompute.estimates import MIB
from keras_gradboost.recompute.estimates import BlockEstimate
from keras_gradboost.recompute.estimates import RecomputePlan
from keras_gradboost.recompute.estimates import estimate
from keras_gradboost.recompute.estimates import plan_bytes
from keras_gradboost.recompute.estimates import plan_layout
from keras_gradboost.recompute.estimates import selective_plan_bytes
from keras_gradboost.recompute.mechanism import active
from keras_gradboost.recompute.mechanism import is_marked
from keras_gradboost.recompute.mechanism import mark
from keras_gradboost.recompute.mechanism import probing
from keras_gradboost.recompute.mechanism import recomputed
from keras_gradboost.recompute.mechanism import snapshot
from keras_gradboost.recompute.mechanism import state_variables
from keras_gradboost.recompute.setup import AUTO_SLACK
from keras_gradboost.recompute.setup import RecomputeSetup
from keras_gradboost.recompute.setup import batch_size_hint
