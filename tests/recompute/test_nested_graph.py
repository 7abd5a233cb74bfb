"""Segments of a functional layer's graph: keras.io's fine-tuning pattern
calls a keras.applications base as one layer of a functional model. Recomputed
whole, the base's replay holds all its activations at once, so "auto" saved
nothing (78.3 MiB estimated either way on MobileNetV2 at 64x64); it now cuts
the base's own graph, as a model's, and its calls run as a chain of the
segments. Each test compares with plain Keras or no recompute."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import base_classifier
from conftest import grappler
from keras_gradboost import GradBoostModel
from keras_gradboost import hooks
from keras_gradboost import precision_measure
from keras_gradboost import recompute
from keras_gradboost.recompute import choice
from keras_gradboost.recompute import estimates
from recompute.models import assert_same_state

BASE = "mobilenetv2_0.35_32"


def _data(samples=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(samples, 32, 32, 3)).astype("float32"), rng.integers(0, 3, samples)


def _fit(model, **compile_kwargs):
    x, y = _data()
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_kwargs,
    )
    return model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)


def _augmented(cls, seed=0):
    """keras.io's transfer-learning example, fine-tuned: random augmentation
    (a `Sequential`), the base called with `training=False`, a `Sequential`
    head with Dropout: three blocks, of which the base holds most layers."""
    keras.utils.set_random_seed(seed)
    augment = keras.Sequential(
        [keras.layers.RandomFlip("horizontal"), keras.layers.RandomRotation(0.1)],
        name="augment",
    )
    base = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), include_top=False, weights=None, alpha=0.35
    )
    inputs = keras.Input((32, 32, 3))
    h = base(augment(inputs), training=False)
    head = keras.Sequential([keras.layers.Dropout(0.2), keras.layers.Dense(3)], name="head")
    return cls(inputs, head(keras.layers.GlobalAveragePooling2D()(h)))


# (The base alone called with training=False, 37 s of CI, is left out to keep
# CI under its limit: "augmented" calls it so.)
BUILDS = {
    "called": lambda cls: base_classifier(cls),
    "augmented": _augmented,
}


@pytest.fixture(scope="module")
def called_reference():
    """`(model, history)`: the "called" build trained by plain Keras, the
    reference of the tests that train it with recompute (one fit, about 8
    s, shared by each worker's tests; a GradBoostModel without options
    trains exactly as it, test_model.py). Without graph rewrites, as the
    autouse `no_graph_rewrites` sets for each test after this fixture: this
    model is so ill-conditioned (BatchNormalization over 8 values) that
    plain Keras with and without them ends 0.73 apart."""
    before = grappler(True)
    try:
        reference = BUILDS["called"](keras.Model)
        return reference, _fit(reference)
    finally:
        grappler(before)


@pytest.mark.parametrize("kind", list(BUILDS))
def test_auto_cuts_a_nested_base_and_trains_exactly_like_keras(kind, onednn_convolutions, request):
    if kind == "called":
        reference, expected = request.getfixturevalue("called_reference")
    else:
        reference = BUILDS[kind](keras.Model)
        expected = _fit(reference)
    model = BUILDS[kind](GradBoostModel)
    # (With recompute_check, one traced step per segment comparing its
    # gradients with the model's own call, this took 87 s of CI, not 37:
    # left out to keep CI under its limit; the interaction matrix's
    # recompute_check cells check "auto"'s segments of a nested model.)
    history = _fit(model, recompute="auto")
    plan = model.recompute_plan()
    # Segments of the base's graph, named by it; before, "auto" chose none.
    assert len(plan.recomputed) >= 5, plan
    assert all(name.startswith(f"{BASE}/") for name in plan.recomputed), plan.recomputed
    assert plan.peak_bytes < 0.6 * plan.peak_bytes_without, plan
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)
    assert_same_state(reference, model)


# The base under a global mixed_bfloat16 policy, "auto" against no recompute
# (32-34 s of CI on an AVX2 CPU), dropped to keep CI under its limit: the
# interaction matrix trains "auto" on a nested functional tower in
# mixed_float16 (and, measuring precision, steps in mixed_bfloat16) against
# plain Keras, and the plans chosen
# under a policy set at compile or measured are tested below on this base's
# kind of graph.


def test_budgets_on_a_nested_base_are_monotonic_and_reach_auto(onednn_convolutions):
    spec = tf.TensorSpec((8, 32, 32, 3))
    auto = base_classifier(GradBoostModel)
    auto.compile(optimizer="sgd", loss="mse", recompute="auto")
    auto_plan = auto.recompute_plan(batch_size=8)
    model = base_classifier(GradBoostModel)
    model.compile(optimizer="sgd", loss="mse", recompute={"budget_mb": 1.0})
    _, _, _, found = model._gradboost.recompute.search(model, spec)
    assert (auto_plan.bytes_with, auto_plan.peak_bytes) in [(c.bytes, c.peak) for c in found]
    budgets = np.linspace(found[0].peak, 0.0, 21)
    peaks = [recompute.budget_choice(b, found)[0].peak for b in budgets]
    assert all(b <= a for a, b in zip(peaks, peaks[1:])), peaks
    assert min(peaks) <= auto_plan.peak_bytes < 0.6 * found[0].peak
    # A budget between no recompute's peak and "auto"'s recomputes a plan
    # that fits it. (Trained against no recompute, 50 s of CI, left out to
    # keep CI under its limit: the budget's plans train as "auto"'s do,
    # tests/recompute/test_estimates.py::test_budget_trains_exactly.)
    budget = (found[0].peak + auto_plan.peak_bytes) / 2
    chosen, fits = recompute.budget_choice(budget, found)
    assert fits and chosen.chosen and chosen.peak <= budget, chosen


def _conv_base(name):
    """Six convolution blocks (BatchNormalization, Dropout) as a functional
    model on 32x32 images: a base with cut points, seconds to trace."""
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for i in range(6):
        h = keras.layers.Conv2D(16, 3, padding="same", name=f"conv_{i}")(h)
        h = keras.layers.BatchNormalization(name=f"bn_{i}")(h)
        h = keras.layers.ReLU(name=f"relu_{i}")(h)
        h = keras.layers.Dropout(0.1, name=f"drop_{i}")(h)
    return keras.Model(inputs, h, name=name)


def _tower_classifier(cls):
    """`_conv_base` called as a layer, pooled, and a Dense head."""
    keras.utils.set_random_seed(0)
    base = _conv_base("tower_base")
    inputs = keras.Input((32, 32, 3))
    pooled = keras.layers.GlobalAveragePooling2D()(base(inputs))
    return cls(inputs, keras.layers.Dense(3)(pooled))


class OwnStep(GradBoostModel):
    """keras.io's pattern of an own `train_step` with its own forward."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True), training=True)
        self.minimize(tape, loss, count=tf.shape(x)[0])
        return {"loss": loss}


def _count_recomputed(monkeypatch):
    """A list that grows by one at each recomputed block call traced."""
    from keras_gradboost.recompute import mechanism

    calls, original = [], mechanism.recomputed

    def counted(*args, **kwargs):
        calls.append(args[2] if len(args) > 2 else kwargs.get("name"))
        return original(*args, **kwargs)

    monkeypatch.setattr(mechanism, "recomputed", counted)
    return calls


def test_an_own_train_step_runs_the_base_as_its_segments(monkeypatch, onednn_convolutions):
    # Top-level segments need GradBoostModel's forward (refused otherwise);
    # a nested base's run inside the model's own call, whoever calls it.
    # (The MobileNetV2 base took 22 s of CI, the tower 6: the tests above
    # cut MobileNetV2 in GradBoostModel's train_step against plain Keras.)
    reference = _tower_classifier(keras.Model)
    _fit(reference)
    model = _tower_classifier(OwnStep)
    traced = _count_recomputed(monkeypatch)
    _fit(model, recompute="auto")
    chosen = model.recompute_plan().recomputed
    assert chosen and all(name.startswith("tower_base/") for name in chosen), chosen
    assert traced and set(traced) == set(chosen)  # the step's trace ran them
    assert_same_state(reference, model)


class HeadOnly(GradBoostModel):
    """An own `train_step` that never calls the base."""

    def train_step(self, data):
        x, _ = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.layers[-1].kernel))
        self.minimize(tape, loss, count=tf.shape(x)[0])
        return {"loss": loss}


def test_an_own_step_that_never_calls_the_base_is_refused():
    model = base_classifier(HeadOnly)
    with pytest.raises(ValueError, match=f"made no call of '{BASE}'.*silently left out"):
        _fit(model, recompute="auto")


def _masked(cls=GradBoostModel):
    """Embedding(mask_zero=True) -> a functional tower of Dense layers (cut
    points between them) called as a layer -> pooling that reads the mask."""
    keras.utils.set_random_seed(0)
    inner = keras.Input((6, 16))
    h = inner
    for i in range(6):
        h = keras.layers.Dense(16, activation="tanh", name=f"d{i}")(h)
    tower = keras.Model(inner, h, name="tower")
    tokens = keras.Input((6,), dtype="int32")
    h = tower(keras.layers.Embedding(20, 16, mask_zero=True)(tokens))
    return cls(tokens, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))


@pytest.mark.filterwarnings("ignore:Layer .tower. .of type Functional. was passed an input with a mask")
def test_a_base_that_receives_a_keras_mask_is_not_cut():
    # The mask rides on the tensors, not in the tower's graph: a chain of
    # the tower's segments would lose it after the first recomputed one.
    model = _masked()
    tower = model.get_layer("tower")
    assert choice.nested_graphs(model, [tower]) == []
    unmasked = keras.Model(tower.input, tower(tower.input))
    assert choice.nested_graphs(unmasked, [tower]) == [tower]
    # Made to cut it anyway, the chain refuses the masked call loudly.
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    setup = model._gradboost.recompute
    setup.layers, setup.segments = [], choice.segments(tower, holder=tower)
    setup.apply()
    with pytest.raises(ValueError, match=r"'tower' into segments.*received one.*recompute=\['tower'\]"):
        setup.forward(model, tf.ones((2, 6), "int32"))


def test_no_cut_where_a_keras_mask_rides_on_the_tensor():
    # A mask made inside the graph (Embedding(mask_zero=True)) rides on the
    # tensors to the pooling that reads it; a recomputed segment's outputs
    # are new tensors, without it: the pooling would run unmasked.
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 16, mask_zero=True)(tokens)
    for i in range(6):
        h = keras.layers.Dense(16, activation="tanh", name=f"d{i}")(h)
    tower = keras.Model(tokens, h, name="tower")
    assert choice.cut_points(tower)[1] == []
    outer = keras.Input((6,), dtype="int32")
    model = keras.Model(outer, keras.layers.GlobalAveragePooling1D()(tower(outer)))
    assert choice.nested_graphs(model, [tower]) == []


def test_selective_auto_takes_the_base_segments_and_equals_no_recompute(
    onednn_convolutions, called_reference
):
    # Selective "auto" took the plan whose parts hold the most kernel
    # layers: the base whole (every convolution), estimated 78.2 of 78.3
    # MiB on MobileNetV2 at 64x64; a base whose graph is cut counts for its
    # segments only. Estimated here with every gradient alive (this
    # folder turns grappler's dependency optimizer off) and a replayed
    # BatchNormalization's backward counted with three gradients of its
    # input's size: 0.74x of no recompute's peak (0.7 before the latter);
    # with it on, as users run, the steps requested 3.1 MiB where no
    # recompute's requested 5.1 (0.61x; estimated 3.2 and 5.5).
    reference, _ = called_reference
    model = base_classifier(GradBoostModel)
    _fit(model, recompute={"policy": "selective"})
    plan = model.recompute_plan()
    assert len(plan.recomputed) >= 2 and all(
        name.startswith(f"{BASE}/") for name in plan.recomputed
    ), plan.recomputed
    assert plan.peak_bytes < 0.8 * plan.peak_bytes_without, plan
    assert_same_state(reference, model)


def _sequential_tower(cls):
    """A `Sequential` of convolution blocks (BatchNormalization, Dropout)
    called as a layer: its call runs its inner functional graph."""
    keras.utils.set_random_seed(0)
    layers = []
    for i in range(6):
        layers += [
            keras.layers.Conv2D(16, 3, padding="same", name=f"conv_{i}"),
            keras.layers.BatchNormalization(name=f"bn_{i}"),
            keras.layers.ReLU(name=f"relu_{i}"),
            keras.layers.Dropout(0.1, name=f"drop_{i}"),
        ]
    tower = keras.Sequential(layers, name="tower")
    inputs = keras.Input((32, 32, 3))
    pooled = keras.layers.GlobalAveragePooling2D()(tower(inputs))
    return cls(inputs, keras.layers.Dense(3)(pooled))


def test_auto_cuts_a_nested_sequential_and_trains_exactly_like_keras(onednn_convolutions):
    reference = _sequential_tower(keras.Model)
    expected = _fit(reference)
    model = _sequential_tower(GradBoostModel)
    history = _fit(model, recompute="auto")
    plan = model.recompute_plan()
    assert plan.recomputed and all(n.startswith("tower/") for n in plan.recomputed), plan
    assert plan.peak_bytes < 0.6 * plan.peak_bytes_without, plan
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)
    assert_same_state(reference, model)


def _siamese(cls):
    """One functional base called on two inputs (a siamese network):
    `_conv_base`. (MobileNetV2 as the base took 47 s of CI, left out to
    keep CI under its limit: the tests above cut it, called once, against
    plain Keras.)"""
    keras.utils.set_random_seed(0)
    base = _conv_base("siamese_base")
    a, b = keras.Input((32, 32, 3)), keras.Input((32, 32, 3))
    pooled = [keras.layers.GlobalAveragePooling2D()(base(x)) for x in (a, b)]
    return cls([a, b], keras.layers.Dense(3)(keras.layers.Concatenate()(pooled)))


def test_a_base_called_twice_runs_its_chain_at_each_call(monkeypatch, onednn_convolutions):
    traced = _count_recomputed(monkeypatch)
    x, y = _data(16)
    twin = np.flip(x, axis=1).copy()
    models = []
    for cls, setting in ((keras.Model, None), (GradBoostModel, "auto")):
        model = _siamese(cls)
        kwargs = {"recompute": setting} if setting else {}
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **kwargs,
        )
        model.fit([x, twin], y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        models.append(model)
    chosen = models[1].recompute_plan().recomputed
    assert chosen and all(name.startswith("siamese_base/") for name in chosen), chosen
    # Each chosen segment recomputed at both calls of the base, per trace.
    assert sorted(set(traced)) == sorted(chosen)
    assert all(traced.count(name) % 2 == 0 for name in chosen)
    assert_same_state(*models)


def _ops_graph(inputs):
    """Residual blocks whose adds are raw operations (`x + f(x)` on
    KerasTensors, as keras.applications.ConvNeXt's), each followed by a
    Dense layer: cut points before a raw add, and before a Dense alone."""
    t = keras.layers.Dense(32, name="stem")(inputs)
    for i in range(6):
        t = t + keras.ops.sin(keras.layers.Dense(32, name=f"d{i}")(t))
        t = keras.layers.Dense(32, name=f"mix{i}")(t)
    return t


def _ops_model(cls, nested):
    keras.utils.set_random_seed(0)
    x = keras.Input((64, 8))
    if nested:
        inner = keras.Input((64, 8))
        h = keras.Model(inner, _ops_graph(inner), name="tower")(x)
    else:
        h = _ops_graph(x)
    return cls(x, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))


def _numbers(figures):
    """A block's figures as numbers: tensor names, which the scopes of
    each trace prefix, give way to counts and byte sums."""
    out = {}
    for field, value in figures.items():
        if isinstance(value, dict):
            out[field] = (len(value), sum(v for v in value.values() if isinstance(v, int)))
        elif isinstance(value, (set, list, tuple)):
            out[field] = len(value)
        else:  # numbers, and `parent`: a key, id(layer), the same here
            out[field] = value
    return out


@pytest.mark.parametrize("precision", [None, "mixed_bfloat16"])
def test_one_trace_gives_each_kind_of_plan_the_figures_of_its_own_trace(precision, monkeypatch):
    # The search traces the step once for every kind of plan (here the
    # tower whole, the tower's segments, the model's segments): the model
    # run as its segments, the tower as the chain of its own. Each kind's
    # figures must be those of its own trace, as the search had (MobileNetV2
    # bases, ConvNeXtTiny, GPT-2 and BERT: byte for byte the same plans).
    # Under a policy set after building, a chain computes otherwise than
    # the graph's own call: the kinds that run one are traced on their own.
    model = _ops_model(GradBoostModel, nested=True)
    model.compile(optimizer="sgd", loss="mse", recompute="auto", precision=precision)
    assert choice.graphs_retyped(model) == bool(precision)
    setup = model._gradboost.recompute
    spec = tf.TensorSpec((4, 64, 8))
    kinds = choice.search_families(model)
    assert [bool(layers) for layers, _ in kinds] == [True, False, False]
    assert kinds[1][1][0].holder is not None and kinds[2][1][0].holder is None
    traces = []
    trace_step = estimates._trace_step
    monkeypatch.setattr(estimates, "_trace_step", lambda *a: traces.append(1) or trace_step(*a))
    together = setup._estimate_together(model, spec, kinds)
    # One trace; under the mixed policy, the tower's and the model's
    # segments each their own, the tower whole in the model's call.
    assert len(traces) == (3 if precision else 1)
    for (layers, pieces), (total, per_block, sizes) in zip(kinds, together):
        setup.layers, setup.segments = layers, pieces
        setup.apply()
        alone_total, alone, alone_sizes = setup._estimate(model, spec)
        assert total == alone_total
        assert sorted(sizes.values()) == sorted(alone_sizes.values())
        assert list(per_block) == list(alone)
        for key in per_block:
            assert _numbers(per_block[key]) == _numbers(alone[key]), key


@pytest.mark.filterwarnings("ignore:recompute=")
@pytest.mark.parametrize("nested", [True, False], ids=["tower", "model"])
def test_precision_set_at_compile_cuts_no_graph_before_a_raw_operation(nested):
    # compile(precision=...) sets the layers' policies after the graph was
    # built in float32: a segment converts its input to float32, and a raw
    # add after the cut computed in float32 where the model computes in
    # bfloat16 (a silent difference). Such cuts are left out.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 64, 8)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    models = []
    for setting in (None, {"budget_mb": 0.01}):
        model = _ops_model(GradBoostModel, nested)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse",
            precision="mixed_bfloat16", recompute=setting,
        )
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        models.append(model)
    chosen = models[1].recompute_plan().recomputed  # cut where the readers cast
    assert chosen and all(n.startswith("tower/") for n in chosen) == nested, chosen
    assert_same_state(*models, atol=0)
    # The cuts left: after each raw add (read by a Dense alone), none where
    # a raw add reads the tensor.
    graph = models[1].get_layer("tower") if nested else models[1]
    calls, cuts = choice.cut_points(graph)
    read_raw = {
        id(t) for op, inputs, _ in calls if not isinstance(op, keras.layers.Layer)
        for t in inputs
    }
    assert sum(not isinstance(calls[i][0], keras.layers.Layer) for i in cuts) == 6
    assert not [i for i in cuts if id(calls[i][2][0]) in read_raw]


def test_a_functional_class_with_its_own_call_is_not_cut():
    # Its `call` may run something else than its graph (keras-hub has such
    # classes): the chain of its graph's segments would replace it.
    class Doubled(keras.Model):
        def call(self, inputs, training=None):
            return super().call(inputs, training=training) * 2.0

    inner = keras.Input((8,))
    h = inner
    for i in range(4):
        h = keras.layers.Dense(8, name=f"d{i}")(h)
    doubled, plain = Doubled(inner, h), keras.Model(inner, h)
    assert hooks.layer_graph(plain) is plain
    assert hooks.layer_graph(doubled) is None
    x = keras.Input((8,))
    model = keras.Model(x, doubled(x))
    assert choice.nested_graphs(model, [doubled]) == []


def _raw_read_cuts(graph):
    """The cut points of `graph` (under its layers' policies now) that a
    raw operation reads."""
    calls, cuts = choice.cut_points(graph)
    read_raw = {
        id(t) for op, inputs, _ in calls if not isinstance(op, keras.layers.Layer)
        for t in inputs
    }
    return [i for i in cuts if id(calls[i][2][0]) in read_raw]


@pytest.mark.filterwarnings("ignore:recompute=")
@pytest.mark.parametrize("setting", [{"policy": "selective"}, "auto"], ids=["selective", "auto"])
def test_a_plan_chosen_at_compile_takes_the_cuts_of_the_policy_compile_sets(setting, monkeypatch):
    # Selective "auto" chooses at compile, before compile(precision=...)
    # sets the policy: in float32 a cut before a raw add is fine, and under
    # the policy the add would compute in float32 after it. It used to
    # refuse at the first trace; the plan is now made again under the
    # policy the step traces with. "auto" chooses at the first batch, at
    # fit's batch size (these batches have no fixed size), as the plan
    # reported before fit at that size.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 64, 8)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # no fixed batch size
    models = []
    for recompute_setting in (None, setting):
        model = _ops_model(GradBoostModel, nested=False)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse",
            precision="mixed_bfloat16", recompute=recompute_setting,
        )
        if recompute_setting is not None:
            plan = model.recompute_plan(batch_size=16)  # under the policy, before fit
            traced = _count_recomputed(monkeypatch)
        model.fit(data, epochs=2, verbose=0)
        models.append(model)
    assert_same_state(*models, atol=0)
    assert model.recompute_plan().recomputed == plan.recomputed
    assert plan.recomputed and set(traced) == set(plan.recomputed)  # what trained
    setup = model._gradboost.recompute
    assert len(setup.segments) > 2
    # No segment starts where a raw add reads (each reader casts).
    assert all(s.readers_cast for s in setup.segments[1:])


@pytest.mark.filterwarnings("ignore:recompute=")
@pytest.mark.parametrize("winner", ["float32", "mixed_bfloat16"])
def test_measured_precision_recomputes_with_each_candidate_s_own_cuts(monkeypatch, winner):
    # precision="measure" traces float32 and mixed_bfloat16 in turn: "auto"
    # chose at the float32 trace (cutting before the raw adds), and the
    # bfloat16 candidate's trace then refused those cuts mid-fit. Each
    # candidate now traces with its own plan, and the plan reported is the
    # winner's. Exact: the same measured fit without recompute.
    from test_precision_measure import FakeClock

    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 64, 8)).astype("float32")
    y = rng.normal(size=(160, 3)).astype("float32")
    ms = {"float32": 2.0, "mixed_bfloat16": 9.0}
    if winner != "float32":
        ms = {"float32": 9.0, "mixed_bfloat16": 2.0}
    models = []
    for setting in (None, "auto"):
        model = _ops_model(GradBoostModel, nested=True)
        if setting:
            traced = _count_recomputed(monkeypatch)
        monkeypatch.setattr(precision_measure, "perf_counter", FakeClock(model, ms))
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse", precision="measure",
            recompute=setting,
        )
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert model.precision_measurement.policy == winner
        models.append(model)
    assert_same_state(*models, atol=0)
    chosen = model.recompute_plan().recomputed
    assert chosen and all(n.startswith("tower/") for n in chosen), chosen
    # The plan is the winner's: in bfloat16 no segment starts where a raw
    # add reads (in float32 some may).
    setup = model._gradboost.recompute
    raw_starts = [s.name for s in setup.segments[1:] if not s.readers_cast]
    assert bool(raw_starts) == (winner == "float32"), raw_starts
    # Both candidates traced recomputes, of plans that differ: the float32
    # one's and the winner's.
    assert set(chosen) <= set(traced)
    assert len(set(traced)) > len(set(chosen)) or winner == "float32"
    assert bool(_raw_read_cuts(model.get_layer("tower"))) == (winner == "float32")


def test_a_segment_refuses_an_input_whose_dtype_changed_since_its_cut_was_chosen():
    # The guard behind the re-made plans: a segment of a graph built in
    # float32 whose input arrives in bfloat16 and is read by a raw add.
    model = _ops_model(keras.Model, nested=False)
    pieces = choice.segments(model, cuts=choice.cut_points(model)[1])
    raw = next(p for p in pieces[1:] if not p.readers_cast)
    with pytest.raises(ValueError, match="arrives as bfloat16.*converts it to float32.*policy changed"):
        raw.check_input(tf.zeros((2, 64, 32), "bfloat16"))
    raw.check_input(tf.zeros((2, 64, 32), "float32"))


def _raw_residuals(cls, head):
    """Dense layers each added to its input by a raw add (then a Dense
    `head`, or not): in float32 a cut after each add; under a policy set
    after building, none where a raw add reads (the head's input only)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((16,))
    h = keras.layers.Dense(16)(x)
    for _ in range(6):
        h = h + keras.layers.Dense(16, activation="tanh")(h)
    return cls(x, keras.layers.Dense(16)(h) if head else h)


@pytest.mark.parametrize("head", [True, False], ids=["head", "adds"])
def test_no_cut_under_a_policy_set_after_building_says_why(head):
    # "auto" recomputes nothing (a cut before the head alone), or finds
    # nothing to recompute (no cut at all): both say that a raw operation
    # reads each point, and to set the policy before building.
    x, y = np.zeros((16, 16), "float32"), np.zeros((16, 16), "float32")
    assert len(choice.cut_points(_raw_residuals(keras.Model, head))[1]) >= 6
    model = _raw_residuals(GradBoostModel, head)
    model.compile(optimizer="sgd", loss="mse", precision="mixed_bfloat16", recompute="auto")
    before = [v.numpy() for v in model.trainable_variables]
    why = "raw `x \\+ f\\(x\\)`.*set_global_policy"
    if head:
        with pytest.warns(UserWarning, match="nothing is recomputed.*" + why):
            model.fit(x, y, batch_size=8, verbose=0)
        return
    with pytest.raises(ValueError, match="no single-tensor cut point.*" + why):
        model.fit(x, y, batch_size=8, verbose=0)
    for a, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(a, v.numpy())


class Halved(GradBoostModel):
    """A functional class whose `call` runs more than its graph."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=training) * 0.5


def _halved(blocks):
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    h = x
    for i in range(4):
        if blocks:
            pair = [keras.layers.Dense(8, activation="tanh") for _ in range(2)]
            h = keras.Sequential(pair, name=f"block_{i}")(h)
        else:
            h = keras.layers.Dense(8, activation="tanh")(h)
    return Halved(x, h)


@pytest.mark.parametrize(
    "setting", ["auto", {"budget_mb": 0.001}, {"policy": "selective"}],
    ids=["auto", "budget", "selective"],
)
def test_a_model_class_with_its_own_call_keeps_it(setting):
    # Its graph has cut points, and a plan of its own graph's segments runs
    # them instead of its `call`: the halving was silently dropped (a
    # budget trained off no recompute). Only nested blocks may be chosen:
    # with them, training equals no recompute; without, it says why.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = np.ones((16, 8), "float32")
    assert choice.cut_points(_halved(blocks=False))[1]
    models = []
    for recompute_setting in (None, setting):
        model = _halved(blocks=True)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", recompute=recompute_setting)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        models.append(model)
    assert_same_state(*models, atol=0)
    recomputed = models[1].recompute_plan().recomputed
    assert recomputed and all(n.startswith("block_") for n in recomputed), recomputed
    model = _halved(blocks=False)
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match="its class Halved overrides `call`.*Name the layers"):
        model.compile(optimizer="sgd", loss="mse", recompute=setting)
        model.fit(x, y, batch_size=8, verbose=0)
    for a, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(a, v.numpy())


class TwoStacks(GradBoostModel):
    """A subclassed model whose `Sequential`s are built at its first call:
    its layers grow then (their inner models appear)."""

    def __init__(self):
        super().__init__()
        self.a = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8)])
        self.b = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8)])

    def call(self, x):
        return self.b(self.a(x))


@pytest.mark.filterwarnings("ignore:recompute=")
def test_layers_built_at_the_first_call_keep_the_plan_that_trained(monkeypatch):
    # Layers appearing after the plan was chosen are no change of policy:
    # the plan reported after fit is the one that trained (it was chosen
    # again, reported as a new trial, with a "nothing is recomputed"
    # warning, and a retrace would have chosen once more).
    keras.utils.set_random_seed(0)
    model = TwoStacks()
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    traced = _count_recomputed(monkeypatch)
    x = np.random.default_rng(0).random((16, 8)).astype("float32")
    model.fit(x, x, batch_size=8, verbose=0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recomputed = model.recompute_plan().recomputed
    assert recomputed and {n.split("/")[-1] for n in recomputed} == set(traced)
    assert not model._gradboost.recompute.pending


def test_a_policy_with_nothing_to_cut_keeps_the_earlier_plan():
    # Under a policy where the graph has no cut point, the plan cannot be
    # made (a ValueError, each time); the plan made before stays for its
    # policy, instead of an empty one saved over it.
    from keras_gradboost import precision

    model = _raw_residuals(GradBoostModel, head=False)
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    x = np.zeros((8, 16), "float32")
    model.fit(x, x, batch_size=8, verbose=0)  # the plan is made, in float32
    before = model.recompute_plan().recomputed
    assert before
    precision.apply_policy(model, "mixed_bfloat16")
    for _ in range(2):
        with pytest.raises(ValueError, match="no single-tensor cut point"):
            model.recompute_plan()
    precision.apply_policy(model, "float32")
    assert model.recompute_plan().recomputed == before


class OwnForwardStep(GradBoostModel):
    """A train_step of its own, whose forward is the model's own call."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True), training=True)
        self.minimize(tape, loss)
        return {"loss": loss}


def _two_residual_blocks(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    for i in (1, 2):
        block = keras.Sequential(
            [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(8)], name=f"block_{i}"
        )
        h = keras.layers.Add()([h, block(h)])
    return cls(inputs, keras.layers.Dense(3, name="out")(h))


def test_auto_with_an_own_train_step_chooses_what_its_forward_runs():
    # With every gradient held to the end (global_clipnorm), "auto" found
    # the segments of the model's own graph lowest, which only
    # GradBoostModel's forward runs: the first trace raised. Nested blocks
    # run in any forward.
    x = np.random.default_rng(0).random((16, 5)).astype("float32")
    y = np.random.default_rng(1).random((16, 3)).astype("float32")
    weights = {}
    for setting in (None, "auto"):
        model = _two_residual_blocks(OwnForwardStep)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, global_clipnorm=1.0),
            loss="mse",
            recompute=setting,
        )
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
        weights[setting] = model.get_weights()
        if setting:
            assert model.recompute_plan(batch_size=4).recomputed == ["block_1", "block_2"]
    for a, b in zip(weights[None], weights["auto"]):
        np.testing.assert_array_equal(a, b)
