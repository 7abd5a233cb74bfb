"""RetraceCounter against planted retraces: varying lengths, a Python value,
a short last batch, a new dtype; fixed shapes count nothing."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost import wrappers
from keras_gradboost.callbacks import RetraceCounter
from keras_gradboost.callbacks import RetraceError
from keras_gradboost.callbacks.retrace import diagnose
from keras_gradboost.callbacks.retrace import diff_signatures
from keras_gradboost.callbacks.retrace import signature
from keras_gradboost.callbacks.retrace import suggest_buckets

LENGTHS = (5, 9, 13, 17)
BATCH = 4


# ------------------------------------------------------------ pure parts


def test_signature_diff_names_the_input_and_the_dim():
    old = signature(({"tokens": tf.zeros((32, 17), tf.int32)}, tf.zeros((32,))))
    new = signature(({"tokens": tf.zeros((32, 23), tf.int32)}, tf.zeros((32,))))
    changes = diff_signatures(old, new)
    assert [c.text() for c in changes] == [
        "x['tokens']: shape (32, 17) -> (32, 23), dim 1 varies"
    ]
    assert changes[0].dims == (1,)


def test_signature_diff_dtype_and_python_value():
    a = signature((tf.zeros((2, 3)), tf.zeros((2,)), 0.5))
    b = signature((tf.zeros((2, 3), tf.float64), tf.zeros((2,)), 0.7))
    texts = [c.text() for c in diff_signatures(a, b)]
    assert "x: dtype float32 -> float64" in texts
    assert "sample_weight: Python value 0.5 -> 0.7" in texts
    diagnosis, fix = diagnose(diff_signatures(a, b))
    assert "Python value" in diagnosis and "tf.constant" in fix


def test_diagnose_last_batch_smaller():
    a = signature((tf.zeros((32, 3)), tf.zeros((32,))))
    b = signature((tf.zeros((8, 3)), tf.zeros((8,))))
    diagnosis, fix = diagnose(diff_signatures(a, b))
    assert diagnosis == "the last batch is smaller than the others"
    assert "drop_remainder=True" in fix


def test_diagnose_new_dtype():
    a = signature(tf.zeros((2, 3), tf.int32))
    b = signature(tf.zeros((2, 3), tf.int64))
    diagnosis, _ = diagnose(diff_signatures(a, b))
    assert diagnosis == "a new dtype (x)"


@pytest.mark.parametrize(
    "lengths, expected",
    [([5, 9], [8, 16]), ([3, 40, 41, 90, 100, 120, 7], None)],
)
def test_suggest_buckets_cover_every_length(lengths, expected):
    buckets = suggest_buckets(lengths)
    assert len(buckets) <= 4
    assert buckets[-1] >= max(lengths)
    assert all(b % 8 == 0 for b in buckets)
    if expected is not None:
        assert buckets == expected


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_retraces": -1}, "max_retraces=-1"),
        ({"max_retraces": 1.5}, "max_retraces=1.5"),
        ({"strict": "yes"}, "strict='yes'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        RetraceCounter(**kwargs)


# ------------------------------------------------------------- with fit


class Pooler(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(30, 4)
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.pool(self.embed(x)))


def _model(kind):
    keras.utils.set_random_seed(0)
    layers = [
        keras.layers.Embedding(30, 4),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(2),
    ]
    if kind == "sequential":
        return keras.Sequential([keras.Input((None,), dtype="int32")] + layers)
    if kind == "subclassed":
        return Pooler()
    inputs = keras.Input((None,), dtype="int32")
    x = inputs
    for layer in layers:
        x = layer(x)
    cls = GradBoostModel if kind == "gradboost" else keras.Model
    return cls(inputs, x)


def _compile(model, jit=False, **kwargs):
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit,
        **kwargs,
    )


def _varying(lengths=LENGTHS, batches_per_length=2):
    """Padded batches whose length (dim 1) changes every few batches."""

    def gen():
        for length in lengths:
            for i in range(BATCH * batches_per_length):
                yield np.full(length, i % 30, "int32"), np.int32(i % 2)

    ds = tf.data.Dataset.from_generator(
        gen,
        output_signature=(
            tf.TensorSpec((None,), tf.int32),
            tf.TensorSpec((), tf.int32),
        ),
    )
    return ds.padded_batch(BATCH)


@pytest.mark.parametrize("kind", ["functional", "sequential", "subclassed", "gradboost"])
def test_varying_length_under_xla_is_counted_and_explained(kind):
    model = _model(kind)
    kwargs = {"accumulate_steps": 2} if kind == "gradboost" else {}
    _compile(model, jit=True, **kwargs)
    counter = RetraceCounter()
    history = model.fit(_varying(), epochs=1, verbose=0, callbacks=[counter])
    # The padded dataset's length dim is None: the step is traced once, and
    # XLA compiles it again for every new length, silently.
    assert counter.retraces == 0
    assert counter.recompiles == len(LENGTHS) - 1
    first = counter.events[0]
    assert first.kind == "recompile" and first.function == "train"
    assert first.changes == ("x: shape (4, 5) -> (4, 9), dim 1 varies",)
    assert "dim 1 of x" in first.diagnosis
    assert "bucket_by_length" in first.fix and "[8, 16]" in first.fix
    assert history.history["recompiles"] == [3.0]
    assert history.history["retraces"] == [0.0]


@pytest.mark.parametrize("kind", ["functional", "gradboost"])
def test_varying_length_without_xla_counts_nothing(kind):
    # As in Keras alone: the dataset's spec leaves dim 1 None, so the step is
    # traced once for every length (the callback's own wrapper adds no trace).
    model = _model(kind)
    _compile(model)
    counter = RetraceCounter(strict=True)
    history = model.fit(_varying(), epochs=1, verbose=0, callbacks=[counter])
    assert counter.retraces == 0 and counter.recompiles == 0
    assert history.history["retraces"] == [0.0]


def test_varying_length_retrace_of_train_on_batch_is_explained():
    model = _model("functional")
    _compile(model)
    counter = RetraceCounter()
    counter.set_model(model)
    counter.on_train_begin()
    for length in LENGTHS:  # each call traces for its concrete shapes
        model.train_on_batch(np.ones((BATCH, length), "int32"), np.zeros((BATCH,), "int32"))
    counter.on_train_end()
    # The second length makes TensorFlow retrace with dim 1 relaxed to None.
    assert counter.retraces == 1
    (event,) = counter.events
    assert event.kind == "retrace" and event.function == "train"
    assert event.changes == ("x: shape (4, 5) -> (4, 9), dim 1 varies",)
    assert "dim 1 of x" in event.diagnosis
    assert "bucket_by_length" in event.fix


def test_xla_recompiles_are_counted_without_retraces():
    model = _model("functional")
    _compile(model, jit=True)
    counter = RetraceCounter()
    model.fit(_varying(), epochs=1, verbose=0, callbacks=[counter])
    assert counter.retraces == 0
    assert counter.recompiles == len(LENGTHS) - 1  # one per new length
    assert [e.kind for e in counter.events] == ["recompile"] * (len(LENGTHS) - 1)
    assert counter.events[-1].changes == ("x: shape (4, 13) -> (4, 17), dim 1 varies",)
    assert counter.per_function == {"train": {"retraces": 0, "recompiles": 3}}
    for event in counter.events:
        assert event.call_seconds > 0 and event.seconds_lost is not None


@pytest.mark.parametrize("jit", [False, True])
def test_fixed_shapes_count_nothing(jit):
    model = _model("functional")
    _compile(model, jit=jit)
    counter = RetraceCounter(strict=True)  # would raise at the first one
    x = np.ones((24, 7), "int32")
    y = np.zeros((24,), "int32")
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[counter])
    assert counter.retraces == 0 and counter.recompiles == 0 and counter.events == []
    assert history.history["retraces"] == [0.0, 0.0]


def test_short_last_batch_is_named():
    model = _model("functional")
    _compile(model, jit=True)  # without XLA, Keras' batch dim is None already
    counter = RetraceCounter()
    x = np.ones((10, 7), "int32")
    y = np.zeros((10,), "int32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[counter])
    (event,) = counter.events
    assert event.kind == "recompile"
    assert event.changes[0] == "x: shape (4, 7) -> (2, 7), dim 0 varies"
    assert event.diagnosis == "the last batch is smaller than the others"


def test_python_float_argument_is_named():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    counter = RetraceCounter()
    counter.set_model(model)
    counter.on_train_begin()  # as a custom loop does with callbacks
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    for weight in (0.5, 0.5, 0.7):
        model.train_on_batch(x, y, sample_weight=weight)
    counter.on_train_end()
    assert counter.retraces == 1
    (event,) = counter.events
    assert event.changes == ("sample_weight: Python value 0.5 -> 0.7",)
    assert event.diagnosis.startswith("a Python value where a tensor was meant")


def test_strict_raises_and_max_retraces_warns_once():
    model = _model("functional")
    _compile(model, jit=True)
    with pytest.raises(RetraceError, match="max_retraces=1") as info:
        model.fit(
            _varying(), epochs=1, verbose=0,
            callbacks=[RetraceCounter(max_retraces=1, strict=True)],
        )
    assert info.value.event.kind == "recompile"
    assert "bucket_by_length" in str(info.value)
    # Keras calls no on_train_end after the error: the counter undid itself,
    # so a plain fit trains without it (no error, no counter logs).
    assert not wrappers.is_patched(model.train_function)
    history = model.fit(_varying(), epochs=1, verbose=0)
    assert "retraces" not in history.history
    model = _model("functional")
    _compile(model, jit=True)
    counter = RetraceCounter(max_retraces=1)
    with pytest.warns(UserWarning, match="more than max_retraces=1") as record:
        model.fit(_varying(), epochs=1, verbose=0, callbacks=[counter])
    (warning,) = [w for w in record if "max_retraces" in str(w.message)]
    # It names the input, the cause and the fix.
    assert "x: shape (4, 9) -> (4, 13), dim 1 varies" in str(warning.message)
    assert "fix: pad to a fixed length, or to a few buckets" in str(warning.message)
    assert counter.recompiles == len(LENGTHS) - 1


def test_predict_retraces_are_counted():
    model = _model("functional")
    _compile(model)
    counter = RetraceCounter()
    model.predict(np.ones((4, 5), "int32"), verbose=0, callbacks=[counter])
    model.predict(np.ones((4, 5), "int32"), verbose=0, callbacks=[counter])
    assert counter.retraces == 0
    model.predict(np.ones((4, 9), "int32"), verbose=0, callbacks=[counter])
    assert counter.retraces == 1
    assert counter.events[0].function == "predict"
    assert counter.per_function == {"predict": {"retraces": 1, "recompiles": 0}}
    assert "dim 1 varies" in counter.events[0].changes[0]


def test_reusable_and_undone():
    model = _model("functional")
    _compile(model, jit=True)
    counter = RetraceCounter()
    model.fit(_varying(), epochs=1, verbose=0, callbacks=[counter])
    assert counter.recompiles == 3
    # The same lengths again: XLA has compiled them already.
    model.fit(_varying(), epochs=1, verbose=0, callbacks=[counter])
    assert counter.recompiles == 0 and counter.events == []
    # Nothing left in the train function: no wrapper, and a fit without the
    # counter logs no counter keys.
    assert not wrappers.is_patched(model.train_function)
    history = model.fit(_varying(), epochs=1, verbose=0)
    assert "retraces" not in history.history and "recompiles" not in history.history


def _lengths_only(ds):
    return ds.map(lambda x, y: x)


@pytest.mark.parametrize("function", ["test", "predict"])
def test_xla_recompiles_of_evaluate_and_predict(function):
    model = _model("functional")
    _compile(model, jit=True)
    counter = RetraceCounter()
    if function == "test":
        model.evaluate(_varying(), verbose=0, callbacks=[counter])
    else:
        model.predict(_lengths_only(_varying()), verbose=0, callbacks=[counter])
    # evaluate() traces for the dataset's spec (dim 1 None) and recompiles
    # for every new length; predict() calls its function with the batches,
    # so the second length relaxes dim 1 (one retrace, which XLA compiles),
    # every later length only recompiles.
    retraces = 0 if function == "test" else 1
    assert counter.per_function == {function: {"retraces": retraces, "recompiles": 3}}
    assert counter.recompiles == len(LENGTHS) - 1
    first = "recompile" if function == "test" else "retrace"
    assert [(e.function, e.kind) for e in counter.events] == [
        (function, first), (function, "recompile"), (function, "recompile")
    ]
    assert counter.events[0].changes == ("x: shape (4, 5) -> (4, 9), dim 1 varies",)
    assert counter.events[-1].changes == ("x: shape (4, 13) -> (4, 17), dim 1 varies",)
    assert "dim 1 of x" in counter.events[-1].diagnosis
    assert "[8, 16, 24]" in counter.events[-1].fix  # covers 5..17, seen by it
    for event in counter.events:
        assert event.step is None
        assert event.call_seconds > 0 and event.seconds_lost is not None
    # Undone after the call; the same lengths again compile nothing new.
    wrapped = model.test_function if function == "test" else model.predict_function
    assert not wrappers.is_patched(wrapped)
    again = RetraceCounter()
    if function == "test":
        model.evaluate(_varying(), verbose=0, callbacks=[again])
    else:
        model.predict(_lengths_only(_varying()), verbose=0, callbacks=[again])
    assert again.events == [] and again.recompiles == 0


def test_fit_validation_recompiles_are_counted_as_test():
    model = _model("functional")
    _compile(model, jit=True)
    counter = RetraceCounter()
    x = np.ones((16, 7), "int32")
    y = np.zeros((16,), "int32")
    history = model.fit(
        x, y, batch_size=4, epochs=2, verbose=0, validation_data=_varying(),
        callbacks=[counter],
    )
    # The validation lengths are compiled in the first epoch only.
    assert counter.per_function == {"test": {"retraces": 0, "recompiles": 3}}
    assert {e.function for e in counter.events} == {"test"}
    assert counter.events[-1].changes == ("x: shape (4, 13) -> (4, 17), dim 1 varies",)
    assert history.history["recompiles"][-1] == 3.0
    assert "val_retraces" not in history.history  # evaluate()'s logs untouched
    assert not wrappers.is_patched(model.test_function)


@pytest.mark.parametrize("function", ["test", "predict"])
def test_fixed_shapes_count_nothing_in_evaluate_and_predict(function):
    model = _model("functional")
    _compile(model, jit=True)
    counter = RetraceCounter(strict=True)
    x = np.ones((24, 7), "int32")
    y = np.zeros((24,), "int32")
    for _ in range(2):
        if function == "test":
            model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[counter])
        else:
            model.predict(x, batch_size=4, verbose=0, callbacks=[counter])
    assert counter.retraces == 0 and counter.recompiles == 0 and counter.events == []


def test_one_event_per_recompile_with_steps_per_execution():
    model = _model("functional")
    _compile(model, jit=True, steps_per_execution=2)
    counter = RetraceCounter()
    # One batch per length: each call runs two lengths.
    model.fit(_varying(batches_per_length=1), epochs=1, verbose=0, callbacks=[counter])
    assert counter.per_function == {"train": {"retraces": 0, "recompiles": 3}}
    assert [e.kind for e in counter.events] == ["recompile"] * 3
    assert [e.changes for e in counter.events] == [
        ("x: shape (4, 5) -> (4, 9), dim 1 varies",),
        ("x: shape (4, 9) -> (4, 13), dim 1 varies",),
        ("x: shape (4, 13) -> (4, 17), dim 1 varies",),
    ]
    assert [e.step for e in counter.events] == [0, 2, 2]
    second, third = counter.events[1:]
    assert second.call_seconds == third.call_seconds  # one call, shared


def test_a_recompiled_model_starts_afresh():
    # compile() makes new step functions: their first trace, even for a
    # signature the old ones never saw, is not a retrace.
    model = _model("functional")
    _compile(model)
    counter = RetraceCounter(strict=True)
    model.fit(np.ones((8, 5), "int32"), np.zeros((8,), "int32"), batch_size=4,
              verbose=0, callbacks=[counter])
    _compile(model)
    model.fit(np.ones((8, 5), "float32"), np.zeros((8,), "int32"), batch_size=4,
              verbose=0, callbacks=[counter])  # a new dtype, a new function
    assert counter.retraces == 0 and counter.events == []
    # The same function again with that other dtype is a retrace.
    with pytest.raises(RetraceError, match="dtype"):
        model.fit(np.ones((8, 5), "int32"), np.zeros((8,), "int32"), batch_size=4,
                  verbose=0, callbacks=[counter])
