"""In-graph guards: the finiteness of a step (`nonfinite_indicator`), the
optimizer guard for plain Keras models (`guard_optimizer`, and the
`LossTap` that shows it the loss) and a
`NaNWatcher`'s watch state (`WatchState`). The decision shared by all
replicas, and the update it allows, is `step.CrossReplicaStep`.
"""

import threading

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost import wrappers
from keras_gradboost.step import CrossReplicaStep
from keras_gradboost.step import when


def nonfinite_indicator(loss, grads):
    """1.0 if the loss or any gradient has a non-finite value, else 0.0.

    One pass over each tensor and no boolean temporaries: a sum is finite
    when every element is (NaN and inf propagate; +inf + -inf is NaN). Only
    when some sum is not finite (which finite elements can also cause, by
    overflowing the sum) does the exact element-wise check decide, so the
    answer is exact and good steps pay for the sums alone. `IndexedSlices`
    are checked on their values.
    """
    tensors = [gradient_values(g) for g in grads if g is not None]
    if loss is not None:
        tensors.append(tf.convert_to_tensor(loss))
    if not tensors:
        return tf.constant(0.0)
    sums = tf.stack([tf.cast(tf.reduce_sum(t), tf.float32) for t in tensors])

    def exact():
        finite = tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])
        return tf.cast(tf.logical_not(tf.reduce_all(finite)), tf.float32)

    return tf.cond(
        tf.reduce_all(tf.math.is_finite(sums)), lambda: tf.constant(0.0), exact
    )


def gradient_values(gradient):
    """The values of a gradient: those of an `IndexedSlices` (a sparse
    gradient, e.g. of an embedding), or the tensor itself."""
    if isinstance(gradient, tf.IndexedSlices):
        return gradient.values
    return gradient


def gradient_array(gradient, dtype=None):
    """A gradient as a NumPy array, an `IndexedSlices` (a sparse gradient,
    e.g. of an embedding) densified first."""
    return np.asarray(tf.convert_to_tensor(gradient), dtype)


def guard_optimizer(optimizer, counter=None, watch=None, losses=None, states=None):
    """Makes `optimizer.apply` skip non-finite gradients in-graph.

    For models whose train step is Keras' own, or a custom one that calls
    `optimizer.apply_gradients` or `optimizer.apply`: the gradients reach
    `apply`, which is where a non-finite update can still be stopped. Every
    skipped call adds 1 to `counter` (an int64 variable), if given. With a
    `WatchState`, every call is recorded in it, and an update is also
    dropped while it is halted. With a `LossTap` (`losses`), the loss it
    holds for this step is judged too: a non-finite loss whose gradients are
    finite (a NaN prediction that a clipped cross-entropy turns into zero
    gradients) is a non-finite step. With a `StateTap` (`states`), a dropped
    step also puts back the model's state as the step found it (the moving
    statistics its forward pass wrote). Returns a function that undoes the
    wrapping (a `wrappers.patch`: it stacks with other wrappers of `apply`).
    """

    def apply(original, grads, trainable_variables=None):
        grads = list(grads)
        variables = (
            hooks.optimizer_trainable_variables(optimizer)
            if trainable_variables is None
            else list(trainable_variables)
        )
        mask = [g is not None for g in grads]
        present = [g for g in grads if g is not None]
        loss = losses.take() if losses is not None else None
        bad = nonfinite_indicator(loss, present)
        step = CrossReplicaStep(
            lambda g: original(g, variables), mask, watch=watch, counter=counter,
            optimizer=optimizer,
        )
        state = states.take() if states is not None else None
        dropped = step(present, bad=bad, state=state)
        if states is not None:
            states.dropped(dropped)

    return wrappers.patch(optimizer, "apply", apply)


class StepState:
    """A model's float non-trainable variables and their values when a step
    began: what its forward pass writes besides the optimizer
    (BatchNormalization's moving statistics, a layer's running averages, a
    stateful RNN's states: `hooks.untracked_state`). A
    step dropped as non-finite puts them back (`step.CrossReplicaStep`), so
    a bad batch leaves no NaN in them. Integer state (a seed generator's)
    goes on, as after a good step.

    Its metrics' variables too (the loss tracker, compiled metrics, a
    layer's own trackers), which Keras updates after the optimizer: they go
    back at the end of the step (`settle`), so the epoch's logs and History
    (and callbacks reading them: `TerminateOnNaN`, `EarlyStopping`,
    `ModelCheckpoint(save_best_only=True)`) are those of the steps applied.
    """

    def __init__(self, variables, values, metric_variables=(), metric_values=()):
        self.variables = list(variables)
        self.values = list(values)
        self.metric_variables = list(metric_variables)
        self.metric_values = list(metric_values)

    @classmethod
    def take(cls, model):
        """The state of `model` now (reads in the step's graph), or None
        when it has none."""
        variables = [
            v
            for v in hooks.forward_state(model, metrics=False)
            if tf.as_dtype(v.dtype).is_floating
        ]
        metrics = list(model.metrics_variables)
        for metric in hooks.compiled_metric_objects(model):  # not listed before built
            metrics += metric.variables
        metrics = list({id(v): v for v in metrics}.values())
        if not variables and not metrics:
            return None
        with hooks.autocast(None):  # as stored, not cast for the layer
            return cls(
                variables,
                [tf.identity(v.value) for v in variables],
                metrics,
                [tf.identity(v.value) for v in metrics],
            )


def settle(model, state, dropped, logs):
    """The end of a train step (replica context): when its update was
    `dropped` (a bool tensor from `step.CrossReplicaStep`; None: nothing
    was checked), its metrics go back to `state`'s (`StepState`; a metric
    Keras built inside the step, which `state` does not hold, is reset).

    The entries of `logs` that are the model's metric results (named as
    `model.get_metrics_result()` names them, and holding its value at the
    step's end) are then read again: the running values of the steps
    applied (a NaN batch's loss would otherwise stay in the epoch's mean);
    NaN where no step of the epoch has been applied yet (a mean of nothing,
    not Keras' reset value 0.0). Other entries keep the step's own value: a
    raw batch loss an own step logs as "loss", or a tracker logged under
    another name (keras.io's VAE logs its "total_loss" as "loss"; the
    tracker went back all the same, so the later steps' logs leave the
    dropped one out). A step not dropped keeps its logs.

    Returns the logs."""
    if state is None or dropped is None:
        return logs
    saved = {id(v) for v in state.metric_variables}
    flat = _flat_metrics(model)
    built_here = [m for m in flat if any(id(v) not in saved for v in m.variables)]
    if not state.metric_variables and not built_here:
        return logs
    if not _replica_local(state.metric_variables):
        return logs

    def put_back():
        with hooks.autocast(None):
            for variable, value in zip(state.metric_variables, state.metric_values):
                variable.assign(value)
        for metric in built_here:
            metric.reset_state()

    is_dict = isinstance(logs, dict)
    # What the metrics say at the step's end, before the put-back: an entry
    # of `logs` holding this value under a metric's name is that metric's
    # result (a raw batch loss logged as "loss" is not, and stays).
    before = model.get_metrics_result() if is_dict else {}
    means = [m for m in flat if isinstance(m, keras.metrics.Mean)]
    # (tf.identity reads now: tf.cast of a float32 variable is the variable.)
    counts_before = [tf.identity(m.count.value) for m in means] if is_dict else []
    when(dropped, put_back)
    if not is_dict:
        return logs
    fresh = model.get_metrics_result()  # read after the put-back (the same variables)
    # Whether a step of the epoch has been applied: a mean the steps update
    # (its count at the step's end > 0) still counts one after the put-back.
    applied = tf.constant(True)
    if counts_before:
        updated = tf.stack([tf.cast(c, tf.float32) > 0 for c in counts_before])
        after = tf.stack([tf.cast(tf.identity(m.count.value), tf.float32) > 0 for m in means])
        applied = tf.logical_or(
            tf.reduce_any(tf.logical_and(updated, after)), tf.logical_not(tf.reduce_any(updated))
        )
    return {
        name: _reread(dropped, applied, before[name], fresh[name], value)
        if name in fresh and name in before
        else value
        for name, value in logs.items()
    }


def _replica_local(variables):
    """Whether a replica's step can assign `variables` inside a `tf.cond`:
    one replica, or each replica its own copy (synchronization ON_READ, as
    Keras 3.15 makes metric variables). A mirrored one (Keras 3.8's metric
    variables under a strategy) needs a `merge_call`, which TensorFlow
    forbids there; its metrics keep the dropped step (the NaN shows)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return True
    on_read = tf.VariableSynchronization.ON_READ
    return all(getattr(v.value, "synchronization", on_read) == on_read for v in variables)


def _flat_metrics(model):
    """`model.metrics`, with a container of compiled metrics replaced by
    its metrics."""
    flat = []
    for metric in model.metrics:
        inner = getattr(metric, "metrics", None)
        flat.extend(inner if isinstance(inner, list) and inner else [metric])
    return flat


def _reread(dropped, applied, before, again, value):
    """`value`, or on a dropped step where it is the metric's result
    (`before`, read at the step's end), `again` (NaN before any applied
    step); `value` itself where the two cannot be compared (not a float
    tensor of the metric's shape)."""
    if isinstance(value, (keras.Variable, tf.Variable)):
        # A metric whose result is its variable (`keras.metrics.Sum`): read
        # when the logs are, after the put-back.
        return value
    if not tf.is_tensor(value) or not value.dtype.is_floating:
        return value
    before, again = tf.convert_to_tensor(before), tf.convert_to_tensor(again)
    if not (again.shape.is_compatible_with(value.shape) and before.dtype.is_floating):
        return value
    before, again = tf.cast(before, value.dtype), tf.cast(again, value.dtype)
    same = tf.reduce_all(
        tf.logical_or(
            tf.equal(before, value),
            tf.logical_and(tf.math.is_nan(before), tf.math.is_nan(value)),
        )
    )
    again = tf.where(applied, again, tf.constant(float("nan"), value.dtype))
    return tf.where(tf.logical_and(dropped, same), again, value)


class StateTap:
    """The `StepState` of the step being run, from the start of
    `model.train_step` (before its forward pass) to the optimizer guard.
    Per thread, as `LossTap`; a state from another graph is not taken."""

    def __init__(self):
        self._local = threading.local()

    def tap(self, model):
        """Wraps `model.train_step`; returns the undo. The step's metrics go
        back at its end when an update of it was dropped (`settle`)."""

        def train_step(below, *args, **kwargs):
            self.put(model)
            return self.settle(model, below(*args, **kwargs))

        return wrappers.patch(model, "train_step", train_step)

    def put(self, model):
        """Takes `model`'s state now, at the start of this thread's step."""
        self._local.state = self._local.started = StepState.take(model)
        self._local.dropped = []

    def dropped(self, dropped):
        """Records whether an update of this thread's step was dropped (a
        bool tensor, or None when nothing was checked)."""
        if dropped is not None and getattr(self._local, "started", None) is not None:
            self._local.dropped.append(dropped)

    def settle(self, model, logs):
        """`settle` for this thread's step: its metrics back if an update
        was dropped; then forgets the step. An update made inside a
        `tf.cond` branch of the step (its decision not readable at the
        step's end) leaves the metrics as they are."""
        state = getattr(self._local, "started", None)
        dropped = getattr(self._local, "dropped", None) or []
        self._local.started, self._local.dropped = None, []
        if state is None or not dropped:
            return logs
        if not all(_reachable(v) for v in state.metric_values + dropped):
            return logs
        either = dropped[0] if len(dropped) == 1 else tf.reduce_any(tf.stack(dropped))
        return settle(model, state, either, logs)

    def peek(self):
        """The state taken at the start of this thread's step (kept for
        the step's other updates), or None."""
        state = getattr(self._local, "state", None)
        if state is None or not all(_reachable(v) for v in state.values):
            return None
        return state

    def take(self):
        """The state taken at the start of this thread's step, or None."""
        state = self.peek()
        self._local.state = None
        return state


class LossTap:
    """The loss of the step being run, from `model.compute_loss` to the
    optimizer guard, which sees only gradients.

    `tap(model)` wraps `model.compute_loss` (undoably) so each loss it
    returns is put here; `take()` hands the last one to the guard, once.
    Per thread: MirroredStrategy traces each replica in its own thread, and
    each replica's guard must judge its own loss. A loss from another graph
    (a train step that applies gradients outside the function that computed
    the loss) is not taken: the guard judges the gradients alone then.
    """

    def __init__(self):
        self._local = threading.local()

    def tap(self, model):
        """Wraps `model.compute_loss`; returns the undo."""

        def compute_loss(below, *args, **kwargs):
            loss = below(*args, **kwargs)
            self._local.loss = loss
            return loss

        return wrappers.patch(model, "compute_loss", compute_loss)

    def take(self):
        """The last loss of this thread's step (then forgotten), or None."""
        loss = getattr(self._local, "loss", None)
        self._local.loss = None
        if loss is None or not _reachable(loss):
            return None
        return loss


def _reachable(tensor):
    """Whether `tensor` can be used where the code runs now: eagerly, an
    eager tensor; in a graph, a tensor of this graph or of one it is nested
    in (a `tf.cond` branch or loop body captures those)."""
    if tf.executing_eagerly():
        return not tf.is_symbolic_tensor(tensor)
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if getattr(tensor, "graph", None) is graph:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


class WatchState:
    """The in-graph state of a `NaNWatcher`: what the step records about
    non-finite steps, so the callback can read it late without losing
    anything.

    Every variable is replica-local (see `state.replica_local_variable`);
    every replica makes the same updates from all-reduced decisions. Create
    it under the model's distribution strategy scope.

    A train step may record several updates (a custom `train_step` calling
    `GradBoostModel.minimize()` once per optimizer): the step counts once,
    when it `advance()`s, and is non-finite once if any of them is.

    Attributes:
        step: int64, steps run since `reset()`.
        count: int64, non-finite steps since `reset()`.
        consecutive: int64, non-finite steps in a row before this step (a
            finite step resets it).
        bad_now: bool, this step recorded a non-finite update.
        finite_now: bool, every update this step recorded was finite.
        halted: bool; while set, every step's update is dropped, finite or
            not. A non-finite step sets it when `halt_every` is true, or when
            it makes `max_in_row` non-finite steps in a row.
        bad_steps: int64 vector (a ring of `ring` entries): the step index of
            non-finite step number `c` is at `c % ring`.
        bad_runs: int64 vector: the `consecutive` value of the same step.
    """

    def __init__(self, ring, halt_every, max_in_row=None):
        from keras_gradboost.state import replica_local_variable

        self.ring = int(ring)
        self.halt_every = bool(halt_every)
        self.max_in_row = max_in_row
        self.step = replica_local_variable(0, "nan_watch_step", tf.int64)
        self.count = replica_local_variable(0, "nan_watch_count", tf.int64)
        self.consecutive = replica_local_variable(0, "nan_watch_in_row", tf.int64)
        self.halted = replica_local_variable(False, "nan_watch_halted", tf.bool)
        self.bad_now = replica_local_variable(False, "nan_watch_bad_now", tf.bool)
        self.finite_now = replica_local_variable(True, "nan_watch_finite_now", tf.bool)
        self.bad_steps = replica_local_variable(
            tf.fill([self.ring], tf.constant(-1, tf.int64)), "nan_watch_bad_steps"
        )
        self.bad_runs = replica_local_variable(
            tf.zeros([self.ring], tf.int64), "nan_watch_bad_runs"
        )

    def reset(self):
        """Zeroes everything (eagerly; once per `fit`)."""
        self.step.assign(0)
        self.count.assign(0)
        self.consecutive.assign(0)
        self.halted.assign(False)
        self.bad_now.assign(False)
        self.finite_now.assign(True)
        self.bad_steps.assign(tf.fill([self.ring], tf.constant(-1, tf.int64)))
        self.bad_runs.assign(tf.zeros([self.ring], tf.int64))

    def record(self, bad, finite, advance=True):
        """Records one update of this step; returns whether it may be
        applied.

        Runs in replica context, once per replica, with the same (all-reduced)
        `bad` (a non-finite step, a bool) and `finite` (the step's update is
        finite, a bool; it differs from `not bad` only for a dynamic loss
        scale's own overflows). `advance=False` leaves the step open for
        more updates: its owner calls `advance()` once they are recorded.
        """
        bad = tf.convert_to_tensor(bad)
        finite = tf.convert_to_tensor(finite)
        seen = self.bad_now.read_value()
        first_bad = tf.logical_and(bad, tf.logical_not(seen))
        in_row = self.consecutive + 1  # this step's run, if it is bad
        slot = tf.logical_and(
            first_bad,
            tf.equal(tf.range(self.ring, dtype=tf.int64), self.count % self.ring),
        )
        self.bad_steps.assign(tf.where(slot, self.step.read_value(), self.bad_steps))
        self.bad_runs.assign(tf.where(slot, in_row, self.bad_runs))
        engage = tf.constant(self.halt_every)
        if self.max_in_row is not None:
            engage = tf.logical_or(engage, in_row >= self.max_in_row)
        halted = tf.logical_or(self.halted.read_value(), tf.logical_and(bad, engage))
        self.halted.assign(halted)
        self.count.assign_add(tf.cast(first_bad, tf.int64))
        self.bad_now.assign(tf.logical_or(seen, bad))
        self.finite_now.assign(tf.logical_and(self.finite_now.read_value(), finite))
        if advance:
            self.advance()
        return tf.logical_and(finite, tf.logical_not(halted))

    def advance(self):
        """Closes this step (replica context): the next update recorded is
        the next step's. A bad step lengthens the run of bad steps, a finite
        one ends it (a dynamic loss scale's own overflow does neither)."""
        bad = self.bad_now.read_value()
        self.consecutive.assign(
            tf.where(
                bad,
                self.consecutive + 1,
                tf.where(
                    self.finite_now.read_value(),
                    tf.constant(0, tf.int64),
                    self.consecutive.read_value(),
                ),
            )
        )
        self.step.assign_add(1)
        self.bad_now.assign(False)
        self.finite_now.assign(True)
