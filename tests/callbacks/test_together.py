"""The four callbacks in one fit, in either order: each still sees what it
needs (the wrappers stack and come off)."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import small_model

import keras
from conftest import KERAS_VERSION
from keras_gradboost import GradBoostModel
from keras_gradboost import wrappers
from keras_gradboost.callbacks import GradientAuditor
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import RetraceCounter
from keras_gradboost.callbacks import StepTimeMonitor
from keras_gradboost.callbacks import retrace as retrace_module


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
@pytest.mark.parametrize("reverse", [False, True])
def test_all_callbacks_together(cls, reverse):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    model = cls(inputs, keras.layers.Dense(1, name="out")(h))
    model.compile(optimizer="sgd", loss="mse")
    unused = keras.layers.Dense(2, name="unused")
    unused.build((None, 4))
    model.spare = unused
    x = np.random.default_rng(0).normal(size=(100, 4)).astype("float32")
    y = np.ones((100, 1), "float32")
    watcher = NaNWatcher(verbose=0)
    monitor = StepTimeMonitor(window=3, split_at=None)
    counter = RetraceCounter()
    auditor = GradientAuditor(every_n_steps=2, on_missing="ignore", verbose=0)
    callbacks = [watcher, monitor, counter, auditor]
    if reverse:
        callbacks.reverse()
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    # 13 batches (the last one of 4 examples) per epoch.
    logs = history.history
    assert {"step_ms", "retraces", "nonfinite_steps", "loss"} <= set(logs)
    assert monitor.report().steps == 26 and monitor.report().windows >= 6
    # The short last batch retraces nothing: the step is traced for the
    # dataset's spec, as without the callbacks.
    assert counter.retraces == 0 and counter.events == []
    # Keras before 3.15 does not track `spare`, set on the built functional
    # model (conftest.needs_layer_set_on_functional): nothing is missing.
    spare = ["unused/kernel", "unused/bias"] if KERAS_VERSION >= (3, 15) else []
    assert [m.variable for m in auditor.missing] == spare
    assert auditor.report().checks >= 6
    assert watcher.events == []
    # Everything came off: a plain fit has none of the extra logs.
    plain = model.fit(x, y, batch_size=8, verbose=0).history
    assert set(plain) == {"loss"}


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_under_mirrored_strategy(cls, regression_data):
    # ReductionToOneDevice: TensorFlow keys collective all-reduces
    # process-wide, and a plain Keras step's collective under a second
    # MirroredStrategy in the same process can collide with an earlier
    # test's (a shape mismatch on "collective instance 100"), whatever the
    # callbacks.
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        model = small_model(cls)
        kwargs = {"accumulate_steps": 2} if cls is GradBoostModel else {}
        model.compile(optimizer="sgd", loss="mse", **kwargs)
    x, y = regression_data
    x, y = x[:96], y[:96]
    monitor = StepTimeMonitor(window=3)
    counter = RetraceCounter()
    auditor = GradientAuditor(every_n_steps=2, verbose=0)
    history = model.fit(
        x, y, batch_size=8, verbose=0, callbacks=[monitor, counter, auditor]
    )
    assert history.history["retraces"] == [0.0]
    assert monitor.report().windows == 3 and monitor.report().split is None
    assert "under a distribution strategy" in monitor.report().split_note
    # Both replicas' parts counted: 8 examples a step (each window's
    # examples/s times its ms/step), not one replica's 4.
    report = monitor.report()
    assert report.examples_per_s * report.median_step_ms / 1000 == pytest.approx(8)
    # Each distributed batch is read as its first replica's part: one
    # concrete signature for the whole fit.
    assert len(retrace_module._COMPILED[model.train_function]["seen"]) == 1
    report = auditor.report()
    assert report.checks == (3 if kwargs else 6)
    assert len(report.layer_norms) == 2 and all(n > 0 for n in report.layer_norms.values())
    assert auditor.missing == []


class _Counting:
    """Records each trace of `train_step` (Python runs only while tracing)."""

    def train_step(self, data):
        self.traces.append(tuple(tuple(t.shape) for t in tf.nest.flatten(data)))
        return super().train_step(data)


class CountingModel(_Counting, keras.Model):
    pass


class CountingGradBoostModel(_Counting, GradBoostModel):
    pass


def _callback_sets():
    return {
        "NaNWatcher": lambda: [NaNWatcher(verbose=0)],
        "StepTimeMonitor": lambda: [StepTimeMonitor(window=2, split_at=None)],
        "RetraceCounter": lambda: [RetraceCounter(strict=True)],
        "GradientAuditor": lambda: [GradientAuditor(every_n_steps=2, verbose=0)],
        "all": lambda: [
            NaNWatcher(verbose=0),
            StepTimeMonitor(window=2, split_at=None),
            RetraceCounter(strict=True),
            GradientAuditor(every_n_steps=2, verbose=0),
        ],
    }


# The four callbacks together: any one that added a trace would add it here
# too (each on its own cost CI 25 s more; on a failure, run them one by one
# from `_callback_sets()`).
@pytest.mark.parametrize("callbacks", ["all"])
@pytest.mark.parametrize("cls", [CountingModel, CountingGradBoostModel])
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_callbacks_add_no_trace(callbacks, cls, steps_per_execution):
    # 100 examples in batches of 8: a short last batch in every epoch.
    x = np.random.default_rng(0).normal(size=(100, 4)).astype("float32")
    y = np.ones((100, 1), "float32")
    traces = {}
    for name in ("without", "with"):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = cls(inputs, keras.layers.Dense(1)(inputs))
        model.traces = []
        kwargs = {"accumulate_steps": 2} if cls is CountingGradBoostModel else {}
        model.compile(
            optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution, **kwargs
        )
        extra = _callback_sets()[callbacks]() if name == "with" else []
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=extra)
        traces[name] = model.traces
    assert traces["with"] == traces["without"]
    assert traces["without"] == [((None, 4), (None, 1))]


class Boom(keras.callbacks.Callback):
    """Raises from its own hook, as a user's callback or a KeyboardInterrupt
    between steps would: Keras then calls no on_train_end."""

    def __init__(self, at_batch):
        super().__init__()
        self.at_batch = at_batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at_batch:
            raise RuntimeError("boom")


class FailsAtStep(keras.layers.Layer):
    """Identity, except that the step whose input holds 99.0 fails."""

    def call(self, x):
        tf.debugging.assert_less(x, 99.0, message="planted failure")
        return x


def _four(tmp_path):
    return [
        NaNWatcher(verbose=0),
        StepTimeMonitor(window=2, split_at=None, log_dir=str(tmp_path), profile_steps=(1, 50)),
        RetraceCounter(),
        GradientAuditor(every_n_steps=1, on_missing="ignore", verbose=0),
    ]


def _profiler_free(tmp_path):
    try:
        tf.profiler.experimental.start(str(tmp_path / "again"))
    except Exception:  # noqa: BLE001 - "another profiler is running"
        return False
    tf.profiler.experimental.stop()
    return True


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_exception_in_another_callback_leaves_nothing_behind(cls, tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = cls(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = np.ones((64, 1), "float32")
    four = _four(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=four + [Boom(2)])
    # The wrappers are still there (nothing has told them yet) and so is the
    # profiler: the next fit without these callbacks finds them stale.
    history = model.fit(x, y, batch_size=8, verbose=0)
    assert set(history.history) == {"loss"}
    assert not wrappers.is_patched(model.train_function)
    assert _profiler_free(tmp_path)
    # The same fit with the callbacks again works and reports as usual.
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=_four(tmp_path))
    assert {"step_ms", "retraces", "nonfinite_steps"} <= set(history.history)


def test_exception_inside_the_step_tears_down_at_once(tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1)(FailsAtStep()(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((64, 4), "float32")
    x[40] = 99.0  # the sixth batch of 8
    y = np.ones((64, 1), "float32")
    with pytest.raises(tf.errors.InvalidArgumentError, match="planted failure"):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=_four(tmp_path))
    # Torn down by the failed call itself, before any other fit.
    assert not wrappers.is_patched(model.train_function)
    assert _profiler_free(tmp_path)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: NaNWatcher(verbose=2), ValueError, "verbose=2"),
        (lambda: NaNWatcher(locate="yes"), TypeError, "locate='yes'"),
        (lambda: NaNWatcher(dump_dir=3), TypeError, "dump_dir=3"),
        (lambda: StepTimeMonitor(verbose="loud"), TypeError, "verbose='loud'"),
        (lambda: StepTimeMonitor(log_dir=["logs"]), TypeError, r"log_dir=\['logs'\]"),
        (lambda: StepTimeMonitor(log_dir=""), ValueError, "log_dir=''"),
        (lambda: RetraceCounter(verbose=-1), ValueError, "verbose=-1"),
        (lambda: GradientAuditor(show_non_trainable=1), TypeError, "show_non_trainable=1"),
        (lambda: GradientAuditor(verbose=None), TypeError, "verbose=None"),
    ],
)
def test_common_arguments_are_checked(make, error, match):
    with pytest.raises(error, match=match):
        make()


class StepTraceCounting(keras.Model):
    """Counts how often its train step is traced (a Python side effect)."""

    traces = 0

    def train_step(self, data):
        type(self).traces += 1
        return super().train_step(data)


@pytest.mark.parametrize(
    "make",
    [
        lambda: NaNWatcher(verbose=0),
        lambda: NaNWatcher(action="skip", verbose=0),
        lambda: StepTimeMonitor(window=2, split_at=None),
        lambda: RetraceCounter(),
        lambda: GradientAuditor(verbose=0),
    ],
    ids=["NaNWatcher", "NaNWatcher-skip", "StepTimeMonitor", "RetraceCounter", "GradientAuditor"],
)
def test_a_fresh_callback_in_every_fit_traces_the_step_once(make):
    # `model.fit(..., callbacks=[NaNWatcher()])` in a loop: the guarded step
    # is made once per compiled model, not once per callback instance.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = StepTraceCounting(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 4), "float32")
    y = np.ones((16, 1), "float32")
    StepTraceCounting.traces = 0
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[make()])
    first = StepTraceCounting.traces
    for _ in range(4):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[make()])
    assert StepTraceCounting.traces == first
    model.fit(x, y, batch_size=8, verbose=0)  # and the plain function is intact
    assert np.isfinite(model.get_weights()[0]).all()
