"""CrossReplicaStep: the one all-replica decision, record and update."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import shared_mirrored_strategy
from keras_gradboost import guard
from keras_gradboost import step as step_lib
from keras_gradboost import wrappers
from keras_gradboost.accumulate import GradientAccumulator
from keras_gradboost.precision import LossScaler
from keras_gradboost.state import StepFacts


def _var_and_sgd(values=(1.0, 1.0)):
    var = keras.Variable(np.array(values, "float32"))
    optimizer = keras.optimizers.SGD(1.0)
    optimizer.build([var])
    return var, optimizer


def _run(step, grads, n=None, bad=None, loss_bad=None):
    """Runs `step` once; returns what it says of the update: None (nothing
    checked), True (dropped) or False."""

    @tf.function(autograph=False)
    def run():
        def replica():
            g = tf.constant(grads, tf.float32)
            b = None if bad is None else tf.constant(bad, tf.float32)
            lb = None if loss_bad is None else tf.constant(loss_bad, tf.float32)
            dropped = step(
                [g], n=None if n is None else tf.constant(n, tf.float32), bad=b, loss_bad=lb
            )
            return tf.constant(-1) if dropped is None else tf.cast(dropped, tf.int32)

        strategy = tf.distribute.get_strategy()
        return strategy.experimental_local_results(
            strategy.extended.call_for_each_replica(replica)
        )[0]

    return {-1: None, 0: False, 1: True}[int(run())]


def test_with_nones_and_when():
    assert step_lib.with_nones([1, 2], [True, False, True]) == [1, None, 2]
    ran = []
    step_lib.when(None, lambda: ran.append(1))
    step_lib.when(tf.constant(False), lambda: ran.append(2))
    step_lib.when(tf.constant(True), lambda: ran.append(3))
    assert ran == [1, 3]


def test_unchecked_step_always_applies():
    var, optimizer = _var_and_sgd()
    step = step_lib.CrossReplicaStep(lambda g: optimizer.apply(g, [var]), [True])
    assert _run(step, [0.5, 0.25]) is None  # nothing checked: no decision
    np.testing.assert_array_equal(var.numpy(), [0.5, 0.75])


def test_bad_step_is_recorded_and_not_applied_then_good_one_is():
    var, optimizer = _var_and_sgd()
    facts = StepFacts()
    counter = tf.Variable(0, dtype=tf.int64)
    step = step_lib.CrossReplicaStep(
        lambda g: optimizer.apply(g, [var]), [True], facts=facts, counter=counter
    )
    assert _run(step, [np.nan, 1.0], bad=1.0) is True  # dropped: its metrics go back
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0])
    assert facts.read()["skipped_steps"] == 1 and facts.read()["nonfinite_steps"] == 1
    assert int(counter.numpy()) == 1 and not facts.read()["last_step_finite"]
    assert _run(step, [0.5, 0.5], bad=0.0) is False
    np.testing.assert_array_equal(var.numpy(), [0.5, 0.5])
    read = facts.read()
    assert read["checked_steps"] == 2 and read["skipped_steps"] == 1
    assert read["last_step_finite"] and int(counter.numpy()) == 1


def test_dynamic_scale_overflow_is_a_skip_but_not_a_nonfinite_step():
    var, optimizer = _var_and_sgd()
    facts = StepFacts()
    scaler = LossScaler(True, 2.0**15)
    step = step_lib.CrossReplicaStep(
        lambda g: optimizer.apply(g, [var]), [True], facts=facts, scaler=scaler
    )
    # The scaled backward overflowed: skipped, but its state and metrics
    # stay (a finite forward), as Keras' LossScaleOptimizer keeps them.
    assert _run(step, [np.inf, 0.0], bad=1.0, loss_bad=0.0) is False
    assert float(scaler.scale.numpy()) == 2.0**14
    assert facts.read()["skipped_steps"] == 1 and facts.read()["nonfinite_steps"] == 0
    assert _run(step, [np.nan, 0.0], bad=1.0, loss_bad=1.0) is True  # the loss itself
    assert facts.read()["nonfinite_steps"] == 1
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0])


def test_watch_halt_drops_finite_updates():
    var, optimizer = _var_and_sgd()
    watch = guard.WatchState(ring=4, halt_every=True)
    step = step_lib.CrossReplicaStep(lambda g: optimizer.apply(g, [var]), [True], watch=watch)
    assert _run(step, [np.nan, 0.0], bad=1.0) is True
    assert _run(step, [0.5, 0.5], bad=0.0) is True  # finite, but halted: not applied
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0])
    assert int(watch.count.numpy()) == 1 and int(watch.step.numpy()) == 2
    assert list(watch.bad_steps.numpy()[:1]) == [0] and bool(watch.halted.numpy())


def test_accumulated_window_applies_the_sample_weighted_mean_once_due():
    var, optimizer = _var_and_sgd((0.0, 0.0))
    acc = GradientAccumulator([var], steps=2)
    step = step_lib.CrossReplicaStep(
        lambda g: optimizer.apply(g, [var]), [True], accumulator=acc
    )
    # Weighted gradients n * g: a micro-batch of 3 with mean gradient 1, one of
    # 1 with mean gradient 5: the large batch's mean gradient is 2.
    _run(step, [3.0, 3.0], n=3.0, bad=None)
    np.testing.assert_array_equal(var.numpy(), [0.0, 0.0])
    _run(step, [5.0, 5.0], n=1.0, bad=None)
    np.testing.assert_allclose(var.numpy(), [-2.0, -2.0])
    assert int(optimizer.iterations.numpy()) == 1 and int(acc.micro_step.numpy()) == 0


def test_a_bad_micro_batch_is_left_out_of_its_window():
    var, optimizer = _var_and_sgd((0.0, 0.0))
    acc = GradientAccumulator([var], steps=2)
    step = step_lib.CrossReplicaStep(
        lambda g: optimizer.apply(g, [var]), [True], facts=StepFacts(), accumulator=acc
    )
    _run(step, [np.nan, 1.0], n=4.0, bad=1.0)
    _run(step, [2.0, 2.0], n=2.0, bad=0.0)
    np.testing.assert_allclose(var.numpy(), [-1.0, -1.0])


def test_flush_window_applies_a_partial_window_and_nothing_when_empty():
    var, optimizer = _var_and_sgd((0.0, 0.0))
    acc = GradientAccumulator([var], steps=4)
    step = step_lib.CrossReplicaStep(lambda g: optimizer.apply(g, [var]), [True], accumulator=acc)
    _run(step, [6.0, 6.0], n=3.0)
    strategy = tf.distribute.get_strategy()
    flush = tf.function(lambda: step_lib.flush_window(strategy, step), autograph=False)
    flush()
    np.testing.assert_allclose(var.numpy(), [-2.0, -2.0])
    flush()  # an empty window: no update
    np.testing.assert_allclose(var.numpy(), [-2.0, -2.0])
    assert int(optimizer.iterations.numpy()) == 1


@pytest.fixture
def mirrored():
    return shared_mirrored_strategy()


def test_one_bad_replica_stops_the_update_on_every_replica(mirrored):
    with mirrored.scope():
        var = keras.Variable(np.ones(2, "float32"))
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([var])
        facts = StepFacts()
    step = step_lib.CrossReplicaStep(
        lambda g: optimizer.apply(g, [var]), [True], facts=facts
    )

    @tf.function(autograph=False)
    def run(bad_on_second):
        def replica():
            index = tf.distribute.get_replica_context().replica_id_in_sync_group
            bad = tf.cast(tf.logical_and(bad_on_second, tf.equal(index, 1)), tf.float32)
            step([tf.fill([2], 0.25)], bad=bad)

        mirrored.run(replica)

    run(tf.constant(True))
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0])
    skipped = [int(v.numpy()) for v in mirrored.experimental_local_results(facts.skipped_steps)]
    assert skipped == [1, 1]  # both replicas recorded the same decision
    run(tf.constant(False))
    np.testing.assert_allclose(var.numpy(), [0.5, 0.5])  # 0.25 summed over 2 replicas


@pytest.mark.parametrize("bad_at", [0, 1, 2, 3])
def test_a_halting_bad_micro_batch_discards_its_window_wherever_it_sits(bad_at):
    # Window of 4, bad micro-batch at `bad_at`, then good ones: no update at
    # or after the bad one (the window's good micro-batches are dropped).
    var, optimizer = _var_and_sgd((0.0, 0.0))
    acc = GradientAccumulator([var], steps=4)
    watch = guard.WatchState(ring=4, halt_every=True)
    step = step_lib.CrossReplicaStep(
        lambda g: optimizer.apply(g, [var]), [True], facts=StepFacts(), watch=watch,
        accumulator=acc,
    )
    for i in range(8):
        bad = float(i == bad_at)
        _run(step, [np.nan if bad else 1.0, 1.0], n=1.0, bad=bad)
    assert int(optimizer.iterations.numpy()) == 0
    np.testing.assert_array_equal(var.numpy(), [0.0, 0.0])
    assert int(acc.micro_step.numpy()) == 0 and float(acc.count.numpy()) == 0.0
    strategy = tf.distribute.get_strategy()
    tf.function(lambda: step_lib.flush_window(strategy, step), autograph=False)()
    assert int(optimizer.iterations.numpy()) == 0  # nothing left to flush


def test_a_window_closed_before_the_halt_is_applied():
    var, optimizer = _var_and_sgd((0.0, 0.0))
    acc = GradientAccumulator([var], steps=2)
    watch = guard.WatchState(ring=4, halt_every=True)
    step = step_lib.CrossReplicaStep(
        lambda g: optimizer.apply(g, [var]), [True], facts=StepFacts(), watch=watch,
        accumulator=acc,
    )
    for i, bad in enumerate([0.0, 0.0, 0.0, 1.0, 0.0]):
        _run(step, [np.nan if bad else 1.0, 1.0], n=1.0, bad=bad)
    assert int(optimizer.iterations.numpy()) == 1  # micro-batches 0 and 1 only
    np.testing.assert_allclose(var.numpy(), [-1.0, -1.0])


@pytest.mark.parametrize("scaled", [False, True])
def test_updates_in_turn_orders_the_updates_and_changes_no_value(scaled):
    # After a check, every gradient is ready at once: in turn, each
    # variable's update waits for the previous variable's write (its ops
    # hold a control input on a read made after it), so their temporaries
    # do not pile up. The values are those of the plain update.
    grads = [tf.constant(np.arange(4.0) * (i + 1), tf.float32) for i in range(3)]

    def variables_and_optimizer():
        variables = [keras.Variable(np.full((4,), i + 1.0, "float32")) for i in range(3)]
        optimizer = keras.optimizers.Adam(0.1)
        if scaled:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(variables)
        return variables, optimizer

    plain_variables, plain = variables_and_optimizer()
    tf.function(lambda: plain.apply(grads, plain_variables))()
    variables, optimizer = variables_and_optimizer()
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    waits = []

    def spy(below, *args):
        # Its first operation, made where the update's are: does it wait?
        waits.append(bool(tf.no_op().control_inputs))
        return below(*args)

    undo_spy = wrappers.patch(inner, "update_step", spy)

    @tf.function
    def in_turn():
        with step_lib.updates_in_turn(optimizer):
            optimizer.apply(grads, variables)

    graph = in_turn.get_concrete_function().graph
    in_turn()
    undo_spy()
    for a, b in zip(plain_variables, variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert waits == [False, True, True]  # the first update waits for nothing
    if not scaled:  # (the scaled update runs in a tf.cond branch's graph)
        # What the next update waits for runs after its variable's write.
        tokens = [op for op in graph.get_operations() if op.type == "VarIsInitializedOp"]
        assert len(tokens) == 3
        for token in tokens:
            writes = [c for c in token.control_inputs if c.type.startswith("Assign")]
            assert any(w.inputs[0] is token.inputs[0] for w in writes), token.control_inputs
    for o in (optimizer, inner):
        assert "update_step" not in vars(o)  # the wrapping is undone


def test_updates_in_turn_chain_each_replicas_copies_apart(mirrored):
    # Under a strategy, each variable's update runs per device, on its
    # copy there: each device's updates wait for that device's previous
    # write only (waiting across devices would serialize the replicas).
    with mirrored.scope():
        variables = [keras.Variable(np.full((4,), i + 1.0, "float32")) for i in range(3)]
        optimizer = keras.optimizers.Adam(0.1)
        optimizer.build(variables)
    step = step_lib.CrossReplicaStep(
        lambda g: optimizer.apply(g, variables), [True] * 3, optimizer=optimizer
    )
    waits = []

    def spy(below, gradient, variable, *args):
        waits.append((variable.device, [c.device for c in tf.no_op().control_inputs]))
        return below(gradient, variable, *args)

    undo_spy = wrappers.patch(optimizer, "update_step", spy)

    @tf.function(autograph=False)
    def run():
        mirrored.run(lambda: step([tf.fill([4], 0.5)] * 3, bad=tf.constant(0.0)))

    try:
        run()
    finally:
        undo_spy()
    devices = sorted({device for device, _ in waits})
    assert len(devices) == 2 and len(waits) == 6, waits
    for device in devices:
        mine = [inputs for d, inputs in waits if d == device]
        assert mine == [[], [device], [device]], waits
