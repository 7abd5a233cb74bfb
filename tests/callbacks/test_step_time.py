"""StepTimeMonitor: the window maths under a fake clock, and one real run
whose split is checked against the measured step and the weights."""

import os
import types

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import rnn_states
from conftest import stateful_rnn_data
from conftest import stateful_rnn_model
from keras_gradboost import GradBoostModel
from keras_gradboost.callbacks import StepTimeMonitor
from keras_gradboost.callbacks import step_time
from keras_gradboost.callbacks.step_time import WindowTimer
from keras_gradboost.callbacks.step_time import advice
from keras_gradboost.callbacks.step_time import percentile

# ------------------------------------------------------------ pure maths


def test_window_timer_maths():
    timer = WindowTimer(window=4)
    assert not timer.due()
    timer.start(10.0)
    timer.add(2, 64)
    assert not timer.due()
    timer.add(2, 64)
    assert timer.due()
    ms, eps = timer.close(10.2)  # 4 steps, 128 examples in 0.2 s
    assert ms == pytest.approx(50.0) and eps == pytest.approx(640.0)
    timer.add(4, 128)
    timer.close(10.6)  # next window opened at 10.2: 100 ms/step
    assert timer.ms_per_step == pytest.approx([50.0, 100.0])
    assert timer.median() == pytest.approx(75.0)
    assert timer.p90() == pytest.approx(95.0)
    timer.discard()
    assert not timer.running and not timer.due()


def test_percentile():
    assert percentile([], 90) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile(list(range(11)), 90) == pytest.approx(9.0)


@pytest.mark.parametrize(
    "step_ms, share, expected",
    [
        (50.0, 0.2, "input pipeline"),
        (50.0, 0.6, "autodiff techniques pay"),
        (50.0, 0.4, "balanced"),
        (5.0, 0.4, "XLA's compile cost may not pay"),
    ],
)
def test_advice(step_ms, share, expected):
    assert any(expected in tip for tip in advice(step_ms, share))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"window": 0}, ValueError, "Received: window=0. Expected a positive int"),
        ({"window": 2.5}, TypeError, "window=2.5"),
        ({"window": True}, TypeError, "window=True"),
        ({"split_at": 0}, ValueError, "split_at=0"),
        ({"split_at": "late"}, ValueError, "split_at='late'"),
        ({"profile_steps": (3, 1), "log_dir": "x"}, ValueError, "profile_steps=\\(3, 1\\)"),
        ({"profile_steps": (1, 2)}, ValueError, "needs `log_dir`"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        StepTimeMonitor(**kwargs)


# ------------------------------------------------------ fake clock, fit


class FakeTime:
    """A clock that advances 10 ms per training step run so far (read from
    the optimizer), plus 0.5 s for the first step (trace and compile)."""

    def __init__(self, model):
        self.model = model

    def perf_counter(self):
        steps = int(self.model.optimizer.iterations.numpy())
        return 100.0 + 0.010 * steps + (0.5 if steps else 0.0)


def _small(cls=keras.Model):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(3)(h))


def _xy(n=104):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


class Sub(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


def _kind(kind):
    if kind == "sequential":
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
        )
    if kind == "subclassed":
        keras.utils.set_random_seed(0)
        return Sub()
    return _small(GradBoostModel if kind == "gradboost" else keras.Model)


@pytest.mark.parametrize(
    "kind, steps_per_execution",
    [("functional", 1), ("functional", 2), ("sequential", 1), ("subclassed", 1), ("gradboost", 1)],
)
def test_window_maths_under_a_fake_clock(monkeypatch, kind, steps_per_execution):
    model = _kind(kind)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    monkeypatch.setattr(step_time, "time", FakeTime(model))
    monitor = StepTimeMonitor(window=4, split_at=None)
    x, y = _xy()
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor])
    report = monitor.report()
    # First call: 1 step (or 2) at 10 ms, plus the 0.5 s first-step cost.
    assert report.first_step_ms == pytest.approx(500.0 + 10.0 * steps_per_execution)
    assert report.median_step_ms == pytest.approx(10.0)
    assert report.p90_step_ms == pytest.approx(10.0)
    assert report.examples_per_s == pytest.approx(800.0)  # 8 examples / 10 ms
    assert report.steps == 26
    # Epoch 1: 13 steps, the first call is the first step; windows of 4
    # steps. Epoch 2 starts a new window (the epoch boundary is not timed).
    expected_windows = {1: 3 + 3, 2: 2 + 3}[steps_per_execution]
    assert report.windows == expected_windows
    assert history.history["step_ms"] == pytest.approx([10.0, 10.0])
    assert history.history["examples_per_s"] == pytest.approx([800.0, 800.0])
    assert "steady step, median" in monitor.summary()
    assert report.split is None
    assert report.split_note == "not measured (split_at=None)"
    assert "split: not measured (split_at=None)" in monitor.summary()


def test_fresh_state_on_each_fit(monkeypatch):
    model = _small()
    model.compile(optimizer="sgd", loss="mse")
    monkeypatch.setattr(step_time, "time", FakeTime(model))
    monitor = StepTimeMonitor(window=4, split_at=None)
    x, y = _xy(40)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    assert monitor.report().steps == 5 and monitor.report().windows == 1
    # The wrapper is gone after fit: a fit without the monitor has no step_ms.
    history = model.fit(x, y, batch_size=8, verbose=0)
    assert "step_ms" not in history.history


# ------------------------------------------------------------ real run


def _mlp(cls=keras.Model):
    # Small: next to another test process its 256 x 512 matmuls took 100-160
    # s instead of 6 (contended threads), and the split needs no size.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    h = keras.layers.Dense(128, activation="relu")(inputs)
    h = keras.layers.Dense(128, activation="relu")(h)
    return cls(inputs, keras.layers.Dense(10)(h))


@pytest.mark.parametrize("kind", ["keras", "gradboost"])
def test_real_split_parts_are_positive_add_up_and_change_nothing(kind, tmp_path):
    cls = GradBoostModel if kind == "gradboost" else keras.Model
    kwargs = {"accumulate_steps": 2} if kind == "gradboost" else {}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 8, 64)).astype("float32")
    y = rng.integers(0, 10, size=(64 * 8,)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def run(callbacks):
        model = _mlp(cls)
        model.compile(optimizer="adam", loss=loss, metrics=["accuracy"], **kwargs)
        history = model.fit(
            x, y, batch_size=64, shuffle=False, verbose=0, callbacks=callbacks
        )
        return model, history

    monitor = StepTimeMonitor(window=4, log_dir=str(tmp_path))
    model, history = run([monitor])
    reference, ref_history = run([])
    # The probe changed neither the weights, nor the optimizer, nor metrics.
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(model.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert history.history["accuracy"] == ref_history.history["accuracy"]

    report = monitor.report()
    split = report.split
    assert split is not None and split.at_step == 4
    # Timings themselves are not asserted (a shared CPU); the split's
    # arithmetic is checked with stubbed probe times below.
    assert split.forward_ms > 0
    assert min(split.parts().values()) >= 0
    assert split.backward_share == pytest.approx(split.backward_ms / split.step_ms)
    assert report.first_step_ms > report.median_step_ms
    assert report.advice and report.probe_seconds > 0
    assert history.history["split_backward_ms"][0] == pytest.approx(split.backward_ms)
    # TensorBoard scalars were written.
    tags = set()
    for name in os.listdir(tmp_path):
        for event in tf.compat.v1.train.summary_iterator(str(tmp_path / name)):
            tags.update(v.tag for v in event.summary.value)
    assert {"step_ms", "examples_per_s", "backward_share"} <= tags


@pytest.mark.parametrize("cls", [keras.Model, GradBoostModel])
def test_the_split_probe_leaves_a_stateful_rnns_states_as_they_were(cls):
    # The probe runs the forward pass on a batch several times. A stateful
    # RNN's states (variables Keras does not list among the model's) were
    # not put back: training went on from states advanced by the probe,
    # 3.5e-4 away from the run without the monitor after 2 epochs.
    x, y = stateful_rnn_data()
    runs = []
    for callbacks in ([StepTimeMonitor(window=2, split_at=2)], []):
        model = stateful_rnn_model(cls)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        runs.append(model)
    monitored, reference = runs
    for a, b in zip(monitored.get_weights() + rnn_states(monitored), reference.get_weights() + rnn_states(reference)):
        np.testing.assert_array_equal(a, b)


def test_profile_steps_write_a_trace(tmp_path):
    model = _small()
    model.compile(optimizer="sgd", loss="mse")
    monitor = StepTimeMonitor(window=2, split_at=None, log_dir=str(tmp_path), profile_steps=(2, 3))
    x, y = _xy(64)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    found = [root for root, _, files in os.walk(tmp_path) if root.endswith(os.path.join("plugins", "profile")) or any(f.endswith(".xplane.pb") for f in files)]
    assert found, list(os.walk(tmp_path))


@pytest.mark.parametrize(
    "window_ms, probe, expected",
    [
        # The step is longer than the compiled parts: the rest is input wait.
        (10.0, {"forward": 0.002, "forward_backward": 0.005, "full": 0.006},
         {"input": 4.0, "forward": 2.0, "backward": 3.0, "optimizer": 1.0, "step": 10.0}),
        # The compiled parts add up to more than the window's step (noise):
        # no negative input wait, the total is the parts' sum.
        (5.0, {"forward": 0.002, "forward_backward": 0.005, "full": 0.006},
         {"input": 0.0, "forward": 2.0, "backward": 3.0, "optimizer": 1.0, "step": 6.0}),
        # accumulate_steps=4: each micro-batch adds its gradients (0.5 ms)
        # and a quarter of the update (4 ms / 4).
        (10.0, {"forward": 0.002, "forward_backward": 0.005, "full": 0.009,
                "accumulate": 0.0055},
         {"input": 3.5, "forward": 2.0, "backward": 3.0, "optimizer": 1.5, "step": 10.0}),
    ],
)
def test_split_arithmetic_with_stubbed_probe_times(monkeypatch, window_ms, probe, expected):
    from keras_gradboost.callbacks import step_time

    monkeypatch.setattr(step_time, "split_times", lambda model, batch: (probe, 0.25))
    monitor = StepTimeMonitor(window=4)
    if "accumulate" in probe:
        monitor.set_model(types.SimpleNamespace(gradboost_config=types.SimpleNamespace(accumulate_steps=4)))
    monitor._timer = step_time.WindowTimer(4)
    monkeypatch.setattr(monitor._timer, "median", lambda: window_ms)
    monitor._steps, monitor._logs, monitor._writer = 8, {}, None
    monitor._measure_split(batch=None)
    split = monitor._split
    assert split.input_ms == pytest.approx(expected["input"])
    assert split.forward_ms == pytest.approx(expected["forward"])
    assert split.backward_ms == pytest.approx(expected["backward"])
    assert split.optimizer_ms == pytest.approx(expected["optimizer"])
    assert split.step_ms == pytest.approx(expected["step"])
    assert split.backward_share == pytest.approx(expected["backward"] / expected["step"])
    assert split.compile_ms == pytest.approx(250.0) and split.at_step == 7
    assert monitor._logs["split_backward_ms"] == pytest.approx(expected["backward"])


class CountingBlock(keras.layers.Layer):
    """A block that counts how often its forward is traced."""

    traced = 0

    def build(self, input_shape):
        self.dense = keras.layers.Dense(input_shape[-1])
        self.dense.build(input_shape)

    def call(self, x):
        CountingBlock.traced += 1
        return x + self.dense(x)


@pytest.mark.parametrize("recompute", [None, ["block"]])
def test_split_probe_runs_the_recompute_forward(recompute):
    # The probe times the step GradBoostModel runs: with the block
    # recomputed, its forward is traced again inside the backward.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = GradBoostModel(inputs, keras.layers.Dense(1)(CountingBlock(name="block")(inputs)))
    model.compile(optimizer="sgd", loss="mse", recompute=recompute)
    x, y = np.ones((4, 8), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, verbose=0)
    CountingBlock.traced = 0
    step_time.split_times(model, (tf.constant(x), tf.constant(y)), repeats=1)
    # forward, forward+backward, full: 3 traces, plus 2 recomputes.
    assert CountingBlock.traced == (5 if recompute else 3)
