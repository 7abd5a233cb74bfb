"""GradientAuditor against planted faults: an unused branch, a stop_gradient
branch, a dead ReLU layer, an exploding and a vanishing layer."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import needs_layer_set_on_functional
from keras_gradboost import GradBoostModel
from keras_gradboost import wrappers
from keras_gradboost.callbacks import GradientAuditor
from keras_gradboost.callbacks import MissingGradient
from keras_gradboost.callbacks import MissingGradientError


def _data(n=48):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


class Branches(keras.Model):
    def __init__(self):
        super().__init__()
        self.used = keras.layers.Dense(3, name="used")
        self.cut = keras.layers.Dense(3, name="cut")
        self.unused = keras.layers.Dense(3, name="unused")
        self.unused.build((None, 4))
        self.out = keras.layers.Dense(1, name="out")

    def call(self, x):
        h = keras.ops.concatenate([self.used(x), keras.ops.stop_gradient(self.cut(x))], -1)
        return self.out(h)


def _functional(cls=keras.Model):
    inputs = keras.Input((4,))
    used = keras.layers.Dense(3, name="used")(inputs)
    cut = keras.layers.Dense(3, name="cut")(inputs)
    h = keras.layers.Concatenate()([used, keras.ops.stop_gradient(cut)])
    model = cls(inputs, keras.layers.Dense(1, name="out")(h))
    unused = keras.layers.Dense(3, name="unused")
    unused.build((None, 4))
    model.unused_branch = unused  # tracked, trainable, never called
    return model


def _sequential():
    # No room for an unused branch: the cut layer only.
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, name="cut"),
            keras.layers.Lambda(keras.ops.stop_gradient, name="stop"),
            keras.layers.Dense(3, name="used"),
            keras.layers.Dense(1, name="out"),
        ]
    )


def _build(kind):
    keras.utils.set_random_seed(0)
    if kind == "functional":
        return _functional(), {}
    if kind == "sequential":
        return _sequential(), {}
    if kind == "subclassed":
        return Branches(), {}
    return _functional(GradBoostModel), {"accumulate_steps": 2}


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("functional", marks=needs_layer_set_on_functional),
        "sequential",
        "subclassed",
        pytest.param("gradboost", marks=needs_layer_set_on_functional),
    ],
)
def test_unused_and_cut_branches_are_named_with_their_reason(kind):
    model, kwargs = _build(kind)
    model.compile(optimizer="sgd", loss="mse", **kwargs)
    auditor = GradientAuditor(every_n_steps=2, verbose=0)
    x, y = _data()
    with pytest.warns(UserWarning, match="get no gradient") as record:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[auditor])
    expected = [
        MissingGradient("cut/kernel", "cut", "cut"),
        MissingGradient("cut/bias", "cut", "cut"),
    ]
    if kind != "sequential":
        expected += [
            MissingGradient("unused/kernel", "unused", "unused"),
            MissingGradient("unused/bias", "unused", "unused"),
        ]
    # Sequential paths carry the model's name first ("sequential_3/cut/bias").
    found = [
        MissingGradient("/".join(m.variable.split("/")[-2:]), m.layer, m.reason)
        for m in auditor.missing
    ]
    assert sorted(found, key=str) == sorted(expected, key=str)
    ours = [w for w in record if "GradientAuditor" in str(w.message)]
    assert len(ours) == 1
    assert "never ran in the forward pass" in str(ours[0].message) or kind == "sequential"
    assert "path to the loss is cut" in str(ours[0].message)
    report = auditor.report()
    # 6 batches, a check every 2 optimizer steps (with accumulation, every
    # 2 updates: 3 updates, checks at updates 0 and 2).
    assert report.checks == (2 if kind == "gradboost" else 3)
    assert set(report.layer_norms) == {"used", "out"}
    assert all(n > 0 for n in report.layer_norms.values())


@needs_layer_set_on_functional
def test_raise_stops_before_any_update():
    model, _ = _build("functional")
    model.compile(optimizer="sgd", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    x, y = _data()
    with pytest.raises(MissingGradientError, match="unused/kernel") as info:
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[GradientAuditor(on_missing="raise")])
    assert {m.reason for m in info.value.missing} == {"cut", "unused"}
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Keras calls no on_train_end after the error: the auditor undid itself,
    # so a plain fit trains without it.
    assert not wrappers.is_patched(model.train_function)
    model.fit(x, y, batch_size=8, verbose=0)
    assert any(np.any(a != b) for a, b in zip(before, model.get_weights()))


def test_a_healthy_model_reports_nothing_and_stays_quiet():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(3, name="d")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    model.compile(optimizer="sgd", loss="mse")
    auditor = GradientAuditor(every_n_steps=1, show_non_trainable=True)
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[auditor])
    report = auditor.report()
    assert auditor.missing == [] and report.zero_gradient == {}
    assert report.vanishing == {} and report.exploding == {}
    assert sorted(report.non_trainable_used) == ["bn/moving_mean", "bn/moving_variance"]
    assert report.checks == 6


def test_dead_relu_layer_is_flagged_and_only_it():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    alive = keras.layers.Dense(3, activation="relu", name="alive")(inputs)
    dead = keras.layers.Dense(
        3,
        activation="relu",
        name="dead",
        bias_initializer=keras.initializers.Constant(-100.0),  # inputs ~N(0, 1)
    )(inputs)
    h = keras.layers.Concatenate()([alive, dead])
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    model.compile(optimizer="sgd", loss="mse")
    auditor = GradientAuditor(every_n_steps=1, zero_checks=3, verbose=0)
    x, y = _data()
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[auditor])
    assert auditor.report().zero_gradient == {"dead/kernel": "dead", "dead/bias": "dead"}
    assert auditor.report().layer_norms["dead"] == 0.0


def test_exploding_and_vanishing_layers():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    branches = []
    for name, scale in (("big", 1e4), ("mid", 1.0), ("tiny", 1e-4)):
        scaled = keras.layers.Rescaling(scale, name=f"scale_{name}")(inputs)
        branches.append(keras.layers.Dense(2, use_bias=False, name=name)(scaled))
    head = keras.layers.Dense(1, name="head", trainable=False)
    model = keras.Model(inputs, head(keras.layers.Concatenate()(branches)))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    auditor = GradientAuditor(
        every_n_steps=2, vanishing_ratio=1e-2, exploding_ratio=1e2, verbose=0
    )
    x, y = _data()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[auditor])
    report = auditor.report()
    assert list(report.exploding) == ["big"] and list(report.vanishing) == ["tiny"]
    # Independently: the gradient norms on the batch of the last check
    # (optimizer step 4: batch 4; the learning rate is 0, so the weights are
    # those of every step).
    xb, yb = x[32:40], y[32:40]
    variables = [model.get_layer(n).kernel for n in ("big", "mid", "tiny")]
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(yb, model(xb, training=True))
    big, mid, tiny = [float(tf.norm(g)) for g in tape.gradient(loss, variables)]
    assert report.layer_norms["big"] == pytest.approx(big, rel=1e-4)
    assert report.exploding["big"] == pytest.approx(big / mid, rel=1e-4)
    assert report.vanishing["tiny"] == pytest.approx(tiny / mid, rel=1e-4)
    assert "exploding gradients" in report.summary()


@needs_layer_set_on_functional
def test_reused_auditor_and_second_fit_without_retrace():
    model, _ = _build("functional")
    model.compile(optimizer="sgd", loss="mse")
    auditor = GradientAuditor(on_missing="ignore", every_n_steps=3, verbose=0)
    x, y = _data()
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[auditor])
    first = auditor.report()
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[auditor])
    second = auditor.report()
    # The second fit does not trace again: the findings come from the trace
    # recorded in the first.
    assert sorted(m.variable for m in second.missing) == sorted(m.variable for m in first.missing)
    assert len(second.missing) == 4 and second.checks == 2
    # After fit nothing is left wrapped, and a plain fit trains as before.
    assert not wrappers.is_patched(model.train_function)
    before = model.get_weights()
    model.fit(x, y, batch_size=8, verbose=0)
    assert any(np.any(a != b) for a, b in zip(before, model.get_weights()))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"on_missing": "stop"}, ValueError, "on_missing='stop'"),
        ({"every_n_steps": 0}, ValueError, "every_n_steps=0"),
        ({"zero_checks": 1.5}, TypeError, "zero_checks=1.5"),
        ({"vanishing_ratio": 2}, ValueError, "vanishing_ratio=2"),
        ({"exploding_ratio": 0.5}, ValueError, "exploding_ratio=0.5"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientAuditor(**kwargs)


class ApplyStep(Branches):
    """A custom train step that calls `optimizer.apply` (not
    `apply_gradients`)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_custom_train_step_calling_optimizer_apply():
    keras.utils.set_random_seed(0)
    model = ApplyStep()
    model.compile(optimizer="sgd", loss="mse")
    auditor = GradientAuditor(every_n_steps=2, on_missing="ignore", verbose=0)
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras warns about the None gradients
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[auditor])
    assert {("/".join(m.variable.split("/")[-2:]), m.reason) for m in auditor.missing} == {
        ("cut/kernel", "cut"), ("cut/bias", "cut"),
        ("unused/kernel", "unused"), ("unused/bias", "unused"),
    }
    report = auditor.report()
    assert report.checks == 3  # 6 steps, every 2nd
    assert set(report.layer_norms) == {"used", "out"}
    assert all(n > 0 for n in report.layer_norms.values())


@needs_layer_set_on_functional
@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_cut_and_unused_variables_are_named_under_mirrored_strategy(cls):
    """The forward the auditor traces takes one replica's part of the batch
    (a distributed batch has no shape: it failed there)."""
    from conftest import shared_mirrored_strategy

    keras.utils.set_random_seed(0)
    with shared_mirrored_strategy().scope():
        model = _functional(cls)
        model.compile(optimizer="sgd", loss="mse")
    auditor = GradientAuditor(on_missing="ignore")
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[auditor])
    reasons = {"/".join(m.variable.split("/")[-2:]): m.reason for m in auditor.missing}
    assert reasons == {"cut/kernel": "cut", "cut/bias": "cut",
                       "unused/kernel": "unused", "unused/bias": "unused"}
