"""Models with their own train_step / test_step / predict_step /
compute_loss (Keras' "Customizing what happens in fit()" pattern): boost()
keeps them, and what needs GradBoostModel's update is used or refused."""

import warnings

import numpy as np
import pytest

import keras
import tensorflow as tf
from keras_gradboost import GradBoostModel
from keras_gradboost import boost
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import NonFiniteError


class HalfStepModel(keras.Model):
    """A functional subclass whose train_step counts its calls and applies
    half of each gradient (so its weights differ from Keras' default step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = keras.Variable(0, dtype="int64", trainable=False, name="calls")

    def train_step(self, data):
        x, y = data
        self.calls.assign_add(1)
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(
            zip([0.5 * g for g in grads], self.trainable_variables)
        )
        return {"loss": loss}


class SuperStepModel(keras.Model):
    """A train_step that counts its calls and leaves the update to super()."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = keras.Variable(0, dtype="int64", trainable=False, name="calls")

    def train_step(self, data):
        self.calls.assign_add(1)
        return super().train_step(data)


class PenaltyLossModel(keras.Model):
    """Its own compute_loss (adds a weight penalty) and predict_step."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 0.1 * tf.reduce_sum(tf.square(self.trainable_variables[0]))

    def predict_step(self, data):
        return {"doubled": 2.0 * self(data, training=False)}


class Subclassed(keras.Model):
    """A subclassed model (its own call) with its own train_step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)
        self.calls = keras.Variable(0, dtype="int64", trainable=False, name="calls")

    def call(self, x):
        return self.out(self.hidden(x))

    train_step = HalfStepModel.train_step


def max_weight_diff(a, b):
    """Over the trainable weights (a `calls` counter is a weight too)."""
    return max(
        float(np.max(np.abs(va.numpy() - vb.numpy())))
        for va, vb in zip(a.trainable_variables, b.trainable_variables)
    )


def functional(cls, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    return cls(inputs, keras.layers.Dense(3, name="out")(hidden))


def subclassed(seed=0):
    keras.utils.set_random_seed(seed)
    model = Subclassed()
    model(np.zeros((1, 5), "float32"))
    return model


def data(n=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, (0.5 * np.tanh(x[:, :3])).astype("float32")


def fit(model, epochs=2, batch_size=4, **kwargs):
    x, y = data()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **kwargs)
    return model


@pytest.mark.parametrize("make", [lambda: functional(HalfStepModel), subclassed],
                         ids=["functional-subclass", "subclassed"])
def test_boost_keeps_the_models_own_train_step(make):
    plain = make()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    fit(plain)
    base = make()
    boosted = boost(base)
    assert isinstance(boosted, GradBoostModel)
    boosted.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    fit(boosted)
    assert int(boosted.calls.numpy()) == 16 == int(plain.calls.numpy())
    assert max_weight_diff(boosted, plain) == 0.0
    # Keras' default step would move the weights twice as far: it differs.
    default = functional(keras.Model) if isinstance(plain, HalfStepModel) else None
    if default is not None:
        default.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        assert max_weight_diff(fit(default), plain) > 1e-3


def test_boost_keeps_compute_loss_and_predict_step():
    plain = functional(PenaltyLossModel)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    boosted = boost(functional(PenaltyLossModel))
    boosted.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert max_weight_diff(fit(boosted), fit(plain)) < 1e-7
    no_penalty = functional(keras.Model)
    no_penalty.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert max_weight_diff(fit(no_penalty), plain) > 1e-3
    x, _ = data()
    predicted = boosted.predict(x[:4], verbose=0)
    # (The compiled predict and the eager call round apart: 1.3e-6 relative
    # on Keras 3.8.)
    np.testing.assert_allclose(predicted["doubled"], 2.0 * boosted(x[:4]).numpy(), rtol=1e-5)


def refused_before_any_update(cls, options):
    """Fits boost(cls) with `options`; the ValueError's text, checking that
    no weight changed."""
    model = boost(functional(cls))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **options)
    before = model.get_weights()
    with pytest.raises(ValueError) as info:
        fit(model, epochs=1)
    for w, w0 in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, w0)  # refused before any update
    return str(info.value)


@pytest.mark.parametrize("options, named", [
    (dict(accumulate_steps=4), "accumulate_steps=4"),
    (dict(loss_scale=128.0), "loss_scale=128.0"),
])
def test_own_step_that_applies_itself_refuses_options_it_would_ignore(options, named):
    message = refused_before_any_update(HalfStepModel, options)
    assert "HalfStepModel.train_step" in message and named in message
    assert "super().train_step(data)" in message


class SuperAndOwnOptimizer(keras.Model):
    """super().train_step for the model's optimizer, then a second optimizer
    (kept in an attribute, as a GAN keeps its discriminator's) applied by
    hand to a penalty's gradients: that update bypasses GradBoostModel."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.second = keras.optimizers.SGD(0.01)

    def train_step(self, data):
        logs = super().train_step(data)
        variables = self.trainable_variables[:1]
        with tf.GradientTape() as tape:
            penalty = tf.reduce_sum(tf.square(variables[0]))
        self.second.apply_gradients(zip(tape.gradient(penalty, variables), variables))
        return logs


class SuperAndModelOptimizer(SuperAndOwnOptimizer):
    """The same, the penalty applied by the model's own optimizer by hand."""

    def train_step(self, data):
        logs = super(SuperAndOwnOptimizer, self).train_step(data)  # GradBoostModel's
        variables = self.trainable_variables[:1]
        with tf.GradientTape() as tape:
            penalty = tf.reduce_sum(tf.square(variables[0]))
        self.optimizer.apply_gradients(zip(tape.gradient(penalty, variables), variables))
        return logs


@pytest.mark.parametrize("options, named", [
    (dict(accumulate_steps=2), "accumulate_steps=2"),
    (dict(loss_scale=128.0), "loss_scale=128.0"),
])
@pytest.mark.parametrize("cls, which", [
    (SuperAndOwnOptimizer, "another optimizer (SGD)"),
    (SuperAndModelOptimizer, "the model's optimizer"),
])
def test_own_step_applying_an_optimizer_itself_is_refused(cls, which, options, named):
    message = refused_before_any_update(cls, options)
    assert f"{cls.__name__}.train_step applies {which} itself" in message
    assert named in message and "self.minimize(" in message
    # Without the options nothing is ignored: it trains as plain Keras does.
    plain = functional(cls)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    boosted = boost(functional(cls))
    boosted.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert max_weight_diff(fit(boosted), fit(plain)) == 0.0


def test_own_step_calling_super_gets_exact_accumulation():
    boosted = boost(functional(SuperStepModel))
    boosted.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=4)
    fit(boosted, batch_size=4)
    large = functional(keras.Model)
    large.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    fit(large, batch_size=16)
    assert int(boosted.calls.numpy()) == 16  # every micro-batch went through it
    assert boosted.optimizer.iterations.numpy() == large.optimizer.iterations.numpy() == 4
    assert max_weight_diff(boosted, large) < 2e-6


def test_precision_applies_to_a_model_with_its_own_step():
    model = boost(functional(HalfStepModel))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                  precision="mixed_bfloat16", loss_scale=None)
    assert model.get_layer("hidden").dtype_policy.name == "mixed_bfloat16"
    fit(model, epochs=1)
    assert int(model.calls.numpy()) == 8


@pytest.mark.parametrize("make", [lambda: functional(HalfStepModel),
                                  lambda: functional(SuperStepModel)],
                         ids=["applies-itself", "calls-super"])
def test_nan_watcher_guards_a_boosted_model_with_its_own_step(make):
    model = boost(make())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data()
    x[5 * 4 + 1, 2] = np.nan  # batch 5
    watcher = NaNWatcher(action="stop", verbose=0)
    with pytest.raises(NonFiniteError):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[watcher])
    assert [(e.step, e.phase) for e in watcher.events] == [(5, "forward")]
    reference = boost(make())
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(x[:20], y[:20], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(model, reference) == 0.0  # the weights before step 5


@keras.saving.register_keras_serializable(package="test_own_steps")
class SavedStepModel(HalfStepModel):
    """HalfStepModel, registered as a user registers a class to save it."""


def test_a_boosted_model_with_its_own_step_saves_and_loads(tmp_path):
    model = boost(functional(SavedStepModel))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=1,
                  precision="float32")
    fit(model, epochs=1)
    path = str(tmp_path / "own_step.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, SavedStepModel) and isinstance(loaded, GradBoostModel)
    assert loaded.gradboost_config.precision == "float32"
    x, _ = data()
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    fit(loaded, epochs=1)
    fit(model, epochs=1)
    assert int(loaded.calls.numpy()) == int(model.calls.numpy()) == 16  # its own step
    assert max_weight_diff(loaded, model) == 0.0


def test_nan_watcher_checks_each_micro_batch_of_an_own_step_that_accumulates():
    """With accumulate_steps the own step's updates all go through
    GradBoostModel's (anything else is refused), so the watcher checks each
    micro-batch there: the bad one is skipped alone, as with the built-in
    step (an optimizer guard would see only the window's mean)."""
    x, y = data()
    x[3 * 4 + 1, 2] = np.nan  # micro-batch 3
    models = [boost(functional(SuperStepModel)), boost(functional(keras.Model))]
    watchers = [NaNWatcher(action="skip", verbose=0) for _ in models]
    for model, watcher in zip(models, watchers):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=2)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[watcher])
    assert [e.step for e in watchers[0].events] == [e.step for e in watchers[1].events] == [3]
    assert int(models[0].calls.numpy()) == 8
    assert max_weight_diff(models[0], models[1]) == 0.0


class CountsTraces(keras.layers.Layer):
    """Counts the traces of its `call`: a recomputed block runs it twice in
    a step's graph (its forward, and its replay in the backward)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, activation="tanh")
        self.traced = 0

    def call(self, x):
        self.traced += 1
        return self.dense(x)


class EncoderStep(keras.Model):
    """keras.io's VAE pattern: the train_step calls a sub-block directly
    (`self.encoder(x)`), never the model itself."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoder = CountsTraces(name="encoder")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.encoder(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.head(self.encoder(x, training=True)) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


class NoCallStep(EncoderStep):
    """A GAN's shape: no `call`, the train_step is the only forward."""

    call = keras.Model.call


@pytest.mark.parametrize("cls, recompute", [
    (EncoderStep, ["encoder"]),
    (NoCallStep, ["encoder"]),
    (NoCallStep, "auto"),  # nothing to estimate: the compile-time choice
])
def test_recompute_acts_in_an_own_step_that_calls_its_blocks_directly(cls, recompute):
    """The blocks recomputed only inside GradBoostModel's forward: an own
    step calling them was left without recompute, silently, while
    `recompute_plan()` listed them."""
    x, y = data()
    models = {}
    for setting in (None, recompute):
        keras.utils.set_random_seed(0)
        model = boost(cls())
        model.compile(optimizer=keras.optimizers.SGD(0.1), recompute=setting)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        said = [str(w.message) for w in caught if "cannot estimate" in str(w.message)]
        # "auto" says it recomputes the compile-time blocks, unestimated.
        assert len(said) == (setting == "auto"), said
        assert all("NoCallStep.train_step runs a forward of its own" in m
                   and "recomputes the 1 block found at compile (encoder)" in m for m in said)
        models[str(setting)] = model
    plain, recomputed = models["None"], models[str(recompute)]
    assert recomputed.recompute_plan().recomputed == ["encoder"]
    # Each trace of the step runs the block twice: its forward and its replay.
    assert recomputed.encoder.traced > plain.encoder.traced, (
        recomputed.encoder.traced, plain.encoder.traced)
    assert max_weight_diff(plain, recomputed) < 1e-6


def test_a_budget_refuses_an_own_step_without_a_call():
    model = boost(NoCallStep())
    model.compile(optimizer=keras.optimizers.SGD(0.1), recompute={"budget_mb": 1})
    with pytest.raises(ValueError, match="NoCallStep.train_step runs a forward of its own"):
        model.fit(*data(), batch_size=8, epochs=1, verbose=0)


class SelfCallStep(keras.Model):
    """A functional subclass whose train_step runs `self(x)`: GradBoostModel's
    forward (which runs a plan's graph segments) is not called."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_graph_segments_refuse_an_own_step_with_its_own_forward():
    inputs = keras.Input((5,))
    h = inputs
    for i in range(8):
        h = keras.layers.Dense(64, activation="tanh", name=f"d{i}")(h)
    model = boost(SelfCallStep(inputs, keras.layers.Dense(3, name="out")(h)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), recompute="auto")
    x, y = data(2048)
    with pytest.raises(ValueError, match="SelfCallStep.train_step runs a forward of its own"):
        model.fit(x, y, batch_size=2048, epochs=1, verbose=0)
    assert model.recompute_plan().recomputed[0].startswith("d0..")  # segments


class PointwiseEncoderStep(EncoderStep):
    """An own step calling a sub-model with a 1x1 convolution directly."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoder = keras.Sequential(
            [keras.Input((5,)), keras.layers.Reshape((1, 1, 5)),
             keras.layers.Conv2D(8, 1, name="pw"), keras.layers.Flatten()],
            name="encoder",
        )


def test_pointwise_kernels_run_in_an_own_step_that_calls_a_sub_model(monkeypatch):
    from keras_gradboost import pointwise

    traced = []
    original = pointwise.matmul_convolution
    monkeypatch.setattr(pointwise, "matmul_convolution",
                        lambda *a, **k: traced.append(1) or original(*a, **k))
    model = boost(PointwiseEncoderStep())
    model(data()[0][:1])
    model.compile(optimizer=keras.optimizers.SGD(0.1), pointwise="matmul")
    assert [l.name for l in model.train_plan.pointwise_layers] == ["pw"]
    traced.clear()
    fit(model, epochs=1)
    assert traced  # before, the step ran Keras' Conv2D: the option was left out


class QuadStep(EncoderStep):
    """Batches of four items (x, y, a weight and a tag): not Keras' (x, y,
    sample_weight)."""

    def train_step(self, data):
        x, y, weight, _ = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(weight * tf.square(self.head(self.encoder(x)) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_an_own_step_with_data_of_its_own_shape_recomputes():
    # Nothing about the model's input is inferred from the step's data.
    x, y = data()
    batches = tf.data.Dataset.from_tensor_slices(
        (x, y, np.ones((32, 1), "float32"), np.zeros(32, "int32"))).batch(8)
    model = boost(QuadStep())
    model.compile(optimizer=keras.optimizers.SGD(0.1), recompute=["encoder"])
    model.fit(batches, epochs=1, verbose=0)
    assert model.encoder.traced >= 2


class _Balance(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.sum(keras.ops.square(keras.ops.mean(x, axis=0))))
        return x


class MinimizeStep(keras.Model):
    """An own step that updates through `self.minimize`, over a layer that
    adds a loss over the batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.balance = _Balance(name="balance")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.balance(self.hidden(x)))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y)) + sum(self.losses)
        self.minimize(tape, loss, self.trainable_variables, count=tf.shape(x)[0])
        return {"loss": loss}


def test_accumulating_through_minimize_warns_of_a_layer_loss_over_the_batch():
    model = boost(MinimizeStep())
    model.compile(optimizer=keras.optimizers.SGD(0.1), accumulate_steps=2)
    with pytest.warns(UserWarning, match="'balance' add losses of their own"):
        fit(model, epochs=1)


def test_a_budget_with_unknown_input_dims_resolves_in_super_train_step():
    # The model's Input has a dimension of no size; its batches have one:
    # the budget chooses in GradBoostModel's step, at the batches' shapes
    # (choosing from the Input's specs before it failed: "unknown size").
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, 5))
    hidden = keras.layers.Dense(64, activation="tanh", name="hidden")(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(64, name="more")(hidden))
    model = boost(SuperStepModel(inputs, keras.layers.Dense(3, name="out")(pooled)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", recompute={"budget_mb": 1})
    x = np.random.default_rng(0).normal(size=(32, 4, 5)).astype("float32")
    model.fit(x, np.zeros((32, 3), "float32"), batch_size=8, epochs=1, verbose=0)
    assert model.recompute_plan().batch_size == 8


def test_an_own_step_accumulating_names_even_an_activity_regularizer():
    # Its `count` may be a mask's valid entries: a mean over samples is
    # then weighted wrongly, so no layer loss is taken as exact.
    keras.utils.set_random_seed(0)
    model = boost(MinimizeStep())
    model.balance = keras.layers.Dense(8, activity_regularizer="l2", name="balance")
    model.compile(optimizer=keras.optimizers.SGD(0.1), accumulate_steps=2)
    with pytest.warns(UserWarning, match="'balance' add losses of their own"):
        fit(model, epochs=1)
