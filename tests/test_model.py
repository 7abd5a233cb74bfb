"""GradBoostModel's three forms, boost(), plain-Keras equivalence, save/load."""

import re

import numpy as np
import pytest

import keras
from conftest import max_weight_diff
from conftest import small_model
from keras_gradboost import GradBoostModel
from keras_gradboost import boost
from keras_gradboost import hooks
from keras_gradboost.model import FunctionalGradBoostModel


def _fit(model, x, y, **compile_kwargs):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", **compile_kwargs)
    return model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_no_gradboost_kwargs_trains_exactly_like_keras_model(regression_data, jit_compile):
    x, y = regression_data
    plain, boosted = small_model(), small_model(GradBoostModel)
    h_plain = _fit(plain, x, y, jit_compile=jit_compile).history
    h_boost = _fit(boosted, x, y, jit_compile=jit_compile).history
    assert max_weight_diff(plain, boosted) == 0.0
    assert h_plain == h_boost  # same keys (no extra logs) and values


def _record_builds(model):
    """Patches `model.optimizer.build` to record, per call, whether it ran
    inside a traced function."""
    import tensorflow as tf

    inside, build = [], model.optimizer.build

    def recording(variables):
        inside.append(tf.inside_function())
        return build(variables)

    model.optimizer.build = recording
    return inside


def test_fit_makes_the_optimizer_variables_before_the_trace(regression_data):
    """Made inside the trace, each optimizer variable is lifted out one at
    a time (ResNet50 with Adam: 13 s of its first fit). The built model's
    optimizer is built eagerly, and trains exactly as Keras' does."""
    x, y = regression_data
    plain, boosted = small_model(), small_model(GradBoostModel)
    boosted.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    inside = _record_builds(boosted)
    boosted.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert inside == [False]
    _fit(plain, x, y)
    assert max_weight_diff(plain, boosted) == 0.0


def test_an_unbuilt_subclassed_model_leaves_the_optimizer_to_keras(regression_data):
    """Before its first call a subclassed model has no variables yet:
    Keras builds the optimizer in the trace, with all of them."""
    x, y = regression_data
    keras.utils.set_random_seed(0)
    net = Net()
    net.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    inside = _record_builds(net)
    net.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert inside == [True]
    assert len(net.optimizer.variables) > 2 * len(net.trainable_variables)


class _TwoDense:
    """Dense(8, tanh) -> Dense(3), mixed into a subclassed model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


class Net(_TwoDense, GradBoostModel):
    pass


class PlainNet(_TwoDense, keras.Model):
    pass


def test_subclassed_gradboost_model_accumulates(regression_data):
    x, y = regression_data
    keras.utils.set_random_seed(0)
    ref = PlainNet()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.train_on_batch(x, y)
    keras.utils.set_random_seed(0)
    net = Net()
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=4)
    net.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert max_weight_diff(net, ref) < 2e-6


def _sequential():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )


def _subclassed():
    keras.utils.set_random_seed(0)
    model = PlainNet()
    model(np.zeros((1, 5), "float32"))
    return model


class HalvedGraph(keras.Model):
    """A functional class whose `call` runs more than its graph."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=training) * 0.5


def _functional_with_own_call():
    return small_model(HalvedGraph)


class HalvedSequential(keras.Sequential):
    def call(self, inputs, training=None, mask=None):
        return super().call(inputs, training=training, mask=mask) * 0.5


def _sequential_with_own_call():
    keras.utils.set_random_seed(0)
    return HalvedSequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )


@pytest.mark.parametrize("build", [
    small_model, _sequential, _subclassed, _functional_with_own_call, _sequential_with_own_call,
])
def test_boost_shares_weights_and_trains_the_original(regression_data, build):
    x, y = regression_data
    original = build()
    reference = build()
    boosted = boost(original)
    assert isinstance(boosted, GradBoostModel)
    # Graphs of layers are rebuilt as a functional GradBoostModel; others
    # wrapped, and so is a class whose `call` overrides its graph's (a
    # rebuilt graph dropped it: predictions 2x the original's, silently).
    rebuilt = build in (small_model, _sequential)
    assert isinstance(boosted, FunctionalGradBoostModel) == rebuilt
    ids = {id(v) for v in original.weights}
    assert ids and ids == {id(v) for v in boosted.weights}
    boosted.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=2)
    boosted.fit(x[:64], y[:64], batch_size=32, shuffle=False, verbose=0)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.train_on_batch(x[:64], y[:64])
    assert max_weight_diff(original, reference) < 2e-6
    np.testing.assert_allclose(boosted.predict(x, verbose=0), original.predict(x, verbose=0))


def test_boost_rejects_non_models():
    with pytest.raises(TypeError, match=r"argument `model`.*Dense"):
        boost(keras.layers.Dense(2))


def test_boost_of_gradboost_model_is_identity():
    model = small_model(GradBoostModel)
    assert boost(model) is model


@pytest.mark.parametrize("form", ["functional", "subclassed", "boosted", "boosted_subclassed"])
def test_save_load_restores_gradboost_settings_and_trains_identically(
    regression_data, tmp_path, form
):
    x, y = regression_data
    if form == "functional":
        model = small_model(GradBoostModel)
    elif form == "boosted":
        model = boost(small_model())
    elif form == "boosted_subclassed":
        model = boost(_subclassed())
    else:
        model = Net()
        model(x[:1])
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        accumulate_steps=3,
        precision="float32",
        loss_scale=64.0,
    )
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(
        path, custom_objects={"Net": Net, "PlainNet": PlainNet}
    )
    assert isinstance(loaded, GradBoostModel)
    assert loaded.gradboost_config == model.gradboost_config
    h1 = model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history
    h2 = loaded.fit(x, y, batch_size=16, shuffle=False, verbose=0).history
    assert max_weight_diff(model, loaded) < 1e-6
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())
    np.testing.assert_allclose(h1["loss"], h2["loss"], rtol=1e-5)
    assert h2["loss_scale"] == [64.0]


def test_compile_conflicts_name_both_sides():
    model = small_model(GradBoostModel)
    with pytest.raises(ValueError, match=r"auto_scale_loss=True.*loss_scale='dynamic'.*Set only one"):
        model.compile(optimizer="sgd", loss="mse", auto_scale_loss=True, loss_scale="dynamic")
    with pytest.raises(ValueError, match=r"LossScaleOptimizer.*loss_scale='dynamic'.*Set only one"):
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
            loss="mse",
            loss_scale="dynamic",
        )
    with pytest.raises(ValueError, match=r"accumulate_steps=2 and a LossScaleOptimizer"):
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
            loss="mse",
            loss_scale=None,
            accumulate_steps=2,
        )
    with pytest.raises(ValueError, match="accumulate_steps=0"):
        model.compile(optimizer="sgd", loss="mse", accumulate_steps=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'recompute_blocks'"):
        model.compile(optimizer="sgd", loss="mse", recompute_blocks=["a"])


class HoldsUnused(GradBoostModel):
    """Holds a layer it never calls: tracked, trainable, not on the path to
    the loss. (Subclassed: a layer set on a built functional model is not
    tracked before Keras 3.15, see `conftest.needs_layer_set_on_functional`.)"""

    def __init__(self):
        super().__init__()
        self.used = keras.layers.Dense(3, name="used")
        self.unused = keras.layers.Dense(3, name="unused")

    def call(self, x):
        return self.used(x)


def test_step_facts_publish_none_gradient_variables(regression_data):
    x, y = regression_data
    model = HoldsUnused()
    model.unused.build((None, 5))
    model.compile(optimizer="sgd", loss="mse", loss_scale=1.0)
    model.fit(x, y, batch_size=32, verbose=0)
    facts = model.step_facts.read()
    assert set(facts["none_gradient_variables"]) == {"unused/kernel", "unused/bias"}
    assert facts["last_step_finite"] is True
    assert facts["checked_steps"] == 4
    assert facts["skipped_steps"] == 0


def test_functional_subclass_does_not_rewrite_gradboost_model(regression_data):
    class Sub(GradBoostModel):
        pass

    x, y = regression_data
    inputs = keras.Input((5,))
    functional = Sub(inputs, keras.layers.Dense(3)(inputs))
    assert isinstance(functional, Sub) and isinstance(functional, GradBoostModel)
    # Keras' trainer adapted for multi-worker strategies, then keras.Model.
    assert GradBoostModel.__bases__ == (hooks.MultiWorkerTrainer, keras.Model)
    assert Sub.__bases__ == (GradBoostModel,)
    functional.compile(optimizer="sgd", loss="mse", accumulate_steps=2)
    functional.fit(x, y, batch_size=52, verbose=0)
    assert int(functional.optimizer.iterations.numpy()) == 1
    net = Net()  # subclassed use still works afterwards
    net.compile(optimizer="sgd", loss="mse")
    net.fit(x, y, batch_size=52, verbose=0)
    assert boost(_subclassed()).__class__.__name__ == "_BoostedModel"


def test_boosted_subclassed_model_trains_in_training_mode(regression_data):
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x, training=None):
            seen.append(training)
            return x

    class WithProbe(keras.Model):
        def __init__(self):
            super().__init__()
            self.probe = Probe()
            self.out = keras.layers.Dense(3)

        def call(self, x, training=None):
            return self.out(self.probe(x, training=training))

    x, y = regression_data
    inner = WithProbe()
    inner(x[:1])
    model = boost(inner)
    model.compile(optimizer="sgd", loss="mse")
    seen.clear()
    model.fit(x, y, batch_size=52, verbose=0)
    assert seen and all(t is True for t in seen)


def test_failed_compile_changes_nothing():
    model = small_model(GradBoostModel)
    model.compile(optimizer="sgd", loss="mse")
    optimizer = model.optimizer
    with pytest.raises(ValueError, match="Set only one"):
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
            loss="mse",
            precision="mixed_bfloat16",
            loss_scale="dynamic",
        )
    assert model.optimizer is optimizer
    assert model.get_layer("hidden").compute_dtype == "float32"
    assert model._gradboost.scaler is None


def test_keras_auto_scale_loss_is_honoured_when_gradboost_scaling_is_off(tmp_path):
    # auto_scale_loss=True on a float32 model: nothing to scale, no conflict.
    model = small_model(GradBoostModel)
    model.compile(optimizer="sgd", loss="mse", auto_scale_loss=True)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    # float16 with gradboost scaling off: Keras' LossScaleOptimizer, kept on load.
    model = small_model(GradBoostModel)
    with pytest.warns(UserWarning, match="remapping"):
        model.compile(
            optimizer="sgd",
            loss="mse",
            precision="mixed_float16",
            loss_scale=None,
            auto_scale_loss=True,
        )
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model._gradboost.scaler is None
    path = str(tmp_path / "m.keras")
    model.save(path)
    with pytest.warns(UserWarning, match="remapping"):
        loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.LossScaleOptimizer)


def test_user_callback_list_is_left_as_given(regression_data):
    x, y = regression_data
    model = small_model(GradBoostModel)
    model.compile(optimizer="sgd", loss="mse", accumulate_steps=2)
    callbacks = keras.callbacks.CallbackList([keras.callbacks.History()], model=model)
    before = list(callbacks.callbacks)
    model.fit(x, y, batch_size=26, verbose=0, callbacks=callbacks)
    model.fit(x, y, batch_size=26, verbose=0, callbacks=callbacks)
    assert callbacks.callbacks == before
    assert int(model.optimizer.iterations.numpy()) == 4


def test_step_facts_before_compile_say_to_compile_first():
    model = small_model(GradBoostModel)
    with pytest.raises(RuntimeError, match=r"call `model.compile\(...\)` before"):
        model.step_facts


@pytest.mark.parametrize(
    "batch_size, error, fragment",
    [
        ("32", TypeError, "batch_size='32' of type str"),
        (2.0, TypeError, "batch_size=2.0 of type float"),
        (True, TypeError, "batch_size=True of type bool"),
        (0, ValueError, "batch_size=0. Expected an int >= 1 or None"),
        (-4, ValueError, "batch_size=-4"),
    ],
)
def test_recompute_plan_checks_batch_size(batch_size, error, fragment):
    model = small_model(GradBoostModel)
    model.compile(optimizer="sgd", loss="mse", recompute=["hidden"])
    with pytest.raises(error, match=re.escape(fragment)):
        model.recompute_plan(batch_size=batch_size)
    assert model.recompute_plan(batch_size=8).setting == ("hidden",)
