"""Accumulation with masked losses equals one step on the large batch.

Keras divides a masked loss by the batch's valid entries, not its samples;
the window must weight each micro-batch by that count (also with sample
weights, uneven windows and MirroredStrategy replicas). The independent
reference: a plain keras.Model's one step on the concatenated batch.
"""

import warnings

import numpy as np
import pytest

import keras
from conftest import shared_mirrored_strategy
from keras_gradboost import GradBoostModel

T = 6  # time steps
N = 16  # samples: one window


def masked_model(cls, seed=0):
    """Embedding(mask_zero) -> Dense -> Dense: a per-step classifier whose
    loss Keras divides by the valid (non-padding) steps."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(20, 6, mask_zero=True, name="embed")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(h)
    return cls(inputs, keras.layers.Dense(3, name="logits")(h))


def data(seed=0):
    """Ids with padding (0) after a length of 1..T per row: valid counts
    differ from one micro-batch to the next."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 20, size=(N, T))
    lengths = rng.integers(1, T + 1, size=N)
    lengths[:4] = 1  # a first micro-batch with few valid steps
    ids[np.arange(T)[None, :] >= lengths[:, None]] = 0
    labels = rng.integers(0, 3, size=(N, T))
    return ids.astype("int32"), labels.astype("int32")


def compile_model(model, **kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )
    return model


def large_batch(sample_weight=None):
    model = compile_model(masked_model(keras.Model))
    ids, labels = data()
    model.train_on_batch(ids, labels, sample_weight=sample_weight)
    return model.get_weights()


def max_diff(model, weights):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), weights))


def accumulated(k, batch_size, sample_weight=None, scope=None):
    if scope is None:
        model = compile_model(masked_model(GradBoostModel), accumulate_steps=k)
    else:
        with scope:
            model = compile_model(masked_model(GradBoostModel), accumulate_steps=k)
    ids, labels = data()
    model.fit(ids, labels, sample_weight=sample_weight, batch_size=batch_size,
              epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    return model


def test_the_mask_reaches_the_loss_and_counts_differ():
    model = masked_model(keras.Model)
    ids, _ = data()
    out = model(ids)
    assert out._keras_mask is not None
    valid = (ids != 0).reshape(4, -1).sum(axis=1)
    assert len(set(valid.tolist())) > 1  # the micro-batches of 4 differ


@pytest.mark.parametrize("k, batch_size", [(1, 16), (2, 8), (4, 4), (3, 6)],
                         ids=["1x16", "2x8", "4x4", "uneven-6-6-4"])
def test_masked_loss_window_equals_the_large_batch(k, batch_size):
    model = accumulated(k, batch_size)
    assert max_diff(model, large_batch()) < 1e-6


@pytest.mark.parametrize("weights", ["per-sample", "per-step"])
def test_masked_loss_with_sample_weights(weights):
    rng = np.random.default_rng(1)
    shape = (N, 1) if weights == "per-sample" else (N, T)
    sample_weight = rng.uniform(0.2, 2.0, size=shape).astype("float32")
    model = accumulated(4, 4, sample_weight=sample_weight)
    assert max_diff(model, large_batch(sample_weight)) < 1e-6


def test_masked_loss_window_over_mirrored_replicas():
    # 4 micro-batches of 4, 2 samples per replica: each replica's count.
    model = accumulated(4, 4, scope=shared_mirrored_strategy().scope())
    assert max_diff(model, large_batch()) < 1e-6


def test_weighting_by_samples_would_be_wrong_here():
    # The size of what the valid-count weights fix: the micro-batch mean
    # weighted by samples, computed by hand from per-micro-batch steps.
    ids, labels = data()
    reference = large_batch()
    base = compile_model(masked_model(keras.Model))
    grads = []
    for j in range(4):
        rows = slice(4 * j, 4 * j + 4)
        probe = compile_model(masked_model(keras.Model))
        probe.set_weights(base.get_weights())
        before = [w.copy() for w in probe.get_weights()]
        probe.train_on_batch(ids[rows], labels[rows])
        grads.append([(b - a) for a, b in zip(probe.get_weights(), before)])
    by_samples = [w - np.mean([g[i] for g in grads], axis=0)
                  for i, w in enumerate(base.get_weights())]
    off = max(float(np.max(np.abs(a - b))) for a, b in zip(by_samples, reference))
    assert off > 1e-3


def test_two_outputs_with_a_mask_warn_that_they_are_not_exact():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(20, 6, mask_zero=True)(inputs)
    steps = keras.layers.Dense(3, name="steps")(h)
    pooled = keras.layers.Dense(1, name="pooled")(keras.layers.GlobalAveragePooling1D()(h))
    model = GradBoostModel(inputs, [steps, pooled])
    model.compile(optimizer="sgd", accumulate_steps=2,
                  loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"])
    ids, labels = data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(ids, [labels, np.zeros((N, 1))], batch_size=8, verbose=0)
    messages = [str(w.message) for w in caught if "masked" in str(w.message)]
    assert len(messages) == 1 and "accumulate_steps=2" in messages[0]


# ------------------------------------------------- with the other features


def test_masked_window_with_a_dynamic_loss_scale():
    # A power-of-two scale is exact in float32: the same large batch.
    model = compile_model(masked_model(GradBoostModel), accumulate_steps=4,
                          loss_scale="dynamic")
    ids, labels = data()
    model.fit(ids, labels, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_diff(model, large_batch()) < 1e-6


def test_masked_window_skips_a_bad_micro_batch_and_counts_the_rest():
    from keras_gradboost.callbacks import NaNWatcher

    model = compile_model(masked_model(GradBoostModel), accumulate_steps=4)
    ids, labels = data()
    weights = np.ones((N, 1), "float32")
    weights[9, 0] = np.nan  # micro-batch 2 (rows 8-11): a NaN loss
    model.fit(ids, labels, sample_weight=weights, batch_size=4, epochs=1, shuffle=False,
              verbose=0, callbacks=[NaNWatcher(action="skip", verbose=0)])
    # The reference: one step on the other three micro-batches, whose loss
    # Keras divides by their own valid entries.
    keep = np.r_[0:8, 12:16]
    reference = compile_model(masked_model(keras.Model))
    reference.train_on_batch(ids[keep], labels[keep])
    assert max_diff(model, reference.get_weights()) < 1e-6


def test_accumulate_check_passes_on_a_masked_model():
    model = compile_model(masked_model(GradBoostModel), accumulate_steps=4,
                          accumulate_check=True)
    ids, labels = data()
    model.fit(ids, labels, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert max_diff(model, large_batch()) < 1e-6


class OwnMeanLoss(GradBoostModel):
    """Its own compute_loss: a mean over every entry, padding included."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        labels = keras.ops.one_hot(y, 3)
        return keras.ops.mean(keras.ops.square(y_pred - labels))


def test_a_loss_that_ignores_the_mask_is_weighted_by_samples_and_warns():
    ids, labels = data()
    model = compile_model(masked_model(OwnMeanLoss), accumulate_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(ids, labels, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert any("OwnMeanLoss.compute_loss" in str(w.message) for w in caught)
    reference = compile_model(masked_model(OwnMeanLoss))
    reference.fit(ids, labels, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_diff(model, reference.get_weights()) < 1e-6  # its mean divides by samples
