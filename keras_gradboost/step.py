"""The cross-replica part of a training step, written once.

Each replica computes its gradients and a 0/1 "not finite" indicator; then,
in one `merge_call`, `CrossReplicaStep` decides for all replicas at once:

1. finiteness over every replica (`all_finite`);
2. record: the step facts, the dynamic loss scale and a `NaNWatcher`'s watch
   (which may halt updates), each replica updating its own replica-local
   copy with the same all-reduced values (`record`);
3. apply the update, or add the micro-batch to the accumulation window and
   apply the window's update when it is due (`apply_window`).

`GradBoostModel.train_step` and the optimizer guard that `NaNWatcher` puts
on a plain Keras model (`guard.guard_optimizer`) both run this. Supporting
another distribution strategy is a change here: the reductions over
replicas are `sum_over_replicas` (over every worker too) and `local_value`
(this worker's first replica: every replica holds the same value).

The `tf.cond`s run in cross-replica context, where their branches may call
the optimizer (whose all-reduce uses `merge_call`, which TensorFlow forbids
inside a `tf.cond` branch in replica context).
"""

import contextlib

import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost import precision as precision_lib
from keras_gradboost import wrappers


def sum_over_replicas(strategy, value):
    """Sum of a per-replica scalar over every replica of every worker, in
    cross-replica context: with local ops when this process holds every
    replica (one device, MirroredStrategy: no collective), with one
    cross-worker all-reduce under MultiWorkerMirroredStrategy (each worker
    gets the same sum)."""
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
    return tf.add_n(list(strategy.experimental_local_results(value)))


def local_value(value, strategy):
    """The first replica's copy of a value handed to a `merge_call` function
    (every replica holds the same one)."""
    return strategy.experimental_local_results(value)[0]


def all_finite(strategy, indicator):
    """Whether no replica's 0/1 "not finite" indicator is set."""
    return tf.equal(sum_over_replicas(strategy, indicator), 0.0)


def with_nones(present, mask):
    """Puts `None` back where `mask` is False: the inverse of dropping the
    `None` gradients (which cannot cross a `merge_call`)."""
    it = iter(present)
    return [next(it) if m else None for m in mask]


def _nothing():
    return None


def when(go, fn):
    """Runs `fn()` if `go` (a bool tensor) is true; always when `go` is
    None (nothing was checked)."""
    if go is None:
        fn()
        return

    def run():
        fn()  # returns nothing: tf.cond's branches must match

    tf.cond(go, run, _nothing)


@contextlib.contextmanager
def updates_in_turn(optimizer):
    """Within it, each variable's update by `optimizer` (its `update_step`,
    or its `inner_optimizer`'s: a `LossScaleOptimizer`) waits until the
    previous one has written its variable.

    For an update whose gradients are all ready at once (after the step's
    finiteness check): TensorFlow's
    executor would start every update's first operation together, and
    their temporaries would pile up on top of the gradients. Measured on
    ResNet50 (64x64, batch 16, Adam, `recompute="auto"`, a NaNWatcher):
    167.0-190.0 MiB requested without, 139.9-144.4 with. It costs the
    updates' overlap: 1.01x step time on the MLP of
    `benchmarks/bench_nan_watcher.py` (2 CPU cores). Only the order
    changes, not a value. Not for an update applied as its gradients
    arrive: the first variable's gradient comes last, and every update
    would wait for it. Nor for an accumulation window's (`apply_window`).
    Each update waits for the previous variable's write: an optimizer
    that writes a slot after its variable (Keras' `Lion`) overlaps that
    write with the next update. An optimizer that never calls
    `update_step` (one overriding `apply`), and XLA (`jit_compile=True`),
    which schedules on its own, run as before.
    """
    # Per graph (a tf.cond's branches are graphs of their own) and device
    # (under a distribution strategy each replica's copies update apart).
    last = {}

    def in_turn(below, gradient, variable, *args, **kwargs):
        if tf.executing_eagerly():  # run_eagerly: one op after the other anyway
            return below(gradient, variable, *args, **kwargs)
        key = (tf.compat.v1.get_default_graph(), getattr(variable, "device", None))
        with tf.control_dependencies(last.get(key, [])):
            result = below(gradient, variable, *args, **kwargs)
        # An op on the variable made after the update's writes in the
        # program, so run after them; unlike a read it never copies the
        # value (a variable a sparse update wrote copies on each read).
        last[key] = [tf.raw_ops.VarIsInitializedOp(resource=variable.handle)]
        return result

    undo = []
    try:
        for o in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if o is not None and callable(getattr(o, "update_step", None)):
                undo.append(wrappers.patch(o, "update_step", in_turn))
        yield
    finally:
        for patch in reversed(undo):
            patch()


class CrossReplicaStep:
    """The decision of one training step for all replicas, and its update.

    Args:
        apply: per-replica `apply(grads)`, `grads` with `None` where a
            variable gets no gradient: applies one update.
        grad_mask: for each variable `apply` updates, whether it gets a
            gradient (the `None`s dropped before the `merge_call`).
        facts: a `StepFacts` to record finiteness and skips in, or None.
            Defaults to `None`.
        scaler: the `LossScaler`, updated with each checked step's
            finiteness, or None. Defaults to `None`.
        watch: a `guard.WatchState` recording each checked step (its halt
            flag drops updates), or None. Defaults to `None`.
        counter: an int64 variable counting skipped steps (updated in
            cross-replica context), or None. Defaults to `None`.
        accumulator: a `GradientAccumulator`: the micro-batch is added to
            its window, and the window's update is applied when due. None
            applies every step. Defaults to `None`.
        optimizer: the optimizer `apply` updates with: after a finiteness
            check, where its gradients are all ready at once, its variables
            are updated in turn (`updates_in_turn`). None: as TensorFlow
            schedules them. Defaults to `None`.
    """

    def __init__(
        self, apply, grad_mask, facts=None, scaler=None, watch=None, counter=None,
        accumulator=None, closes_step=True, optimizer=None,
    ):
        # closes_step=False: one of several updates of a train step, whose
        # owner closes the watch's step (`WatchState.advance`) after them.
        self.closes_step = closes_step
        self.apply = apply
        self.grad_mask = list(grad_mask)
        self.facts = facts
        self.scaler = scaler
        self.watch = watch
        self.counter = counter
        self.accumulator = accumulator
        self.optimizer = optimizer

    def __call__(self, present_grads, n=None, bad=None, loss_bad=None, state=None):
        """Runs the step from replica context (one `merge_call`).

        Args:
            present_grads: this replica's gradients, without the `None`s.
            n: this replica's sample count for the accumulation window's
                weighting (`present_grads` already carry the weight), or
                None without a window.
            bad: this replica's 0/1 "not finite" indicator (float32), or
                None when nothing is checked (the update always goes in).
            loss_bad: the same for the loss alone (it tells a dynamic loss
                scale's own overflows from real non-finite steps), or None:
                the same as `bad`.
            state: this replica's `guard.StepState`, taken when its step
                began, or None. A step dropped as non-finite (or while a
                watch halts updates) puts it back: the moving statistics a
                bad batch wrote in the forward pass go too. A dynamic loss
                scale's own overflow keeps it, as Keras' LossScaleOptimizer
                does (the forward pass was finite).

        Returns:
            Whether the step was dropped as non-finite or while a watch
            halts updates (a bool tensor, the same on every replica; a
            dynamic loss scale's own overflow is not), or None when nothing
            is checked. The step's metrics go back on it (`guard.settle`).
        """
        values = () if state is None else tuple(state.values)
        self._state_variables = () if state is None else tuple(state.variables)
        return tf.distribute.get_replica_context().merge_call(
            self._merge, args=(present_grads, n, bad, loss_bad, values)
        )

    def _merge(self, strategy, present, n, bad, loss_bad, state_values=()):
        go, drop = self._decide(strategy, bad, loss_bad)
        each = strategy.extended.call_for_each_replica
        if state_values and drop is not None:
            when(drop, lambda: each(self._put_back, args=(state_values,)))
        if self.accumulator is None:
            # Checked (`go`): every gradient is ready at once.
            checked = go is not None
            with updates_in_turn(self.optimizer) if checked else contextlib.nullcontext():
                when(go, lambda: each(self._apply_present, args=(present,)))
            return drop
        acc = self.accumulator
        when(go, lambda: each(self._add, args=(present, n)))
        due = local_value(each(acc.tick), strategy)
        if self.watch is None:
            tf.cond(due, lambda: self.apply_window(strategy), _nothing)
            return drop
        # A halting bad step discards the window it falls in: the good
        # micro-batches before it are dropped, so no update is applied at or
        # after the bad step, wherever it sits in the window.
        halted = local_value(each(self.watch.halted.read_value), strategy)

        def drop_window():
            each(acc.reset)

        def close_window_if_due():
            tf.cond(due, lambda: self.apply_window(strategy), _nothing)

        tf.cond(halted, drop_window, close_window_if_due)
        return drop

    def decide(self, strategy, bad, loss_bad=None):
        """Cross-replica: whether the update may go in (the same bool on
        every replica), after recording the step; None when nothing is
        checked."""
        return self._decide(strategy, bad, loss_bad)[0]

    def _decide(self, strategy, bad, loss_bad):
        """`decide`, and whether the step's state goes back (None, None when
        nothing is checked)."""
        if bad is None:
            return None, None
        finite = all_finite(strategy, bad)
        loss_finite = finite if loss_bad is None else all_finite(strategy, loss_bad)
        if self.counter is not None:
            self.counter.assign_add(tf.cast(tf.logical_not(finite), tf.int64))
        if self.facts is None and self.scaler is None and self.watch is None:
            return finite, tf.logical_not(finite)
        each = strategy.extended.call_for_each_replica
        go, drop = each(self._record_and_drop, args=(finite, loss_finite))
        return local_value(go, strategy), local_value(drop, strategy)

    def _put_back(self, values):
        """Replica context: this replica's state values back."""
        with hooks.autocast(None):
            for variable, value in zip(self._state_variables, values):
                variable.assign(value)

    def _record_and_drop(self, finite, loss_finite):
        """Replica context: `record`, and whether the step's state goes back:
        its update is dropped, and not for a dynamic loss scale's own
        overflow."""
        # Read before `record` updates the loss scale.
        genuine = self._genuine(finite, loss_finite)
        go = self.record(finite, genuine)
        ordinary_overflow = tf.logical_and(tf.logical_not(finite), tf.logical_not(genuine))
        if self.watch is not None:
            # A halted watch keeps the model as it was: no overflow exception.
            halted = self.watch.halted.read_value()
            ordinary_overflow = tf.logical_and(ordinary_overflow, tf.logical_not(halted))
        return go, tf.logical_and(tf.logical_not(go), tf.logical_not(ordinary_overflow))

    def _genuine(self, finite, loss_finite):
        """Whether a non-finite step is a real one (not a dynamic loss
        scale's normal search)."""
        genuine = tf.logical_not(finite)
        if self.scaler is not None and self.scaler.dynamic:
            # An overflow of the scaled backward pass is the dynamic scale's
            # normal search; only an unscaled non-finite loss, or an overflow
            # at the floor scale, is a real non-finite step.
            genuine = tf.logical_and(
                genuine,
                tf.logical_or(
                    tf.logical_not(loss_finite),
                    self.scaler.scale <= precision_lib.SCALE_FLOOR,
                ),
            )
        return genuine

    def record(self, finite, genuine):
        """Replica context: records one checked step (`genuine`: a real
        non-finite one, see `_genuine`) in this replica's copy of the state;
        returns whether its update may be applied."""
        facts = self.facts
        if facts is not None:
            facts.nonfinite_steps.assign_add(tf.cast(genuine, tf.int64))
        if self.scaler is not None:
            self.scaler.update(finite)
        if facts is not None:
            facts.last_step_finite.assign(finite)
            facts.skipped_steps.assign_add(tf.cast(tf.logical_not(finite), tf.int64))
            facts.checked_steps.assign_add(1)
        if self.watch is None:
            return finite
        return self.watch.record(genuine, finite, advance=self.closes_step)

    def apply_window(self, strategy):
        """Cross-replica: one update from the accumulated gradients, if any
        finite micro-batch was added, then a new window."""
        acc = self.accumulator
        each = strategy.extended.call_for_each_replica
        total = sum_over_replicas(strategy, each(acc.count.read_value))

        def apply_mean(total):
            self.apply(acc.mean_gradients(total))

        # Not in turn: the window's means are made before the updates, and
        # would wait for their turn alive (8 Dense(1024) layers, Adam: 36.0
        # MiB requested in turn, 16.0 at once).
        tf.cond(total > 0, lambda: each(apply_mean, args=(total,)), _nothing)
        each(acc.reset)

    def _apply_present(self, present):
        self.apply(with_nones(present, self.grad_mask))

    def _add(self, present, n):
        self.accumulator.add(with_nones(present, self.grad_mask), n)


def flush_window(strategy, step):
    """Cross-replica: applies the accumulation window of `step` (a
    `CrossReplicaStep` with an accumulator) if it holds micro-batches."""
    acc = step.accumulator
    pending = strategy.extended.call_for_each_replica(
        lambda: acc.micro_step.read_value() > 0
    )
    tf.cond(
        local_value(pending, strategy), lambda: step.apply_window(strategy), _nothing
    )
