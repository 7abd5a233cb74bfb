"""A dropped step leaves no trace in the model's state either: the moving
statistics that a bad batch's forward pass writes into BatchNormalization go
back with the update (found on keras.applications models: after a planted
NaN, `action="stop"` kept the weights but left NaN moving statistics behind
the bad layer, and finite but wrong ones before it)."""

import numpy as np
import pytest

import keras
from conftest import shared_mirrored_strategy
from keras_gradboost import GradBoostModel
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import NonFiniteError

BAD, BATCH, STEPS = 2, 4, 5


def bn_model(cls=keras.Model, seed=0):
    """Dense -> BatchNormalization -> Dense -> BatchNormalization ->
    Dense."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="d1")(inputs)
    h = keras.layers.BatchNormalization(name="bn1")(h)
    h = keras.layers.Dense(4, activation="tanh", name="d2")(h)
    h = keras.layers.BatchNormalization(name="bn2")(h)
    return cls(inputs, keras.layers.Dense(2, name="out")(h))


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 3)).astype("float32")
    y = rng.normal(size=(STEPS * BATCH, 2)).astype("float32")
    return x, y


def compile_model(model, **kwargs):
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", **kwargs)
    return model


def reference(cls, x, y, batches):
    model = compile_model(bn_model(cls))
    for b in batches:
        model.train_on_batch(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH])
    return model


def assert_same_state(model, expected):
    names = [v.path for v in model.weights]
    for name, a, b in zip(names, model.get_weights(), expected.get_weights()):
        assert np.all(np.isfinite(a)), f"{name} holds non-finite values"
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


def _bad_x(x):
    """A NaN in every sample of batch `BAD`."""
    x = x.copy()
    x[BAD * BATCH:(BAD + 1) * BATCH] = np.nan
    return x


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_skip_puts_the_moving_statistics_back(cls):
    x, y = data()
    model = compile_model(bn_model(cls))
    watcher = NaNWatcher(action="skip", verbose=0)
    model.fit(_bad_x(x), y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watcher])
    assert [e.step for e in watcher.events] == [BAD]
    batches = [b for b in range(STEPS) if b != BAD]
    assert_same_state(model, reference(cls, x, y, batches))


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_stop_keeps_the_moving_statistics_of_the_last_good_step(cls):
    x, y = data()
    model = compile_model(bn_model(cls))
    with pytest.raises(NonFiniteError):
        model.fit(_bad_x(x), y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[NaNWatcher(action="stop", verbose=0)])
    assert_same_state(model, reference(cls, x, y, range(BAD)))


def test_skip_under_mirrored_strategy_puts_the_statistics_back():
    """The NaN in one replica's half of the bad batch only: both replicas
    drop the step (one decision for all) and each puts back its own copy
    of the statistics. (The replay that names the bad layer used to put
    the first replica's copy back into every replica's: replica 1 then went
    on from replica 0's statistics, 0.0041 against 0.0011.)"""
    x, y = data()
    bad_x = x.copy()
    bad_x[BAD * BATCH] = np.nan  # replica 0's first sample of batch BAD
    strategy = shared_mirrored_strategy()
    with strategy.scope():
        model = compile_model(bn_model())
    watcher = NaNWatcher(action="skip", verbose=0)
    model.fit(bad_x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watcher])
    assert [e.step for e in watcher.events] == [BAD]
    # The reference: the same model under the same strategy, fit on the
    # good batches alone.
    good = np.ones(len(x), bool)
    good[BAD * BATCH:(BAD + 1) * BATCH] = False
    with strategy.scope():
        expected = compile_model(bn_model())
    expected.fit(x[good], y[good], batch_size=BATCH, shuffle=False, verbose=0)
    for v, e in zip(model.weights, expected.weights):
        copies = strategy.experimental_local_results(v.value)
        expected_copies = strategy.experimental_local_results(e.value)
        for replica, (a, b) in enumerate(zip(copies, expected_copies)):
            a = a.numpy()
            assert np.all(np.isfinite(a)), f"{v.path} on replica {replica}"
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{v.path} on replica {replica}")

