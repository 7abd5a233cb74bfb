"""recompute_check=True: it names the block whose second forward differs,
and changes nothing when the gradients agree."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost import RecomputeCheckError
from recompute.models import WIDTH
from recompute.models import ResBlock
from recompute.models import TfRandomBlock
from recompute.models import assert_same_state
from recompute.models import residual_model
from recompute.models import train


def test_recompute_check_without_recompute_is_an_error():
    with pytest.raises(ValueError, match="recompute_check=True.*`recompute` is None"):
        residual_model().compile(optimizer="sgd", loss="mse", recompute_check=True)


@pytest.mark.parametrize("precision", [None, "mixed_bfloat16"])
def test_recompute_check_names_the_block_that_desyncs(data, precision, monkeypatch):
    from keras_gradboost.recompute import mechanism

    monkeypatch.setattr(mechanism, "_refuse_unseeded_random", lambda operations, name: None)
    x, y = data
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = ResBlock(width=5, name="good")(inputs)
    h = TfRandomBlock(name="noisy")(h)  # its scan turned off: a cause it misses
    model = GradBoostModel(inputs, keras.layers.Dense(3)(h))
    # Named: "auto" would leave out the block the backward meets first.
    model.compile(optimizer="sgd", loss="mse", recompute=["good", "noisy"],
                  recompute_check=True, precision=precision)
    before = model.get_weights()
    with pytest.raises(RecomputeCheckError, match="block 'noisy'") as info:
        model.fit(x, y, batch_size=16, verbose=0)
    assert info.value.block == "noisy" and info.value.variable.startswith("noisy/")
    # Nothing was trained or changed by the check.
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_recompute_check_passes_and_changes_nothing(data):
    x, y = data
    plain, checked = residual_model(), residual_model()
    train(plain, x, y, recompute="auto")
    train(checked, x, y, recompute="auto", recompute_check=True)
    assert checked._gradboost.recompute_check_pending is False
    assert_same_state(plain, checked)



class _AddsLoss(keras.layers.Layer):
    """A block whose inner layer adds a loss from its activations."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(5, activity_regularizer=keras.regularizers.L2(0.5))

    def call(self, x):
        return x + self.dense(x)


def test_recompute_check_counts_the_losses_layers_add(data, monkeypatch):
    """The check ran its steps in a `StatelessScope`, which drops the
    losses layers add: a recompute that lost their gradient (as it did
    before) passed it. Simulated here: the block's losses come back cut
    from its gradient."""
    from keras_gradboost.recompute import mechanism

    def cut(recorded, flat_outputs):
        outputs, losses = recorded
        count = len(tf.nest.flatten(outputs))
        for (layer, _), loss in zip(losses, flat_outputs[count:]):
            layer.add_loss(tf.stop_gradient(loss))
        return tf.nest.pack_sequence_as(outputs, flat_outputs[:count])

    x, y = data
    for broken in (False, True):
        if broken:
            monkeypatch.setattr(mechanism, "_add_back", cut)
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        h = _AddsLoss(name="block")(keras.layers.Dense(5)(inputs))
        model = GradBoostModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer="sgd", loss="mse", recompute=["block"], recompute_check=True)
        if not broken:
            model.fit(x, y, batch_size=16, verbose=0)  # exact: passes
            continue
        with pytest.raises(RecomputeCheckError, match="block 'block'"):
            model.fit(x, y, batch_size=16, verbose=0)


def test_recompute_check_of_many_blocks_logs_no_retracing_advice(data):
    # One traced function per block: from the fifth on, TensorFlow warned
    # that they "triggered tf.function retracing", advice about the user's
    # code that does not apply. The logger's level is set back after.
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = tf.get_logger()
    level = logger.level
    logger.addHandler(handler)
    try:
        x, y = data
        model = residual_model(blocks_count=7)
        train(model, x, y, recompute=["res_*"], recompute_check=True)
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "retracing" in r.getMessage()]
    assert logger.level == level
