"""In-graph guards: finiteness of a step, and updates applied only when a
decision shared by all replicas says so.

A `tf.cond` whose branch calls the optimizer must run in cross-replica
context: the optimizer's all-reduce uses `merge_call`, which TensorFlow
forbids inside a `tf.cond` branch in replica context.
"""

import tensorflow as tf


def nonfinite_indicator(loss, grads):
    """1.0 if the loss or any gradient has a non-finite value, else 0.0."""
    checks = [tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None]
    if loss is not None:
        checks.append(tf.reduce_all(tf.math.is_finite(loss)))
    if not checks:
        return tf.constant(0.0)
    finite = tf.reduce_all(tf.stack(checks))
    return tf.cast(tf.logical_not(finite), tf.float32)


def with_nones(present, mask):
    """Puts `None` back where `mask` is False: the inverse of dropping the
    `None` gradients (which cannot cross a `merge_call`)."""
    it = iter(present)
    return [next(it) if m else None for m in mask]


def sum_over_replicas(strategy, value):
    """Sum of a per-replica scalar, in cross-replica context, with local ops
    (no collective: this process holds every replica of a MirroredStrategy;
    a multi-worker strategy will need a cross-worker reduce here)."""
    return tf.add_n(list(strategy.experimental_local_results(value)))


def local_value(value, strategy):
    """The first replica's copy of a value handed to a `merge_call` function."""
    return strategy.experimental_local_results(value)[0]


def guard_optimizer(optimizer, counter):
    """Makes `optimizer.apply_gradients` skip non-finite gradients in-graph.

    For models whose train step is Keras' own: the gradients reach the
    optimizer, which is where a non-finite update can still be stopped. Every
    skipped call adds 1 to `counter` (an int64 variable). Returns a function
    that undoes the wrapping.
    """
    original = optimizer.apply_gradients

    def apply_gradients(grads_and_vars):
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        mask = [g is not None for g, _ in pairs]
        present = [g for g, _ in pairs if g is not None]
        bad = nonfinite_indicator(None, present)

        def merge_fn(strategy, bad, present):
            finite = tf.equal(sum_over_replicas(strategy, bad), 0.0)
            counter.assign_add(tf.cast(tf.logical_not(finite), tf.int64))

            def apply_replica(grads):
                original(zip(with_nones(grads, mask), variables))

            def apply():
                strategy.extended.call_for_each_replica(apply_replica, args=(present,))

            tf.cond(finite, apply, lambda: None)

        tf.distribute.get_replica_context().merge_call(merge_fn, args=(bad, present))
        return optimizer.iterations

    optimizer.apply_gradients = apply_gradients

    def undo():
        del optimizer.apply_gradients

    return undo
