"""compile(depthwise="chunked"): depthwise Conv2Ds of over 96 channels run
Keras' own grouped convolution on slices of their channels. The reference
is Keras' unsliced convolution (the un-boosted model, or the same feature
with depthwise="keras"), compared bit for bit: alone, with recompute, selective
recompute, bfloat16 and a mirrored strategy, where the machine's check fails
and where XLA compiles the whole step; and recompute with depthwise=None,
which runs the slices where they serve."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_gradboost as kgb
from keras_gradboost import cpu_threads
from keras_gradboost import depthwise
from keras_gradboost import jit_measure
import test_depthwise
from test_depthwise import gradients
from test_depthwise import measured_training_peak
from test_depthwise import wide_depthwise_net
from test_depthwise import xla_convolutions


# Slices of at most 12 channels here (96 in use): the same code on layers
# XLA compiles faster (each slice is one XLA function per trace).
SLICE = 12


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch):
    monkeypatch.setattr(depthwise, "CHUNK_CHANNELS", SLICE)


def wide_net(seed=0):
    """Depthwise Conv2Ds of 30 channels (3 slices: 10, 10, 10 at
    `SLICE`), one with unequal strides; one with a depth multiplier and one
    of 12 channels, which "chunked" leaves to Keras; residual blocks
    recompute can cut."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 30))
    x = keras.layers.Conv2D(30, 7, padding="same", groups=30, name="dw_wide")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    h = keras.layers.Dense(16, activation="gelu", name="expand")(x)
    h = keras.layers.Dense(30, name="project")(h)
    x = keras.layers.Add(name="residual")([x, h])
    x = keras.layers.Conv2D(30, 3, strides=(2, 1), padding="same", groups=30,
                            name="dw_unequal")(x)
    x = keras.layers.Conv2D(60, 3, padding="same", groups=30, name="dw_multiplier")(x)
    x = keras.layers.Dense(12, name="narrow")(x)
    x = keras.layers.Conv2D(12, 3, padding="same", groups=12, name="dw_narrow")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x))


CHUNKED = {"dw_wide", "dw_unequal"}


def assert_same_bits(got, want):
    """Bit for bit (-0.0 is not 0.0), float32 arrays."""
    got, want = np.asarray(got, "float32"), np.asarray(want, "float32")
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def recording_slices(monkeypatch):
    """The names of the layers whose traces ran slices (not the checks',
    which slice too)."""
    sliced = set()
    monkeypatch.setattr(depthwise._Depthwise, "_chunked", slices_recorder(sliced))
    return sliced


def slices_recorder(sliced):
    """`_Depthwise._chunked` adding to `sliced` the name of each layer
    whose trace ran slices."""
    original = depthwise._Depthwise._chunked

    def recording(self, *args):
        outputs = original(self, *args)
        if self.sliced:
            sliced.add(self.layer.name)
        return outputs

    return recording


def data(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6, 6, 30)).astype("float32"), rng.integers(0, 3, size=(n,))


def test_eligible_and_slices(monkeypatch):
    model = wide_net()
    reasons = {
        layer.name: depthwise.eligible(layer, "chunked")
        for layer in model.layers
        if isinstance(layer, keras.layers.Conv2D)
    }
    assert {name for name, (ok, _) in reasons.items() if ok} == CHUNKED
    assert reasons["dw_multiplier"] == (False, "a depth multiplier of 2")
    assert reasons["dw_narrow"] == (False, f"at most {SLICE} channels, one slice already")
    assert depthwise.chunk_sizes(30) == [10, 10, 10]
    monkeypatch.setattr(depthwise, "CHUNK_CHANNELS", 96)  # as in use
    assert depthwise.chunk_sizes(200) == [67, 67, 66]
    assert depthwise.chunk_sizes(768) == [96] * 8
    assert depthwise.chunk_sizes(97) == [49, 48]


def test_chunked_equals_keras_bit_for_bit():
    plain = wide_net()
    boosted = kgb.boost(plain)
    boosted.compile(optimizer="sgd", loss="mse", depthwise="chunked")
    keras_way = kgb.boost(plain)
    keras_way.compile(optimizer="sgd", loss="mse")
    assert {layer.name for layer in boosted.train_plan.depthwise_layers} == CHUNKED
    x, y = data()
    assert_same_bits(boosted.predict(x, verbose=0), plain.predict(x, verbose=0))
    for got, want in zip(gradients(boosted, x, y), gradients(plain, x, y)):
        assert_same_bits(got, want)
    # Each slice is one of Keras' XLA grouped convolutions: 3 + 3 slices and
    # the two layers left to Keras, where Keras' way has 4 (each traces the
    # same number of functions; if Keras stops calling
    # `Conv2D.convolution_op`, the two counts are equal).
    per_convolution, rest = divmod(xla_convolutions(keras_way, x), 4)
    assert per_convolution >= 1 and rest == 0
    assert xla_convolutions(boosted, x) == (3 + 3 + 2) * per_convolution


def _fit_weights(setting, seed=0, samples=16, **compile_kwargs):
    model = kgb.boost(wide_net(seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compile's depthwise advice
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            depthwise=setting,
            **compile_kwargs,
        )
    x, y = data(samples)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.chunked_warnings = [
        str(w.message) for w in caught if str(w.message).startswith('depthwise="chunked"')
    ]
    return model, [w.numpy() for w in model.trainable_weights]


# Accumulation is left to tests/test_depthwise.py (21 s of CI here): it
# calls the model as any step does, through the same wrapper.
FEATURES = {
    **{name: kwargs for name, kwargs in test_depthwise.FEATURES.items() if name != "accumulate"},
    "xla": {"jit_compile": True},
}


@pytest.mark.parametrize("extra", list(FEATURES.values()), ids=list(FEATURES))
def test_chunked_with_other_features_trains_like_keras(extra, monkeypatch):
    """Each feature with depthwise="chunked" against the same feature with
    Keras' grouped convolution: the same weights after 4 steps, bit for
    bit. In bfloat16 too: each slice's part of the float32 kernel is cast
    inside Keras' XLA function, where Keras casts the whole (a cast outside
    differed by rounding). Under XLA (the whole step compiled) no layer
    runs in slices, and a warning says so."""
    _, want = _fit_weights("keras", **extra)
    sliced = recording_slices(monkeypatch)
    model, got = _fit_weights("chunked", **extra)
    for a, b in zip(got, want):
        assert_same_bits(a, b)
    if "jit_compile" in extra:
        # Keras' way, and one warning per layer says why.
        assert not sliced
        assert len(model.chunked_warnings) == len(CHUNKED), model.chunked_warnings
        assert all("XLA compiles the step" in said for said in model.chunked_warnings)
    else:
        assert sliced == CHUNKED and not model.chunked_warnings
    if "recompute" in extra:
        assert model.recompute_plan().recomputed


@pytest.mark.parametrize("check", ["machine", "planted_to_differ"])
def test_mixed_bfloat16_at_batches_of_no_fixed_size_trains_like_keras(check, monkeypatch):
    """mixed_bfloat16, 19 samples in batches of 4: the step is traced again
    with no fixed batch for the last 3, so both branches are built (the
    slices at the sizes checked, Keras' convolution at any other); and with
    every check planted to differ (Keras' way, with a warning per layer).
    The weights are bit for bit those of Keras' way. (Keras' branch once got
    the kernel as the slices take it, and crashed.)"""
    monkeypatch.setattr(depthwise, "_CHECKED", {})
    if check == "planted_to_differ":
        monkeypatch.setattr(depthwise, "_bitwise_equal", lambda *args: False)
    # Checked at 4 only: the last batch of 3 runs Keras' branch.
    checks = depthwise.set_check_batches
    monkeypatch.setattr(depthwise, "set_check_batches",
                        lambda layers, sizes: checks(layers, [s for s in sizes if s == 4]))
    _, want = _fit_weights("keras", samples=19, precision="mixed_bfloat16")
    sliced = recording_slices(monkeypatch)
    model, got = _fit_weights("chunked", samples=19, precision="mixed_bfloat16")
    for a, b in zip(got, want):
        assert_same_bits(a, b)
    if check == "machine":
        assert sliced == CHUNKED and not model.chunked_warnings
    else:
        assert not sliced and len(model.chunked_warnings) == len(CHUNKED)


def test_chunked_under_measured_xla_trains_like_keras(monkeypatch):
    """jit_compile="measure" with depthwise="chunked": the XLA candidate
    runs Keras' way with a warning, the other runs the slices, and the
    weights after the 8 measured steps and 2 more are bit for bit those of
    the same measurement with Keras' grouped convolution. A fake clock
    (every call 1 s) makes both decide alike: no XLA on a tie."""
    clock = iter(range(10**6))
    monkeypatch.setattr(jit_measure, "perf_counter", lambda: next(clock))
    _, want = _fit_weights("keras", samples=40, jit_compile="measure")
    sliced = recording_slices(monkeypatch)
    model, got = _fit_weights("chunked", samples=40, jit_compile="measure")
    assert model.jit_measurement.jit_compile is False
    assert int(model.optimizer.iterations) == 10
    for a, b in zip(got, want):
        assert_same_bits(a, b)
    assert sliced == CHUNKED
    assert len(model.chunked_warnings) == len(CHUNKED), model.chunked_warnings
    assert all("XLA compiles the step" in said for said in model.chunked_warnings)


def test_recompute_runs_slices_by_default_like_keras(monkeypatch):
    """depthwise=None with recompute on runs "chunked" where it serves: the
    weights after 4 steps equal those with depthwise="keras", bit for bit,
    both layers ran in slices, and nothing warned."""
    _, want = _fit_weights("keras", recompute="auto")
    sliced = recording_slices(monkeypatch)
    model, got = _fit_weights(None, recompute="auto")
    assert model.train_plan.depthwise_setting == "chunked"
    assert {layer.name for layer in model.train_plan.depthwise_layers} == CHUNKED
    for a, b in zip(got, want):
        assert_same_bits(a, b)
    assert sliced == CHUNKED and not model.chunked_warnings
    assert model.recompute_plan().recomputed


@pytest.mark.parametrize("compile_kwargs, chosen, note", [
    ({"recompute": "auto"}, True, False),
    ({"recompute": {"policy": "selective"}}, True, False),
    ({"recompute": {"budget_mb": 1, "batch_size": 4}}, True, False),
    # precision="float32" on a model built in mixed_bfloat16: float32 then.
    ({"recompute": "auto", "precision": "float32", "built": "mixed_bfloat16"}, True, False),
    ({}, False, False),  # no recompute: Keras' way
    ({"recompute": "auto", "depthwise": "keras"}, False, False),
    ({"recompute": "auto", "gpu": True}, False, False),  # no such temporaries there
    # In bfloat16 too (each slice casts its kernel inside, as Keras does).
    ({"recompute": "auto", "precision": "mixed_bfloat16"}, True, False),
    ({"recompute": "auto", "built": "mixed_bfloat16"}, True, False),  # as built
    ({"recompute": "auto", "precision": "measure"}, True, False),  # both candidates
    ({"recompute": "auto", "jit_compile": True}, False, True),  # XLA
    ({"recompute": "auto", "jit_compile": "measure"}, False, True),  # an XLA candidate
    ({"recompute": "auto", "clusters": True}, False, True),  # auto-clustering
])
def test_which_compiles_run_slices_by_default(compile_kwargs, chosen, note, monkeypatch):
    """Where recompute turns "chunked" on (without XLA, on a CPU),
    and where it leaves Keras' way: there compile's note names the layers
    with a depth multiplier of 1 (dw_multiplier's has no such temporary)
    and "chunked", which would serve elsewhere."""
    from keras_gradboost import precision

    kwargs = dict(compile_kwargs)
    gpu = kwargs.pop("gpu", False)
    monkeypatch.setattr(precision, "gpu_available", lambda: gpu)
    monkeypatch.setattr(precision, "cpu_has_native_bfloat16", lambda: True)
    if kwargs.pop("clusters", False):
        monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_auto_jit=2")
    built = kwargs.pop("built", "float32")
    keras.mixed_precision.set_global_policy(built)
    try:
        model = kgb.boost(wide_net())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer="sgd", loss="mse", **kwargs)
    plan = model.train_plan
    names = {layer.name for layer in plan.depthwise_layers}
    assert (plan.depthwise_setting, names) == (("chunked", CHUNKED) if chosen else (None, set()))
    notes = [str(w.message) for w in caught if "cannot remove the largest" in str(w.message)]
    if note:
        assert len(notes) == 1, notes
        assert "3 depthwise Conv2D layer(s) (e.g. 'dw_wide')" in notes[0], notes
        assert 'depthwise="chunked" would run' in notes[0]
    else:
        assert not notes, notes


def test_a_plan_that_keras_compiles_with_xla_drops_the_slices():
    """Where Keras ends up compiling the step with XLA although the plan
    expected not (`TrainPlan.with_jit`), recompute's slices are dropped and
    the note says what is left."""
    model = kgb.boost(wide_net())
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    replanned = model.train_plan.with_jit(True, model=model)
    assert (replanned.depthwise_setting, replanned.depthwise_layers) == (None, ())
    assert any("cannot remove the largest" in note for note in replanned.warnings)
    explicit = kgb.boost(wide_net())
    explicit.compile(optimizer="sgd", loss="mse", recompute="auto", depthwise="chunked")
    assert explicit.train_plan.with_jit(True, model=explicit).depthwise_setting == "chunked"


def test_a_slice_chosen_by_recompute_says_so_when_it_runs_keras_way(monkeypatch):
    """A layer that recompute chose to run in slices but whose check
    differs (planted) warns like depthwise="chunked", naming what chose it
    and how to turn it off."""
    monkeypatch.setattr(depthwise, "_CHECKED", {})
    monkeypatch.setattr(depthwise, "_bitwise_equal", lambda *args: False)
    plain = wide_net()
    boosted = kgb.boost(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compile's note on dw_multiplier
        boosted.compile(optimizer="sgd", loss="mse", recompute="auto")
    x, _ = data()
    with pytest.warns(UserWarning) as caught:
        assert_same_bits(boosted.predict(x, verbose=0), plain.predict(x, verbose=0))
    said = [str(w.message) for w in caught if str(w.message).startswith('depthwise="chunked"')]
    assert len(said) == 2, said
    assert all("(recompute='auto' chose it; depthwise=\"keras\" turns it off)" in m for m in said)


@pytest.mark.parametrize("precision", [None, "mixed_bfloat16"])
def test_chunked_under_mirrored_strategy_trains_like_keras(monkeypatch, precision):
    """Replicas trace in threads of their own (the check's cache is shared
    under a lock): with recompute, the weights after 4 steps equal Keras'
    path under the same strategy, bit for bit, and both layers ran in
    slices with no warning; in mixed_bfloat16 too (its check makes no
    variable)."""
    from conftest import shared_mirrored_strategy

    monkeypatch.setattr(depthwise, "_CHECKED", {})  # checked in the replicas' threads

    def weights(setting):
        with shared_mirrored_strategy().scope():
            model = kgb.boost(wide_net())
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # compile's depthwise advice
                model.compile(optimizer=keras.optimizers.SGD(0.1),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              depthwise=setting, recompute="auto", precision=precision)
        x, y = data(16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        said = [str(w.message) for w in caught if str(w.message).startswith('depthwise="chunked"')]
        assert not said, said
        return [w.numpy() for w in model.trainable_weights]

    want = weights("keras")
    sliced = recording_slices(monkeypatch)
    for a, b in zip(weights("chunked"), want):
        assert_same_bits(a, b)
    assert sliced == CHUNKED


def test_chunked_survives_save_and_load(tmp_path, monkeypatch):
    """The loaded model runs the slices too, and predicts what Keras' path
    (the un-boosted model with the loaded weights) predicts."""
    model, _ = _fit_weights("chunked")
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.gradboost_config.depthwise == "chunked"
    assert {layer.name for layer in loaded.train_plan.depthwise_layers} == CHUNKED
    plain = wide_net()
    plain.set_weights(loaded.get_weights())
    sliced = recording_slices(monkeypatch)
    x, _ = data()
    assert_same_bits(loaded.predict(x, verbose=0), plain.predict(x, verbose=0))
    assert sliced == CHUNKED


def test_fit_checks_at_its_batch_sizes(monkeypatch):
    """A step traced with no fixed batch (arrays) is checked at `fit`'s
    batch size and at its last partial batch's: 19 samples in batches of
    8 are checked at 8 and 3."""
    monkeypatch.setattr(depthwise, "_CHECKED", {})
    checked = set()
    original = depthwise._bitwise_equal

    def recording(convolution, input_shape, *args):
        checked.add(input_shape[0])
        return original(convolution, input_shape, *args)

    monkeypatch.setattr(depthwise, "_bitwise_equal", recording)
    model = kgb.boost(wide_net())
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  depthwise="chunked")
    x, y = data(19)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert checked == {8, 3}


def test_a_batch_of_an_unchecked_size_runs_keras_convolution(monkeypatch):
    """Where the traced batch has no fixed size, the slices run only at the
    sizes checked (here outside `fit`: 2 samples), Keras' convolution at
    any other. Planted: slices that pass the check but give
    zeros, so which one ran shows in the outputs."""
    monkeypatch.setattr(depthwise, "_CHECKED", {})
    monkeypatch.setattr(depthwise, "_bitwise_equal", lambda *args: True)
    monkeypatch.setattr(depthwise, "_sliced",
                        lambda original, inputs, kernel, sizes: 0.0 * original(inputs, kernel))
    plain = wide_net()
    boosted = kgb.boost(plain)
    boosted.compile(optimizer="sgd", loss="mse", depthwise="chunked")
    x, _ = data(4)
    forward = tf.function(lambda t: boosted(t, training=False),
                          input_signature=[tf.TensorSpec((None, 6, 6, 30), "float32")])
    assert_same_bits(forward(x), plain(x, training=False))  # Keras' convolution
    assert not np.array_equal(forward(x[:2]), plain(x[:2], training=False))  # the slices


def test_auto_clustering_counts_as_xla(monkeypatch):
    """TF_XLA_FLAGS' auto-clustering may compile the slices with their
    neighbours: "chunked" treats it as a step XLA compiles."""
    for flags, clusters in [("--tf_xla_auto_jit=2", True), ("--tf_xla_auto_jit=0", False),
                            ("--tf_xla_cpu_global_jit", False), ("", False)]:
        monkeypatch.setenv("TF_XLA_FLAGS", flags)
        assert depthwise.xla_clusters() is clusters, flags


def test_a_layer_compiled_again_for_another_setting_warns():
    """Two boosted models share the layers of the model given to boost(): a
    layer runs one setting in both, and the compile that changes another
    model's setting says so (naming recompute where it chose "chunked");
    compiling the same model again does not."""
    plain = wide_net()
    first = kgb.boost(plain)
    first.compile(optimizer="sgd", loss="mse", depthwise="chunked")
    second = kgb.boost(plain)  # (kept: a model no longer held is not warned of)
    with pytest.warns(UserWarning, match=r"depthwise='native': 1 layer\(s\).*another model"):
        second.compile(optimizer="sgd", loss="mse", depthwise="native")
    with pytest.warns(UserWarning, match=r"depthwise='chunked' \(recompute='auto' chose it\)"):
        first.compile(optimizer="sgd", loss="mse", recompute="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same model compiled again: no warning
        first.compile(optimizer="sgd", loss="mse", depthwise="native")


def test_a_layer_whose_slices_differ_runs_as_keras_with_a_warning(monkeypatch):
    """Where the machine's check finds the slices unequal to Keras' (here
    planted), the layer runs Keras' one convolution, and one warning names
    it and the remedy that is equal to float rounding."""
    monkeypatch.setattr(depthwise, "_CHECKED", {})
    monkeypatch.setattr(depthwise, "_bitwise_equal", lambda *args: False)
    plain = wide_net()
    boosted = kgb.boost(plain)
    boosted.compile(optimizer="sgd", loss="mse", depthwise="chunked")
    keras_way = kgb.boost(plain)
    keras_way.compile(optimizer="sgd", loss="mse")
    x, _ = data()
    with pytest.warns(UserWarning) as caught:
        assert_same_bits(boosted.predict(x, verbose=0), plain.predict(x, verbose=0))
        boosted.predict(x, verbose=0)
    said = [str(w.message) for w in caught if str(w.message).startswith('depthwise="chunked"')]
    assert len(said) == 2, said  # one per layer, not one per trace
    assert "'dw_wide'" in said[0] + said[1] and 'depthwise="native"' in said[0]
    assert "its slices ([10, 10, 10]) did not give Keras'" in said[0]  # the splits tried
    assert xla_convolutions(boosted, x) == xla_convolutions(keras_way, x)


def test_splits_tried_in_turn(monkeypatch):
    """The even split first, then whole multiples of 48 channels, as many
    slices and one more, each of at most 96 (as in use)."""
    assert depthwise.chunk_splits(30) == [[10, 10, 10]]  # slices of 12 here
    monkeypatch.setattr(depthwise, "CHUNK_CHANNELS", 96)
    assert depthwise.chunk_splits(98) == [[49, 49], [48, 50]]
    assert depthwise.chunk_splits(193) == [[65, 64, 64], [96, 48, 49], [48, 48, 48, 49]]
    assert depthwise.chunk_splits(768) == [[96] * 8, [96] * 7 + [48, 48]]
    for channels in range(97, 800):
        for sizes in depthwise.chunk_splits(channels):
            assert sum(sizes) == channels and 2 <= min(sizes) and max(sizes) <= 96


def test_a_split_whose_check_differs_gives_way_to_the_next(monkeypatch):
    """Where the even split's check differs (planted), the next split is
    checked (the machine's own check) and runs: gradients bit for bit
    Keras', in slices of 16 and 14 (slices of at most 16 here, aligned to
    8), with no warning."""
    monkeypatch.setattr(depthwise, "CHUNK_CHANNELS", 16)
    monkeypatch.setattr(depthwise, "ALIGNED_CHANNELS", 8)
    assert depthwise.chunk_splits(30) == [[15, 15], [16, 14], [8, 8, 14]]
    monkeypatch.setattr(depthwise, "_CHECKED", {})
    check = depthwise._bitwise_equal
    monkeypatch.setattr(
        depthwise, "_bitwise_equal",
        lambda original, shape, kernel, sizes, *dtypes: sizes != [15, 15]
        and check(original, shape, kernel, sizes, *dtypes),
    )
    ran = []
    split = depthwise._Depthwise._split

    def recording(self, *args):
        sizes, equal = split(self, *args)
        ran.append((self.layer.name, sizes, equal))
        return sizes, equal

    monkeypatch.setattr(depthwise._Depthwise, "_split", recording)
    plain = wide_net()
    boosted = kgb.boost(plain)
    boosted.compile(optimizer="sgd", loss="mse", depthwise="chunked")
    x, y = data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for got, want in zip(gradients(boosted, x, y), gradients(plain, x, y)):
            assert_same_bits(got, want)
    said = [str(w.message) for w in caught if str(w.message).startswith("depthwise=")]
    assert not said, said
    assert {name for name, _, _ in ran} == CHUNKED
    assert all(sizes == [16, 14] and equal == [8] for _, sizes, equal in ran), ran
    # The slices ran: 2 + 2 of Keras' XLA convolutions and the 2 layers left
    # to Keras, where Keras' way has 4 (as in the bit-for-bit test above).
    keras_way = kgb.boost(plain)
    keras_way.compile(optimizer="sgd", loss="mse")
    per_convolution = xla_convolutions(keras_way, x) // 4
    assert xla_convolutions(boosted, x) == (2 + 2 + 2) * per_convolution
    # The estimates count the dense filters of the split that ran.
    with boosted._chosen_kernels():
        found = dict(depthwise.xla_backward_temporaries(boosted))
    layer = boosted.get_layer("dw_wide")
    at_once = [16, 14][: cpu_threads.inter_op()]
    assert found[layer] == depthwise.XLA_DENSE_FILTER_COPIES * sum(
        7 * 7 * size * size * 4 for size in at_once)


def test_the_check_leaves_tensorflows_random_state_alone(monkeypatch):
    """The check draws its values with NumPy: a model's random draws after
    the first trace are those of an un-boosted run."""
    monkeypatch.setattr(depthwise, "_CHECKED", {})
    tf.random.set_seed(3)
    keras.utils.set_random_seed(3)
    plain_draw = keras.random.normal((4,), seed=None).numpy()
    model = kgb.boost(wide_net())
    model.compile(optimizer="sgd", loss="mse", depthwise="chunked")
    tf.random.set_seed(3)
    keras.utils.set_random_seed(3)
    model.predict(data()[0], verbose=0)  # traces: the check runs
    assert depthwise._CHECKED
    np.testing.assert_array_equal(keras.random.normal((4,), seed=None).numpy(), plain_draw)


def test_the_estimates_read_slices_as_the_layers_convolution():
    """The estimates' graph reading finds a layer run in slices: its joined
    output (plus its bias) is a kernel layer's output, which selective
    recompute keeps, and its slices' function calls are its XLA calls
    (where its temporaries are placed). Keras' one grouped convolution,
    a function call given the kernel's handle, is read as rebuilt."""
    from keras_gradboost.recompute import estimates

    def graph(setting):
        model = kgb.boost(wide_net())
        model.compile(optimizer="sgd", loss="mse", depthwise=setting)
        forward = tf.function(lambda x: model(x, training=True))
        graph = forward.get_concrete_function(tf.TensorSpec((4, 6, 6, 30))).graph
        return model, graph, graph.get_operations()

    model, sliced_graph, ops = graph("chunked")
    joins = [op for op in ops if op.type == "ConcatV2" and estimates._by_weight(op)]
    assert len(joins) == len(CHUNKED)
    kept = [op for op in ops if op.type == "BiasAdd" and estimates._kernel_output(op.outputs[0])]
    assert {join.name for join in joins} <= {op.inputs[0].op.name for op in kept}
    # The temporaries sit at the slices' calls (3 + 3; dw_narrow's one call
    # runs as Keras runs it), none at every moment.
    trainable = estimates._trainable_handles(sliced_graph, model)
    found, anywhere = estimates._workspaces(sliced_graph, ops, trainable, model)
    calls = [op.name for op in ops if op.type in estimates._CALLS and op.name in found]
    per_layer = {name: sum(f"/{name}_" in call for call in calls)
                 for name in ("dw_wide", "dw_unequal", "dw_narrow")}
    assert anywhere == 0 and per_layer == {"dw_wide": 3, "dw_unequal": 3, "dw_narrow": 1}, calls
    _, _, ops = graph("keras")
    assert not [op for op in ops if op.type == "ConcatV2" and estimates._by_weight(op)]


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="a CPU temporary")
def test_the_estimate_counts_one_slices_temporaries(requested_peak, monkeypatch):
    """wide_depthwise_net's 256 channels in slices of 86, 85 and 85: the
    estimate counts the dense filters of as many slices as the executor
    runs at once (2 of 3 measured on 2 cores), not the layer's (24.5 MiB),
    and the measured peak is within 15% of it."""
    monkeypatch.setattr(depthwise, "CHUNK_CHANNELS", 96)  # as in use
    model = kgb.boost(wide_depthwise_net())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  recompute="auto", depthwise="chunked")
    measured = measured_training_peak(model, requested_peak)
    plan = model.recompute_plan(batch_size=16)
    at_once = [86, 85, 85][: cpu_threads.inter_op()]
    slice_filters = sum(7 * 7 * size * size * 4 for size in at_once)
    assert plan.xla_temporary_bytes == depthwise.XLA_DENSE_FILTER_COPIES * slice_filters
    assert measured < 7 * 7 * 256 * 256 * 4  # not even one of the layer's dense filters
    assert 0.85 * plan.peak_bytes <= measured <= 1.15 * plan.peak_bytes, (
        measured, plan.peak_bytes)
