"""The per-model setup: its lifecycle (the budget's batch size from fit's
arguments, the first batch, the check) and save/load."""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import grappler
from conftest import max_weight_diff
from keras_gradboost import GradBoostModel
from keras_gradboost import recompute
from recompute.models import flat_model
from recompute.models import residual_model
from recompute.models import train


def test_save_and_load_keeps_recompute(data, tmp_path):
    x, y = data
    model = residual_model(rate=0.0)  # Keras does not save seed states
    train(model, x, y, recompute=["res_1"])
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.gradboost_config.recompute == ("res_1",)
    assert loaded.recompute_plan().recomputed == ["res_1"]
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert max_weight_diff(model, loaded) < 1e-6



# ------------------------------------------------------------------ lifecycle


def _dataset(batch, drop_remainder=True):
    x = np.zeros((20, 5), "float32")
    return tf.data.Dataset.from_tensor_slices((x, x)).batch(batch, drop_remainder)


def _samples(sizes=(4,)):
    for size in sizes:
        yield np.zeros((size, 5), "float32"), np.zeros((size, 1), "float32")


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 3

    def __getitem__(self, index):
        return np.zeros((6, 5), "float32"), np.zeros((6, 1), "float32")


@pytest.mark.parametrize(
    "fit_args, expected",
    [
        ({"x": np.zeros((64, 5))}, 32),  # fit's default batch size
        ({"x": np.zeros((64, 5)), "batch_size": 16}, 16),
        ({"x": np.zeros((10, 5)), "batch_size": 16}, 10),  # fewer samples
        ({"x": [np.zeros((64, 5)), np.zeros((64, 2))], "batch_size": 8}, 8),
        ({"x": {"a": np.zeros((64, 5))}, "batch_size": None}, 32),
        ({"x": _dataset(8)}, 8),  # from the element spec
        ({"x": _dataset(8, drop_remainder=False)}, 8),  # from the first batch
        ({"x": _Batches()}, 6),  # its first batch, as Keras reads it
        ({"x": None}, None),
        ({}, None),
        ({"x": iter([np.zeros((4, 5))])}, None),  # an iterator Keras does not take
    ],
)
def test_batch_size_hint_from_fit_arguments(fit_args, expected):
    assert recompute.batch_size_hint(fit_args) == expected


def test_batch_size_hint_reads_a_generators_first_batch_and_yields_it_again():
    fit_args = {"x": _samples((4, 3))}
    assert recompute.batch_size_hint(fit_args) == 4
    assert [x.shape[0] for x, _ in fit_args["x"]] == [4, 3]  # nothing lost
    empty = {"x": _samples(())}
    assert recompute.batch_size_hint(empty) is None


def _arguments(batch_size):
    return {"x": np.zeros((64, 5)), "batch_size": batch_size}


def test_before_fit_takes_the_budgets_batch_size_once():
    # A budget chooses nothing at construction: no model is needed.
    setup = recompute.RecomputeSetup(None, {"budget_mb": 1.0})
    setup.before_fit(_arguments(16))
    setup.before_fit(_arguments(8))  # an earlier fit gave one
    assert setup.batch_hint == 16


def test_before_fit_keeps_the_settings_batch_size():
    setup = recompute.RecomputeSetup(None, {"budget_mb": 1.0, "batch_size": 4})
    setup.before_fit(_arguments(16))
    assert setup.batch_hint == 4


def test_before_fit_takes_autos_batch_size_per_replica():
    # "auto" chooses by the estimates at the first batch too: a batch of no
    # fixed size in the trace needs the size from fit's arguments.
    setup = recompute.RecomputeSetup(residual_model(), "auto")
    setup.before_fit(_arguments(16), replicas=2)
    assert setup.batch_hint == 8
    odd = recompute.RecomputeSetup(residual_model(), "auto")
    odd.before_fit(_arguments(15), replicas=2)
    assert odd.batch_hint == 8  # the larger share


def test_before_fit_reads_no_batch_for_named_blocks():
    setup = recompute.RecomputeSetup(residual_model(), ["res_*"])
    samples = _samples()
    arguments = {"x": samples}
    setup.before_fit(arguments)
    assert setup.batch_hint is None and arguments["x"] is samples
    assert len(list(samples)) == 1  # not read


def test_prepare_records_the_first_batchs_specs_once():
    model = residual_model()
    setup = recompute.RecomputeSetup(model, "auto")
    setup.prepare(model, tf.TensorSpec((None, 5)))  # a trace of no fixed batch
    assert setup.input_spec == tf.TensorSpec((5,), tf.float32)
    assert setup.batch_hint is None
    setup.prepare(model, tf.zeros((16, 7)))  # later batches change nothing
    assert setup.input_spec == tf.TensorSpec((5,), tf.float32)
    assert setup.batch_hint is None


def test_prepare_chooses_the_budgets_blocks_at_the_first_batch():
    model = residual_model()
    model.compile(optimizer="sgd", loss="mse", recompute={"budget_mb": 1e6})
    setup = model._gradboost.recompute
    assert setup.pending and setup.layers == []
    setup.prepare(model, tf.zeros((16, 5)))
    assert not setup.pending
    assert [layer.name for layer in setup.layers] == ["res_0", "res_1", "res_2"]
    assert all(recompute.is_marked(layer) for layer in setup.layers)
    assert setup.chosen == set()  # everything fits a huge budget
    assert setup.plan.batch_size == 16 and model.recompute_plan() is setup.plan
    setup.prepare(model, tf.zeros((8, 5)))  # settled: nothing changes
    assert model.recompute_plan().batch_size == 16


def test_prepare_without_a_batch_size_says_to_add_one():
    model = residual_model()
    setup = recompute.RecomputeSetup(model, {"budget_mb": 1.0})
    with pytest.raises(ValueError, match=r'needs the batch size.*"batch_size": B'):
        setup.prepare(model, tf.TensorSpec((None, 5)))
    assert setup.pending


def _sequence_model(length):
    """Dense layers over (length, 8) sequences: cut points between them."""
    inputs = keras.Input((length, 8))
    x = inputs
    for i in range(4):
        x = keras.layers.Dense(16, activation="relu", name=f"seq_{i}")(x)
    return GradBoostModel(inputs, keras.layers.Dense(1, name="seq_out")(x))


def test_budget_with_sequences_of_unknown_length_says_to_fix_it():
    # Tensors of unknown size would count 0 bytes: the budget would be met
    # by any plan. It refuses instead, naming the dimension.
    model = _sequence_model(None)
    setup = recompute.RecomputeSetup(model, {"budget_mb": 1.0})
    with pytest.raises(ValueError, match=r"unknown size \(input axis 1\).*padded_batch"):
        setup.prepare(model, tf.TensorSpec((16, None, 8)))
    assert setup.pending


def test_plan_of_sequences_of_unknown_length_has_no_estimate():
    fixed = _sequence_model(32)
    fixed.compile(optimizer="sgd", loss="mse", recompute="auto")
    assert fixed.recompute_plan(batch_size=16).bytes_without > 16 * 32 * 16 * 4
    model = _sequence_model(None)
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    plan = model.recompute_plan(batch_size=16)
    assert plan.bytes_without is None and plan.batch_size is None
    model.fit(np.zeros((32, 12, 8), "float32"), np.zeros((32, 12, 1), "float32"),
              batch_size=16, epochs=1, verbose=0)
    # At fit the traced batches have a length: estimated from them.
    assert model.recompute_plan().bytes_without > 16 * 12 * 16 * 4


def test_auto_without_shapes_to_estimate_says_what_it_recomputes():
    # Sequences of varying length from a generator: nothing to estimate at.
    # "auto" keeps the blocks found at compile, and says so.
    model = _sequence_model(None)
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    compiled = model.recompute_plan().recomputed
    assert compiled
    batches = ((np.zeros((4, n, 8), "float32"), np.zeros((4, n, 1), "float32"))
               for n in (5, 7, 9))
    with pytest.warns(UserWarning, match=r"unknown size \(input axis 1\)") as caught:
        model.fit(batches, epochs=1, verbose=0)
    said = [str(w.message) for w in caught if "cannot estimate" in str(w.message)]
    blocks = f"{len(compiled)} block{'s' * (len(compiled) > 1)}"
    assert len(said) == 1 and f"recomputes the {blocks} found at compile" in said[0]
    assert all(name in said[0] for name in compiled)
    plan = model.recompute_plan()
    assert plan.recomputed == compiled and "not estimated" in str(plan)


def test_check_settles_the_budget_first(data):
    x, y = data
    model = residual_model()
    model.compile(optimizer="sgd", loss="mse", recompute={"budget_mb": 0.001})
    setup = model._gradboost.recompute
    with pytest.warns(UserWarning, match="cannot be brought under"):
        setup.check(model, (x[:16], y[:16]))  # the blocks agree: no error
    assert not setup.pending and setup.plan.batch_size == 16
    assert model.recompute_plan().recomputed  # the lowest estimate: something


def test_budget_candidates_are_autos_layers_or_every_segment():
    layers, pieces = recompute.budget_candidates(residual_model())
    assert [layer.name for layer in layers] == ["res_0", "res_1", "res_2"]
    assert pieces == []
    model = flat_model()
    layers, pieces = recompute.budget_candidates(model)
    _, cuts = recompute.cut_points(model)
    assert layers == [] and len(pieces) == len(cuts) + 1 and pieces[-1].last


@pytest.mark.parametrize("onednn, has_conv, jit_compile, noted", [
    (False, True, False, True),  # Eigen's convolution kernels: their buffers are counted
    (True, True, False, False),
    (False, False, False, False),  # no convolution: nothing to say
    (False, True, True, False),  # a step compiled whole by XLA runs none of them
])
def test_the_plan_counts_eigen_convolution_buffers(
    monkeypatch, onednn, has_conv, jit_compile, noted
):
    """Where oneDNN is off, a Conv2D's backward allocates an im2col buffer
    for as many images as fit 30 MiB: [6426, 6 * 6, 3 * 3 * 3] floats here
    (its input, the model's, has no gradient: one buffer), which the
    training peak counts and the plan says; not under jit_compile=True."""
    from keras_gradboost import hooks
    from keras_gradboost import precision

    monkeypatch.setattr(hooks, "onednn_enabled", lambda: onednn)
    monkeypatch.setattr(precision, "gpu_available", lambda: False)  # these kernels are a CPU's
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    layer = keras.layers.Conv2D(4, 3, name="block") if has_conv else keras.layers.Dense(4, name="block")
    h = keras.Sequential([layer], name="seq")(inputs)
    model = GradBoostModel(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    model.compile(optimizer="sgd", loss="mse", recompute=["seq"], jit_compile=jit_compile)
    plan = model.recompute_plan(batch_size=4)
    assert plan.eigen_convolutions is noted
    assert ("Eigen convolution kernels" in str(plan)) is noted
    monkeypatch.setattr(hooks, "onednn_enabled", lambda: True)
    without = model.recompute_plan(batch_size=4)
    buffer = 6426 * 36 * 27 * 4
    added = plan.peak_bytes - without.peak_bytes
    assert (buffer - 2 * 4 * 36 * 4 <= added <= buffer) if noted else added == 0
    assert plan.bytes_with == without.bytes_with  # activations alone: unchanged
    # What the plan says they add is that difference.
    assert plan.working_buffer_bytes == added
    assert ("MiB to this plan's training peak" in str(plan)) is noted


def _pointwise_tower(cls):
    """3x3 and 1x1 convolutions in turn on 8x8 images, flattened into a
    Dense head: a graph with cut points, each 1x1 one a matmul candidate."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = inputs
    for i in range(3):
        h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name=f"wide_{i}")(h)
        h = keras.layers.Conv2D(8, 1, activation="relu", name=f"point_{i}")(h)
    return cls(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))


def test_auto_says_what_plans_reach_without_the_eigen_buffers(monkeypatch):
    """Where oneDNN is off, each Conv2D's backward allocates im2col buffers
    of up to 30 MiB, whatever is recomputed: they bound what every plan
    saves, and the plan says by how much. Without them, its peak is the
    same plan's where oneDNN runs the convolutions, and the plans reach the
    lowest of that search. A budget between the two cannot be met and says
    why, and what removes them: oneDNN, or pointwise="matmul" for the 1x1
    layers (3 here), after which the 3x3 convolutions' are left (here they
    hold the peak)."""
    from keras_gradboost import hooks
    from keras_gradboost import precision
    from keras_gradboost.recompute import setup

    monkeypatch.setattr(precision, "gpu_available", lambda: False)
    spec = tf.TensorSpec((4, 8, 8, 3))

    def searched(onednn, **compile_kwargs):
        monkeypatch.setattr(hooks, "onednn_enabled", lambda: onednn)
        model = _pointwise_tower(GradBoostModel)
        model.compile(optimizer="adam", loss="mse", recompute="auto", **compile_kwargs)
        total, _, _, found = model._gradboost.recompute.search(model, spec)
        best = recompute.auto_choice(total, found, setup.MIN_AUTO_SAVING, recompute.AUTO_SLACK)
        return model.recompute_plan(batch_size=4), found, (best.layout, best.chosen)

    plan, found, chosen = searched(onednn=False)
    free_plan, free_found, _ = searched(onednn=True)
    lowest_free = min(c.peak for c in free_found)
    assert plan.eigen_convolutions and not free_plan.eigen_convolutions
    assert plan.recomputed and plan.working_buffer_bytes > 4 * 2**20
    assert free_plan.working_buffer_bytes == 0
    # Without them: the same plan's peak where oneDNN runs the convolutions.
    same = {(c.layout, c.chosen): c.peak for c in free_found}[chosen]
    assert plan.peak_bytes - plan.working_buffer_bytes == same
    assert plan.lowest_unbuffered_bytes == lowest_free
    assert free_plan.lowest_unbuffered_bytes is None
    assert plan.pointwise_convolutions == 3
    text = str(plan)
    assert f"they add ~{plan.working_buffer_bytes / 2**20:.1f} MiB to this plan's" in text
    assert 'compile(pointwise="matmul") removes those of its 3 1x1 Conv2D layers' in text

    budget = (lowest_free + min(c.peak for c in found)) / 2 / 2**20
    monkeypatch.setattr(hooks, "onednn_enabled", lambda: False)
    model = _pointwise_tower(GradBoostModel)
    model.compile(optimizer="adam", loss="mse", recompute={"budget_mb": budget})
    with pytest.warns(UserWarning, match="cannot be brought under") as caught:
        budgeted = model.recompute_plan(batch_size=4)
    said = " ".join(str(w.message) for w in caught)
    assert f"without them the plans reach ~{lowest_free / 2**20:.1f} MiB, under the budget" in said
    assert "TF_ENABLE_ONEDNN_OPTS=1" in said and "runs the 3 1x1 Conv2D layers" in said
    assert budgeted.lowest_unbuffered_bytes == lowest_free
    # A budget under what they reach without them: still over it.
    model = _pointwise_tower(GradBoostModel)
    model.compile(optimizer="adam", loss="mse", recompute={"budget_mb": lowest_free / 2 / 2**20})
    with pytest.warns(UserWarning, match="cannot be brought under") as caught:
        model.recompute_plan(batch_size=4)
    said = " ".join(str(w.message) for w in caught)
    assert f"without them the plans reach ~{lowest_free / 2**20:.1f} MiB, still over it" in said

    # With the 1x1 layers as matmuls: none left to name.
    matmul_plan, _, _ = searched(onednn=False, pointwise="matmul")
    assert matmul_plan.pointwise_convolutions == 0
    assert 0 < matmul_plan.working_buffer_bytes <= plan.working_buffer_bytes
    assert "pointwise=" not in str(matmul_plan).split("they add")[1]


def test_auto_that_recomputes_nothing_says_what_the_eigen_buffers_hold(monkeypatch):
    """A model whose only convolution's buffers dwarf its activations:
    "auto" recomputes nothing, its warning says what the buffers hold and
    what the plans reach without them (no recompute's peak where oneDNN
    runs the convolution), and no budget is compared."""
    from keras_gradboost import hooks
    from keras_gradboost import precision

    monkeypatch.setattr(precision, "gpu_available", lambda: False)

    def planned(onednn):
        monkeypatch.setattr(hooks, "onednn_enabled", lambda: onednn)
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(8, 1, name="point")(inputs)
        model = GradBoostModel(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
        model.compile(optimizer="adam", loss="mse", recompute="auto")
        with pytest.warns(UserWarning, match="nothing is recomputed") as caught:
            plan = model.recompute_plan(batch_size=4)
        return plan, " ".join(str(w.message) for w in caught)

    plan, said = planned(onednn=False)
    free_plan, free_said = planned(onednn=True)
    assert plan.recomputed == free_plan.recomputed == []
    assert plan.peak_bytes - plan.working_buffer_bytes == free_plan.peak_bytes
    assert plan.lowest_unbuffered_bytes == free_plan.peak_bytes < plan.peak_bytes / 10
    assert (
        f"(~{plan.working_buffer_bytes / 2**20:.1f} MiB at this plan's), which recompute "
        f"cannot remove; without them the plans reach ~{free_plan.peak_bytes / 2**20:.1f} "
        "MiB: TF_ENABLE_ONEDNN_OPTS=1"
    ) in said
    assert "1 1x1 Conv2D layer as matmuls" in said
    assert "Eigen" not in free_said


@pytest.mark.filterwarnings("ignore:precision=.mixed_float16. on a CPU without XLA")
@pytest.mark.parametrize("onednn", [True, False])
def test_float16_convolutions_are_not_sent_to_onednn(monkeypatch, onednn):
    """oneDNN leaves float16 convolutions to Eigen's kernels, whether it is
    on or off: the advice names another precision policy, not
    TF_ENABLE_ONEDNN_OPTS."""
    from keras_gradboost import hooks
    from keras_gradboost import precision

    monkeypatch.setattr(precision, "gpu_available", lambda: False)
    monkeypatch.setattr(hooks, "onednn_enabled", lambda: onednn)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 1, name="point")(inputs)
    model = GradBoostModel(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    model.compile(optimizer="sgd", loss="mse", recompute="auto", precision="mixed_float16")
    with pytest.warns(UserWarning, match="nothing is recomputed") as caught:
        plan = model.recompute_plan(batch_size=4)
    said = " ".join(str(w.message) for w in caught)
    assert plan.eigen_convolutions and plan.working_buffer_bytes > 2**20
    assert "oneDNN leaves float16 convolutions to these kernels" in said
    assert "TF_ENABLE_ONEDNN_OPTS" not in said
    # The plan's own line says why as well (it named TF_ENABLE_ONEDNN_OPTS
    # wherever oneDNN was off).
    assert plan.eigen_dtypes == ("float16",)
    assert "(oneDNN leaves float16 convolutions to them)" in str(plan)
    assert "TF_ENABLE_ONEDNN_OPTS" not in str(plan)


@pytest.mark.filterwarnings("ignore:precision=.mixed_float16. on a CPU without XLA")
@pytest.mark.parametrize("onednn", [True, False])
def test_float16_and_float32_convolutions_each_get_their_reason(monkeypatch, onednn):
    """A mixed_float16 model whose output layer is a Conv2D (kept float32,
    as the mixed-precision guide advises) after a float16 one: oneDNN
    leaves the float16 one to Eigen's kernels either way, and would take
    the float32 one where it is off. The plan's line and the advice say
    both then, and only the first where it is on."""
    from keras_gradboost import hooks
    from keras_gradboost import precision

    monkeypatch.setattr(precision, "gpu_available", lambda: False)
    monkeypatch.setattr(hooks, "onednn_enabled", lambda: onednn)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 1, name="point")(inputs)
    model = GradBoostModel(inputs, keras.layers.Conv2D(2, 1, name="head")(h))
    model.compile(optimizer="sgd", loss="mse", recompute="auto", precision="mixed_float16")
    assert model.get_layer("head").compute_dtype == "float32"
    with pytest.warns(UserWarning, match="nothing is recomputed") as caught:
        plan = model.recompute_plan(batch_size=4)
    said = " ".join(str(w.message) for w in caught)
    assert plan.eigen_dtypes == (("float16", "float32") if not onednn else ("float16",))
    assert "oneDNN leaves float16 convolutions to these kernels" in said
    assert ("TF_ENABLE_ONEDNN_OPTS=1 runs the float32" in said) is not onednn
    line = "oneDNN is off on this CPU; TF_ENABLE_ONEDNN_OPTS=1 turns it on, and needs less memory"
    assert (f"({line}; oneDNN leaves float16 convolutions to them)" in str(plan)) is not onednn
    if onednn:
        assert "(oneDNN leaves float16 convolutions to them)" in str(plan)


def test_the_plan_says_what_plans_reach_without_the_buffers():
    """The plan's line: the buffers' bytes, its peak without them, and the
    lowest of the plans searched when that is lower."""
    plan = recompute.RecomputePlan(
        setting="auto", batch_size=4, bytes_without=0, bytes_with=0, gradient_bytes=0,
        peak_bytes=60 * 2**20, peak_bytes_without=90 * 2**20, eigen_convolutions=True,
        working_buffer_bytes=20 * 2**20, lowest_unbuffered_bytes=25 * 2**20,
        pointwise_convolutions=1,
    )
    assert (
        "they add ~20.0 MiB to this plan's training peak (~40.0 MiB without them), which "
        "recompute cannot remove; without them the plans searched reach ~25.0 MiB; "
        'compile(pointwise="matmul") removes those of its 1 1x1 Conv2D layer\n'
    ) in str(plan)
    plan.lowest_unbuffered_bytes = 40 * 2**20  # no lower than its own
    assert "plans searched" not in str(plan)
    # A peak where no buffer is (ResNet50's "auto": at stage 5's updates),
    # while other plans' are: what they reach without them.
    plan.working_buffer_bytes, plan.lowest_unbuffered_bytes = 0, 50 * 2**20
    assert (
        "this plan's training peak is at none of them; without them the plans "
        "searched reach ~50.0 MiB"
    ) in str(plan)


def test_every_plan_without_buffers_is_that_plan_where_onednn_runs_them(monkeypatch):
    """`peaks_without_buffers` over the plans of both families (the nested
    blocks and the graph's segments, 5 layouts): each plan's figure is its
    peak in the search where oneDNN runs the convolutions (the same layout
    and blocks); recomputing nothing, that search's lowest over layouts (at
    another layout than the first here: with grappler's dependency
    optimizer on, each moment counts only its own gradients)."""
    from keras_gradboost import hooks
    from keras_gradboost import precision
    from keras_gradboost.recompute import budget

    grappler(False)  # the default set-up (the fixture restores it)
    monkeypatch.setattr(precision, "gpu_available", lambda: False)
    spec = tf.TensorSpec((4, 8, 8, 3))

    def searched(onednn):
        monkeypatch.setattr(hooks, "onednn_enabled", lambda: onednn)
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 8, 3))
        h = inputs
        for i in range(3):
            h = keras.Sequential([
                keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
                keras.layers.Conv2D(8, 1, activation="relu"),
            ], name=f"blk_{i}")(h)
        model = GradBoostModel(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
        model.compile(optimizer="adam", loss="mse", recompute="auto")
        _, families, layouts, found = model._gradboost.recompute.search(model, spec)
        return families, layouts, found, recompute.setup._gradient_bytes(model)

    families, layouts, found, gradients = searched(onednn=False)
    _, free_layouts, free_found, _ = searched(onednn=True)
    assert len(families) == 2 and len(layouts) == len(free_layouts) == 5
    free = budget.peaks_without_buffers(
        found, [(families[f][2], figures, families[f][3]) for f, _, figures, _ in layouts],
        gradients,
    )
    reference = {(c.layout, c.chosen): c.peak for c in free_found}
    compared = 0
    for c, peak in zip(found, free):
        if not c.chosen:
            assert peak == free_found[0].peak
        elif (c.layout, c.chosen) in reference:
            assert peak == reference[c.layout, c.chosen], c
            compared += 1
    assert compared >= 10 and {c.layout for c in found} == set(range(5))
    assert all(p < c.peak for c, p in zip(found, free))


def test_a_selective_plan_says_what_the_eigen_buffers_add(monkeypatch):
    """A selective plan's peak (`selective_plan_bytes`) counts the buffers
    too: what it says they add is its difference from the same plan where
    oneDNN runs the convolutions."""
    from keras_gradboost import hooks
    from keras_gradboost import precision

    monkeypatch.setattr(precision, "gpu_available", lambda: False)

    def plan(onednn):
        monkeypatch.setattr(hooks, "onednn_enabled", lambda: onednn)
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 8, 3))
        h = inputs
        # The first block's activations are the largest, the second's
        # convolution has the largest buffers: the peaks with and without
        # them are at different moments.
        h = keras.Sequential([
            keras.layers.Conv2D(64, 3, padding="same"), keras.layers.ReLU(),
        ], name="blk_0")(h)
        h = keras.Sequential([keras.layers.Conv2D(8, 1), keras.layers.ReLU()], name="blk_1")(h)
        model = GradBoostModel(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
        model.compile(optimizer="sgd", loss="mse",
                      recompute={"policy": "selective", "blocks": ["blk_*"]})
        return model.recompute_plan(batch_size=4)

    buffered, free = plan(onednn=False), plan(onednn=True)
    assert buffered.recomputed == free.recomputed == ["blk_0", "blk_1"]
    assert buffered.working_buffer_bytes == buffered.peak_bytes - free.peak_bytes > 2**20
    assert free.working_buffer_bytes == 0


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("precision_setting", ["mixed_float16", None])
def test_float16_convolutions_count_eigen_buffers_with_onednn_on(
    monkeypatch, precision_setting, jit_compile
):
    """oneDNN leaves float16 convolutions to TensorFlow's own kernels:
    ResNet50's mixed_float16 peak (64x64, batch 16, "auto") held two 22.2
    MiB im2col buffers of one backward, and the estimate without them read
    1.24x low. Here: [12851, 6 * 6, 3 * 3 * 3] halves (as many images as fit
    30 MiB), where the float32 model's are not counted; nor under
    jit_compile=True, whose XLA step runs none of these kernels."""
    from keras_gradboost import hooks
    from keras_gradboost import precision

    monkeypatch.setattr(hooks, "onednn_enabled", lambda: True)
    monkeypatch.setattr(precision, "gpu_available", lambda: False)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = keras.Sequential([keras.layers.Conv2D(4, 3, name="block")], name="seq")(inputs)
    model = GradBoostModel(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    model.compile(
        optimizer="sgd", loss="mse", recompute=["seq"], precision=precision_setting,
        jit_compile=jit_compile,
    )
    plan = model.recompute_plan(batch_size=4)
    halves = precision_setting == "mixed_float16" and not jit_compile
    assert plan.eigen_convolutions is halves
    assert (plan.peak_bytes >= 12851 * 36 * 27 * 2) is halves, plan.peak_bytes


@pytest.mark.filterwarnings("ignore:recompute=.*cannot remove the largest temporaries")
def test_a_convolution_after_a_grouped_one_counts_its_inputs_buffer(monkeypatch):
    """Keras runs a grouped convolution as an XLA-compiled call that takes
    its kernel's handle: what comes after it has a gradient, so the next
    Conv2D's backward allocates both Eigen buffers, its filter's and its
    input's: [4965, 6 * 6, 3 * 3 * 4] floats each here (as many images as
    fit 30 MiB). Counting gradients only from variable reads would miss
    the input's."""
    from keras_gradboost import hooks
    from keras_gradboost import precision

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 4))
    # No bias: its kernel is the only weight before `conv`.
    grouped = keras.layers.Conv2D(4, 3, groups=4, padding="same", use_bias=False, name="grouped")
    h = grouped(inputs)
    h = keras.Sequential([keras.layers.Conv2D(4, 3, name="conv")], name="seq")(h)
    model = GradBoostModel(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    model.compile(optimizer="sgd", loss="mse", recompute=["seq"])
    monkeypatch.setattr(hooks, "onednn_enabled", lambda: False)
    monkeypatch.setattr(precision, "gpu_available", lambda: False)  # these kernels are a CPU's
    plan = model.recompute_plan(batch_size=4)
    monkeypatch.setattr(hooks, "onednn_enabled", lambda: True)
    without = model.recompute_plan(batch_size=4)
    buffer = 4965 * 36 * 36 * 4
    added = plan.peak_bytes - without.peak_bytes
    assert 2 * buffer - 4 * 8 * 8 * 4 * 4 <= added <= 2 * buffer, (added, buffer)


def _conv_stack(blocks=6):
    """`blocks` Conv2D -> BatchNormalization -> ReLU blocks on 32x32
    images: with six, a graph whose segments "auto" takes at compile
    (coarse, about sqrt(n)) are not those the estimates choose at batch 8."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for i in range(blocks):
        h = keras.layers.Conv2D(16, 3, padding="same", name=f"conv_{i}")(h)
        h = keras.layers.BatchNormalization(name=f"bn_{i}")(h)
        h = keras.layers.ReLU(name=f"relu_{i}")(h)
    pooled = keras.layers.GlobalAveragePooling2D()(h)
    return GradBoostModel(inputs, keras.layers.Dense(3)(pooled))


# (`Dataset.batch(8)`, a PyDataset and a dataset batched with
# `drop_remainder=True` fed the same way: 62 s of CI, left out to keep CI
# under its limit; `batch_size_hint` reads their batch sizes, tested above,
# and fixed-size batches are what the other tests fit.)
def test_auto_chooses_at_fits_batch_size_when_the_trace_has_none():
    # A generator (as `Dataset.batch(8)` and a PyDataset) traces batches of
    # no fixed size: "auto" took the blocks found at compile there (coarse
    # segments), where the same data batched with `drop_remainder=True`
    # gets the plan the estimates at batch 8 choose. (MobileNetV2 took 21 s
    # of CI here, the six blocks 3.)
    model = _conv_stack()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", recompute="auto")
    setup = model._gradboost.recompute
    at_compile = sorted(setup.names()[k] for k in setup.chosen)
    x = np.random.default_rng(0).random((24, 32, 32, 3)).astype("float32")
    y = np.arange(24) % 3
    fed = ((x[i : i + 8], y[i : i + 8]) for i in range(0, 24, 8))
    batches = []
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b))
    model.fit(fed, epochs=1, verbose=0, callbacks=[counter])
    assert batches == [0, 1, 2]  # a generator's first batch, read before, trained once
    chosen = model.recompute_plan(batch_size=8)
    expected = recompute.RecomputeSetup(model, "auto")
    expected.resolve(model, tf.TensorSpec((8, 32, 32, 3)))  # the estimates' choice at batch 8
    assert sorted(expected.plan.recomputed) != at_compile  # (else this would test nothing)
    assert chosen.recomputed == expected.plan.recomputed
    assert chosen.peak_bytes == expected.plan.peak_bytes


def test_auto_fed_by_a_generator_trains_as_on_the_same_batches_as_arrays(data):
    # "auto" reads the generator's first batch before fit; the fit must
    # still train on every batch once, in order, with accumulation windows
    # intact, and recompute what it recomputes on the arrays. (Without
    # accumulation too until 2026-12-06: the same batches, one update each,
    # 9 s of CI; windows of 2 take the same path and keep the windows.)
    accumulate_steps = 2
    x, y = data
    trained = {}
    for feed in ("arrays", "generator"):
        model = residual_model(rate=0.0, blocks_count=6)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", recompute="auto",
                      accumulate_steps=accumulate_steps)
        if feed == "arrays":
            model.fit(x, y, batch_size=16, shuffle=False, epochs=1, verbose=0)
        else:
            batches = ((x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16))
            model.fit(batches, epochs=1, verbose=0)
        trained[feed] = model
    plan = trained["generator"].recompute_plan()
    assert plan.recomputed and plan.recomputed == trained["arrays"].recompute_plan().recomputed
    assert max_weight_diff(trained["arrays"], trained["generator"]) < 1e-6
