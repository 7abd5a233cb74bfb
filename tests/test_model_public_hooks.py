"""GradBoostModel's public hooks for callbacks: `training_forward` (the
step's forward, as a probe) and `attach_watch`."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost import guard


def _flat(depth=6):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = inputs
    for i in range(depth):
        h = keras.layers.Dense(8, activation="tanh", name=f"d{i}")(h)
    return GradBoostModel(inputs, keras.layers.Dense(1, name="out")(h))


@pytest.mark.parametrize("recompute", [None, "auto"])
def test_training_forward_is_the_steps_forward_and_changes_nothing(recompute):
    model = _flat()
    model.compile(optimizer="sgd", loss="mse", recompute=recompute)
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 4)).astype("float32"))
    before = [w.copy() for w in model.get_weights()]
    out = model.training_forward(x)
    np.testing.assert_allclose(out, model(x, training=True), rtol=1e-6)
    # As a callback probes it (StepTimeMonitor traces without autograph).
    traced = tf.function(model.training_forward, autograph=False)(x)
    # (oneDNN may pick other float32 kernels in a graph: round-off apart.)
    np.testing.assert_allclose(traced, out, rtol=1e-5)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model.training_forward(x))
    assert all(g is not None for g in tape.gradient(loss, model.trainable_variables))
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert int(model.optimizer.iterations.numpy()) == 0
    if recompute:
        assert any(b.recomputed for b in model.recompute_plan().blocks)


def test_attach_watch_and_its_undo():
    model = _flat(depth=1)
    with pytest.raises(RuntimeError, match="compile"):
        model.attach_watch(object())  # before compile()
    model.compile(optimizer="sgd", loss="mse")
    facts = model.step_facts
    assert (facts.checks_gradients, facts.watch) == (False, None)
    watch = guard.WatchState(ring=4, halt_every=False)
    undo = model.attach_watch(watch)
    assert (facts.checks_gradients, facts.watch) == (True, watch)
    undo()
    assert (facts.checks_gradients, facts.watch) == (False, None)
    undo()  # idempotent
    assert (facts.checks_gradients, facts.watch) == (False, None)
    # An undo leaves a watch attached since in place.
    first = model.attach_watch(watch)
    other = guard.WatchState(ring=4, halt_every=False)
    second = model.attach_watch(other)
    first()
    assert facts.watch is other
    second()
    # Attachments stack: once both are undone, the setting before them.
    assert (facts.checks_gradients, facts.watch) == (False, None)
    first, second = model.attach_watch(watch), model.attach_watch(other)
    second()
    assert facts.watch is watch
    first()
    assert (facts.checks_gradients, facts.watch) == (False, None)


def test_an_attached_watch_skips_a_non_finite_step():
    model = _flat(depth=1)
    model.compile(optimizer="sgd", loss="mse")
    watch = guard.WatchState(ring=4, halt_every=False)
    undo = model.attach_watch(watch)
    x = np.ones((8, 4), "float32")
    x[0, 0] = np.nan
    before = [w.copy() for w in model.get_weights()]
    model.fit(x, np.ones((8, 1), "float32"), batch_size=8, verbose=0)
    undo()
    assert int(watch.count.numpy()) == 1
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
