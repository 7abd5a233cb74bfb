"""`compile(jit_compile="measure")` and the XLA-blocked reports: the
schedule and decision with a fake clock, real fits equal to jit_compile=False
ones (every measured call is a real step), save/load, bad values, layers
with supports_jit=False and an op without an XLA kernel."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_gradboost import hooks
from keras_gradboost import jit_measure
from keras_gradboost import measure_schedule
from keras_gradboost import wrappers
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.model import GradBoostModel

from conftest import max_weight_diff
from conftest import small_model

# XLA and the default CPU kernels may round differently (fusion reorders
# float32 sums); a few ulps over 13 SGD updates, far below any real bug.
XLA_TOLERANCE = 1e-5


def _fit(model, x, y, epochs=1, callbacks=None, **compile_kwargs):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    return model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks
    )


# ------------------------------------------------------------- the Measurer


def test_measurer_schedule_warms_up_then_interleaves():
    measurer = jit_measure.Measurer(warmup_calls=1, timed_calls=2)
    seen = []
    while measurer.result is None:
        seen.append(measurer.next_call())
        measurer.record(0.001)
    assert seen == [(True, False), (False, False), (True, True), (False, True),
                    (True, True), (False, True)]


@pytest.mark.parametrize("xla_ms, plain_ms, expected", [(1.0, 3.0, True), (3.0, 1.0, False)])
def test_measurer_picks_the_lower_median_ignoring_warmup(xla_ms, plain_ms, expected):
    measurer = jit_measure.Measurer()
    durations = {True: xla_ms, False: plain_ms}
    first = True
    while measurer.result is None:
        jit, timed = measurer.next_call()
        # The warm-up calls (tracing, compiling) are slow the other way round.
        ms = 500.0 * durations[not jit] if not timed else durations[jit]
        # One outlier per variant does not move the median.
        if timed and first:
            ms, first = 1000.0, False
        measurer.record(ms / 1000)
    result = measurer.result
    assert result.jit_compile is expected
    assert result.xla_ms == pytest.approx(xla_ms)
    assert result.no_xla_ms == pytest.approx(plain_ms)
    assert result.timed_calls == jit_measure.TIMED_CALLS
    assert f"{min(xla_ms, plain_ms):.2f} ms" in result.message()
    assert result.message().startswith(
        'jit_compile="measure": ' + ("XLA;" if expected else "no XLA;")
    )


def test_a_unit_is_whole_windows_and_goes_on_until_one_closes():
    # Windows of 2 micro-batches, one per call; 5 calls per epoch (the last
    # a partial window, flushed at the epoch's end). Each variant times its
    # calls that update as well as those that only add (one call per unit
    # timed XLA on the adding calls only, no XLA on the updating ones).
    measurer = jit_measure.Measurer(warmup_calls=1, timed_calls=2, calls_per_timing=2)
    runs, call = [], 0
    while measurer.result is None:
        jit, timed = measurer.next_call()
        in_epoch = call % 5
        closed = in_epoch % 2 == 1  # the 2nd and 4th calls close a window
        runs.append(jit)
        # XLA: 1 ms per call; no XLA: 3 ms adding, 5 ms updating (4 ms a call).
        measurer.record((1.0 if jit else (5.0 if closed else 3.0)) / 1000, window_closed=closed)
        call += 1
    # The 5th call (a partial window) stays in XLA's unit, which ends when
    # the next epoch's first window closes: 3 calls.
    assert runs == [True, True, False, False, True, True, True, False, False,
                    True, True, True, False, False]
    assert measurer.result.no_xla_ms == pytest.approx(4.0)
    assert measurer.result.xla_ms == pytest.approx(1.0)
    assert measurer.result.calls_per_timing == 2
    assert "2 calls per timing, whole accumulation windows" in measurer.result.message()


@pytest.mark.parametrize("name", ["warmup_calls", "timed_calls", "calls_per_timing"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_measurer_rejects_bad_counts(name, value):
    with pytest.raises(ValueError, match=f"`{name}`. Received: {name}={value!r}"):
        jit_measure.Measurer(**{name: value})


# -------------------------------------------------------- with a fake clock


class FakeClock:
    """Each train call takes `xla_ms` or `plain_ms`, by the variant the
    measuring function is about to time (read at the call's second tick)."""

    def __init__(self, model, xla_ms, plain_ms):
        self.model, self.ms = model, {True: xla_ms, False: plain_ms}
        self.now, self.ticks = 0.0, 0

    def __call__(self):
        self.ticks += 1
        if self.ticks % 2 == 0:
            measuring = self.measuring = wrappers.base_train_function(self.model)
            jit, _ = measuring.measurer.next_call()
            self.now += self.ms[jit] / 1000
        return self.now


@pytest.mark.parametrize("xla_ms, plain_ms, expected", [(2.0, 9.0, True), (9.0, 2.0, False)])
def test_fake_clock_decides_and_keeps_only_the_choice(
    regression_data, monkeypatch, capsys, xla_ms, plain_ms, expected
):
    x, y = regression_data
    model = small_model(GradBoostModel)
    clock = FakeClock(model, xla_ms, plain_ms)
    monkeypatch.setattr(jit_measure, "perf_counter", clock)
    _fit(model, x, y, jit_compile="measure")
    measurement = model.jit_measurement
    assert measurement.jit_compile is expected
    assert (measurement.xla_ms, measurement.no_xla_ms) == pytest.approx((xla_ms, plain_ms))
    assert bool(model.jit_compile) is expected
    # From the decision on, fit runs Keras' own function: no wrapper.
    assert not isinstance(model.train_function, jit_measure.MeasuringTrainFunction)
    out = capsys.readouterr().out
    assert out.count('jit_compile="measure"') == 1
    assert ("XLA;" if expected else "no XLA;") in out
    # The next fit keeps the choice: nothing is measured again.
    _fit_again = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert _fit_again.history["loss"]
    assert model.jit_measurement is measurement
    assert 'jit_compile="measure"' not in capsys.readouterr().out
    # A stale reference to the measuring function runs the choice.
    data = tf.data.Dataset.from_tensor_slices((x[:8], y[:8])).batch(8)
    iterations = int(model.optimizer.iterations)
    iterator = iter(data)
    assert "loss" in clock.measuring(iterator)
    assert int(model.optimizer.iterations) == iterations + 1
    with pytest.raises(StopIteration):
        clock.measuring(iterator)


def test_too_few_calls_stay_undecided_and_the_next_fit_goes_on(regression_data):
    x, y = regression_data
    model = small_model(GradBoostModel)
    calls = 2 * (jit_measure.WARMUP_CALLS + jit_measure.TIMED_CALLS)
    _fit(model, x[: 8 * (calls - 1)], y[: 8 * (calls - 1)], jit_compile="measure")
    assert model.jit_measurement is None
    model.fit(x[:8], y[:8], batch_size=8, verbose=0)
    assert model.jit_measurement is not None


# -------------------------------------------------- real fits, real batches


@pytest.mark.parametrize(
    "compile_kwargs",
    [{}, {"accumulate_steps": 3}, {"steps_per_execution": 2},
     {"accumulate_steps": 2, "steps_per_execution": 3}],
    ids=["plain", "accumulate", "steps_per_execution", "both"],
)
def test_measured_fit_equals_a_fit_without_xla(regression_data, compile_kwargs):
    x, y = regression_data
    measured = small_model(GradBoostModel)
    plain = small_model(GradBoostModel)
    # 4 epochs: with accumulation a unit is whole windows (up to 6 calls).
    h_measured = _fit(measured, x, y, epochs=4, jit_compile="measure", **compile_kwargs)
    h_plain = _fit(plain, x, y, epochs=4, jit_compile=False, **compile_kwargs)
    assert measured.jit_measurement.jit_compile in (True, False)
    assert bool(measured.jit_compile) is measured.jit_measurement.jit_compile
    # Every measured call was a real step: same updates, none lost or repeated.
    assert int(measured.optimizer.iterations) == int(plain.optimizer.iterations)
    assert max_weight_diff(measured, plain) < XLA_TOLERANCE
    np.testing.assert_allclose(
        h_measured.history["loss"], h_plain.history["loss"], rtol=XLA_TOLERANCE
    )


def test_epochs_shorter_than_a_window_still_decide(regression_data):
    # 2 calls per epoch, windows of 4 micro-batches: no call closes a window
    # (each epoch's end flushes a partial one), so a unit of 4 calls ends at
    # every second epoch's end: 8 units, decided at the 16th. Before, no
    # unit ever ended: no decision, and a host read per call for good.
    x, y = regression_data
    measured = small_model(GradBoostModel)
    plain = small_model(GradBoostModel)
    _fit(measured, x[:16], y[:16], epochs=16, jit_compile="measure", accumulate_steps=4)
    _fit(plain, x[:16], y[:16], epochs=16, jit_compile=False, accumulate_steps=4)
    assert measured.jit_measurement is not None
    assert measured.jit_measurement.calls_per_timing == 4
    assert max_weight_diff(measured, plain) < XLA_TOLERANCE


def test_windows_of_other_optimizers_hold_a_unit_open():
    # minimize() keeps the windows of a second optimizer (and of a subset
    # of the variables) apart from the model's own accumulator, which
    # never ticks here. 5 calls per epoch, windows of 2: a unit ends only
    # where those windows close. Before, every call read as closing one:
    # units of 2 calls, so the next epoch's first window mixed variants.
    from test_minimize import data
    from test_minimize import two

    model = two(accumulate_steps=2, jit_compile="measure")
    x, y = data(40)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    measuring = wrappers.base_train_function(model)
    # Units: calls 1-2, 3-4, 5 + the next epoch's 1-2, 3-4; its 5th open.
    assert len(measuring.measurer.units) == 8 - 4
    assert measuring.measurer.due() is False  # 1 call into the 5th unit


def test_measure_with_a_callback_that_wraps_the_train_function(regression_data):
    x, y = regression_data
    measured = small_model(GradBoostModel)
    plain = small_model(GradBoostModel)
    _fit(measured, x, y, jit_compile="measure", callbacks=[NaNWatcher(action="skip")])
    _fit(plain, x, y, jit_compile=False)
    assert measured.jit_measurement is not None
    assert max_weight_diff(measured, plain) < XLA_TOLERANCE


# ------------------------------------------------ arguments and save/load


@pytest.mark.parametrize(
    "value, error", [("yes", ValueError), ("Measure", ValueError), (1, TypeError),
                     (None, TypeError)]
)
def test_bad_jit_compile_values_raise_naming_the_argument(value, error):
    model = small_model(GradBoostModel)
    with pytest.raises(error) as info:
        model.compile(optimizer="sgd", loss="mse", jit_compile=value)
    message = str(info.value)
    assert f"`jit_compile`. Received: jit_compile={value!r}" in message
    assert '"measure"' in message and '"auto"' in message


def test_save_and_load_keep_measure(regression_data, tmp_path):
    x, y = regression_data
    model = small_model(GradBoostModel)
    _fit(model, x, y, jit_compile="measure", accumulate_steps=2)
    assert model.get_compile_config()["jit_compile"] == "measure"
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_compile_config()["jit_compile"] == "measure"
    assert loaded.gradboost_config.accumulate_steps == 2
    assert loaded.jit_measurement is None  # 13 calls of 16: its progress goes on
    # The 7th unit's second and third calls (its window), the 8th's two.
    loaded.fit(x[:32], y[:32], batch_size=8, verbose=0)
    assert loaded.jit_measurement is not None and not loaded.jit_measurement.restored


def test_a_candidate_whose_timings_all_traced_is_not_called_blocked():
    # Functions made anew (loads, a callback's) trace at their first call,
    # whose unit is left out. With no timing of XLA left, no XLA is kept:
    # XLA was not blocked (NaN, not None), and the record saves and loads.
    measurer = jit_measure.Measurer()
    for jit, timed in list(measurer.units):
        measurer.record(1.0, traced=timed and jit)
    m = measurer.result
    assert m.jit_compile is False and np.isnan(m.xla_ms) and m.no_xla_ms == pytest.approx(1000.0)
    assert "no timing of XLA is left" in m.reason and "3 XLA timing(s) left out" in m.reason
    record = jit_measure.saved_state(m, measurer, "CPU")
    back = measure_schedule.decode_state(measure_schedule.encode_state(record))
    restored = jit_measure.restored_measurement(back["decision"])
    assert restored.jit_compile is False and np.isnan(restored.xla_ms) and restored.restored


def test_progress_round_trips_with_bool_candidates():
    measurer = jit_measure.Measurer(calls_per_timing=2)
    for seconds in (1.0, 1.0, 2.0, 2.0, 3.0):
        measurer.record(seconds)
    back = measure_schedule.decode_state(
        measure_schedule.encode_state({"progress": measurer.progress()})
    )
    again = jit_measure.Measurer(calls_per_timing=2)
    assert again.resume(back["progress"]) is None
    assert again.progress() == measurer.progress() and again.next_call() == measurer.next_call()
    other = jit_measure.Measurer(calls_per_timing=3)
    assert "another schedule" in other.resume(back["progress"])


def _decided_file(regression_data, tmp_path, monkeypatch):
    """Weights saved by a fit that measured and chose XLA (2 vs 9 ms)."""
    x, y = regression_data
    model = small_model(GradBoostModel)
    monkeypatch.setattr(jit_measure, "perf_counter", FakeClock(model, 2.0, 9.0))
    _fit(model, x, y, jit_compile="measure")
    assert model.jit_measurement.jit_compile is True
    path = str(tmp_path / "decided.weights.h5")
    model.save_weights(path)
    return path


def _load(path, **compile_kwargs):
    loaded = small_model(GradBoostModel)
    loaded.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded.load_weights(path)
    return loaded, [str(w.message) for w in caught]


def test_a_saved_decision_is_kept_without_measuring(regression_data, tmp_path, monkeypatch, capsys):
    # Before, a loaded model measured again: its first calls alternated XLA
    # and no XLA where the saved run ran its choice (with Dropout, other
    # masks than the run never stopped).
    path = _decided_file(regression_data, tmp_path, monkeypatch)
    capsys.readouterr()
    loaded, said = _load(path, jit_compile="measure")
    assert not said
    assert loaded.jit_measurement.restored and loaded.jit_measurement.jit_compile is True
    assert loaded.jit_measurement.xla_ms == pytest.approx(2.0)
    assert "restored with the weights" in capsys.readouterr().out
    x, y = regression_data
    loaded.fit(x[:16], y[:16], batch_size=8, verbose=0)
    assert loaded.jit_compile is True
    assert not isinstance(wrappers.base_train_function(loaded), jit_measure.MeasuringTrainFunction)
    # Loaded before compile(): put back by it.
    early = small_model(GradBoostModel)
    early.load_weights(path)
    early.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile="measure")
    assert early.jit_measurement.restored and early.jit_compile is True


def test_a_decided_model_loading_a_file_saved_before_measuring_keeps_it_and_says_so(
    regression_data, tmp_path, monkeypatch
):
    start = small_model(GradBoostModel)
    start.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile="measure")
    path = str(tmp_path / "start.weights.h5")
    start.save_weights(path)  # no record: nothing measured yet
    x, y = regression_data
    decided = small_model(GradBoostModel)
    monkeypatch.setattr(jit_measure, "perf_counter", FakeClock(decided, 2.0, 9.0))
    _fit(decided, x, y, jit_compile="measure")
    with pytest.warns(UserWarning, match=r'saved before jit_compile="measure" had measured, '
                                         r"but this model has decided \(XLA\) and keeps it"):
        decided.load_weights(path)
    assert decided.jit_measurement.jit_compile is True and not decided.jit_measurement.restored


def test_a_saved_decision_another_device_or_setting_cannot_take_is_named(
    regression_data, tmp_path, monkeypatch
):
    path = _decided_file(regression_data, tmp_path, monkeypatch)
    from keras_gradboost import precision

    loaded, said = _load(path, jit_compile=False)  # a fixed setting: not adopted
    assert len(said) == 1 and "a measured jit_compile decision (XLA)" in said[0], said
    assert "jit_compile=False" in said[0] and loaded.jit_measurement is None
    monkeypatch.setattr(precision, "gpu_available", lambda: True)
    loaded, said = _load(path, jit_compile="measure")
    assert len(said) == 1 and "made on a CPU; this model trains on a GPU" in said[0], said
    assert loaded.jit_measurement is None  # measures again


# ------------------------------------------------------- XLA that is blocked


class NoJit(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False

    def call(self, x):
        return x


def _model_with(layer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="out")(layer(hidden))
    return GradBoostModel(inputs, outputs)


@pytest.mark.parametrize("jit_compile", [True, "measure"])
def test_a_layer_without_jit_support_is_named(regression_data, jit_compile):
    x, y = regression_data
    model = _model_with(NoJit(name="no_jit_here"))
    assert hooks.keras_supports_jit(model) is False
    with pytest.warns(UserWarning, match="XLA is off") as caught:
        _fit(model, x, y, jit_compile=jit_compile)
    message = str(caught[0].message)
    assert "'no_jit_here' (NoJit) has supports_jit=False" in message
    assert f"jit_compile={jit_compile!r}" in message
    assert model.jit_compile is False
    assert "no_jit_here" in model.xla_blocked_reason
    if jit_compile == "measure":
        assert model.jit_measurement.jit_compile is False
        assert "no_jit_here" in model.jit_measurement.reason


def test_blockers_agree_with_keras():
    assert hooks.jit_blockers(small_model()) == []
    model = _model_with(NoJit(name="a"))
    assert hooks.keras_supports_jit(model) is False
    assert hooks.jit_blockers(model) == ["layer 'a' (NoJit) has supports_jit=False"]


def test_auto_and_false_do_not_warn():
    for value in ("auto", False):
        model = _model_with(NoJit())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.compile(optimizer="sgd", loss="mse", jit_compile=value)


class HostOp(keras.layers.Layer):
    """Adds 0 * (a NumPy round trip): an op XLA has no kernel for, while the
    gradient flows through `x`."""

    def call(self, x):
        copy = tf.numpy_function(lambda a: a, [x], tf.float32, stateful=False)
        copy.set_shape(x.shape)
        return x + 0.0 * copy


def test_an_op_without_xla_kernel_raises_a_clear_error_with_jit_true(regression_data):
    x, y = regression_data
    model = _model_with(HostOp(name="host_op"))
    with pytest.raises(jit_measure.XLAUnsupportedOpError) as info:
        _fit(model, x, y, jit_compile=True)
    message = str(info.value)
    assert "op PyFuncStateless" in message
    assert "layer 'host_op'" in message
    assert "jit_compile=False" in message and '"measure"' in message
    assert isinstance(info.value.__cause__, tf.errors.InvalidArgumentError)


@pytest.mark.parametrize("compile_kwargs", [{}, {"accumulate_steps": 2}])
def test_measure_falls_back_without_losing_the_batch(regression_data, capsys, compile_kwargs):
    x, y = regression_data
    measured = _model_with(HostOp(name="host_op"))
    plain = _model_with(HostOp(name="host_op"))
    _fit(measured, x, y, jit_compile="measure", **compile_kwargs)
    _fit(plain, x, y, jit_compile=False, **compile_kwargs)
    measurement = measured.jit_measurement
    assert measurement.jit_compile is False and measurement.xla_ms is None
    assert "op PyFuncStateless" in measurement.reason
    assert "layer 'host_op'" in measurement.reason
    assert measured.xla_blocked_reason == measurement.reason
    assert measured.jit_compile is False
    assert "no XLA; XLA cannot compile the step" in capsys.readouterr().out
    # The batch of the failed XLA call was trained on, without XLA, once.
    assert int(measured.optimizer.iterations) == int(plain.optimizer.iterations)
    assert max_weight_diff(measured, plain) == 0.0


def test_a_nan_watcher_measuring_fit_leaves_no_guarded_function_behind():
    # The watcher's guarded measuring function decides; after the fit the
    # model's own train function (its choice) runs, not the guarded one.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    model = GradBoostModel(inputs, keras.layers.Dense(3)(keras.layers.Dense(8)(inputs)))
    model.compile(optimizer="sgd", loss="mse", jit_compile="measure")
    x = np.random.default_rng(0).normal(size=(160, 5)).astype("float32")
    y = np.zeros((160, 3), "float32")
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=[NaNWatcher(action="skip", verbose=0)])
    assert model.jit_measurement is not None and "nonfinite_steps" in history.history
    history = model.fit(x, y, batch_size=8, verbose=0)
    assert "nonfinite_steps" not in history.history
    assert not isinstance(wrappers.base_train_function(model), jit_measure.MeasuringTrainFunction)
