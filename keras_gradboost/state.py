"""Replica-local training state, and the step facts published for callbacks.

Every piece of gradboost state that changes inside the train step lives in a
variable that each replica reads and writes on its own (`ON_READ`
synchronisation). Every replica makes the same updates from all-reduced
decisions, so the copies never drift, and no update needs a `merge_call`,
which TensorFlow forbids inside the branches of a `tf.cond` in replica context.
"""

import tensorflow as tf

from keras_gradboost import hooks


def replica_local_variable(initial_value, name, dtype=None):
    """A non-trainable variable with one local copy per replica.

    Create it under the model's distribution strategy scope. Outside any
    strategy it is an ordinary `tf.Variable`.
    """
    return tf.Variable(
        initial_value,
        dtype=dtype,
        name=name,
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def every_copy(variables, strategy):
    """`(copy, its value now)` for every copy of each Keras variable, to
    assign back later: under MirroredStrategy one per replica.

    Statistics a layer updates in replica context (BatchNormalization's)
    differ between the copies, and `v.numpy()` (or `get_weights()`) reads
    the first only: assigned back, it would overwrite every replica's copy
    with the first replica's.
    """
    with hooks.autocast(None):  # the stored values, not cast for a layer
        return [
            (copy, copy.numpy())
            for v in variables
            for copy in strategy.experimental_local_results(v.value)
        ]


class StepFacts:
    """What the last train steps did, for callbacks to read.

    Runtime facts are variables updated inside the step, so reading them costs
    one host sync when the caller chooses, and none otherwise. Trace-time facts
    are plain Python values, set while the step function is traced.

    Attributes:
        last_step_finite: bool variable: whether the last micro-batch's loss
            (and, when gradients are checked, its gradients) were finite.
        skipped_steps: int64 variable: micro-batches whose update was dropped
            because their gradients were not finite, since `compile()`.
        checked_steps: int64 variable: micro-batches whose gradients were
            checked for finiteness, since `compile()`.
        nonfinite_steps: int64 variable: skipped micro-batches that were
            non-finite for real, since `compile()`: all skips without a
            dynamic loss scale; with one, those whose unscaled loss was
            non-finite or that overflowed at the floor scale (the scale's
            ordinary overflows while it searches are not counted).
        rows_seen: int64 variable: samples this replica trained on, since
            `compile()` (under a strategy of several replicas; their
            difference says that a global batch split unevenly).
        none_gradient_variables: tuple of the paths of trainable variables that
            got a `None` gradient when the step was last traced.
        checks_gradients: whether the traced step checks gradients for
            non-finite values (it does when loss scaling is on; set it to `True`
            before training to ask for it without loss scaling, which also
            makes the step skip non-finite updates).
        watch: a `guard.WatchState` the step records each checked step in
            (and whose halt flag drops updates), or `None`. `NaNWatcher` sets
            it for the duration of `fit` (`GradBoostModel.attach_watch`).
    """

    def __init__(self):
        self.last_step_finite = replica_local_variable(
            True, "last_step_finite", tf.bool
        )
        self.skipped_steps = replica_local_variable(0, "skipped_steps", tf.int64)
        self.checked_steps = replica_local_variable(0, "checked_steps", tf.int64)
        self.nonfinite_steps = replica_local_variable(0, "nonfinite_steps", tf.int64)
        self.rows_seen = replica_local_variable(0, "rows_seen", tf.int64)
        self.none_gradient_variables = ()
        self.checks_gradients = False
        self.watch = None

    def read(self):
        """A plain-Python snapshot (one host sync)."""
        return {
            "last_step_finite": bool(self.last_step_finite.numpy()),
            "skipped_steps": int(self.skipped_steps.numpy()),
            "checked_steps": int(self.checked_steps.numpy()),
            "nonfinite_steps": int(self.nonfinite_steps.numpy()),
            "none_gradient_variables": tuple(self.none_gradient_variables),
            "checks_gradients": self.checks_gradients,
        }
