"""`compile(precision="measure")`: the schedule and decision with a fake
clock, the plan (candidates, loss scale, what blocks measuring), and real
fits whose alternated steps equal an independent replay by a plain Keras
model taking the same policy at each step (every measured call is a real
step), with accumulation, a NaNWatcher and save/load."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost import PrecisionMeasurement
from keras_gradboost import precision_measure
from keras_gradboost import measure_schedule
from keras_gradboost import wrappers
from keras_gradboost.callbacks import BackupAndRestore
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.config import GradBoostConfig
from keras_gradboost.plan import Devices
from keras_gradboost.plan import TrainPlan

from conftest import InterruptAt
from conftest import shared_mirrored_strategy
from conftest import small_model

F32, BF16 = "float32", "mixed_bfloat16"
CPU = Devices(on_gpu=False, cpu_bf16=True)
GPU = Devices(on_gpu=True, cpu_bf16=False)
BATCH, LR = 8, 0.1
# The replay and the fit may round a few float32 ulps apart. A step taken
# in the other precision moves the weights by 1e-4 or more.
REPLAY_TOLERANCE = 2e-6


# ------------------------------------------------------------- the Measurer


def _run(measurer, ms):
    """Feeds `measurer` `ms[policy]` per call until it decides; the
    policies of the calls, in order."""
    seen = []
    while measurer.result is None:
        policy, timed = measurer.next_call()
        seen.append((policy, timed))
        measurer.record(ms[policy] / 1000 if timed else 5.0)  # slow traces
    return seen


def test_schedule_warms_up_then_interleaves_whole_units():
    measurer = precision_measure.Measurer((F32, BF16), warmup_calls=1, timed_calls=2)
    assert _run(measurer, {F32: 1, BF16: 1}) == [
        (F32, False), (BF16, False), (F32, True), (BF16, True), (F32, True), (BF16, True)
    ]
    measurer = precision_measure.Measurer(
        (F32, BF16), warmup_calls=1, timed_calls=1, calls_per_timing=2
    )
    assert [p for p, _ in _run(measurer, {F32: 1, BF16: 1})] == [F32, F32, BF16, BF16, F32, F32, BF16, BF16]
    # Medians are per call: a unit of 2 calls of 3 ms each is 3 ms.
    measurer = precision_measure.Measurer((F32, BF16), calls_per_timing=2)
    _run(measurer, {F32: 3.0, BF16: 2.0})
    assert measurer.result.float32_ms == pytest.approx(3.0)
    assert measurer.result.calls_per_timing == 2
    assert "whole accumulation windows" in measurer.result.message()


@pytest.mark.parametrize(
    "f32_ms, mixed_ms, expected", [(1.0, 3.0, F32), (3.0, 1.0, BF16), (2.0, 2.0, F32)]
)
def test_lower_median_wins_a_tie_keeps_float32(f32_ms, mixed_ms, expected):
    measurer = precision_measure.Measurer((F32, BF16))
    ms = {F32: f32_ms, BF16: mixed_ms}
    outlier = {F32: True, BF16: True}
    while measurer.result is None:
        policy, timed = measurer.next_call()
        value = ms[policy] if timed else 900.0
        if timed and outlier[policy]:  # one outlier per candidate
            value, outlier[policy] = 1000.0, False
        measurer.record(value / 1000)
    result = measurer.result
    assert isinstance(result, PrecisionMeasurement) and result.measured
    assert result.policy == expected and result.mixed_policy == BF16
    assert (result.float32_ms, result.mixed_ms) == pytest.approx((f32_ms, mixed_ms))
    assert result.timed_calls == precision_measure.TIMED_CALLS
    assert result.message("measure").startswith(f'precision="measure": {expected};')
    message = result.message()
    assert message.startswith(f'precision="auto": {expected};')
    assert f"{min(f32_ms, mixed_ms):.2f} ms" in message and f"{max(f32_ms, mixed_ms):.2f} ms" in message


@pytest.mark.parametrize("name", ["warmup_calls", "timed_calls", "calls_per_timing"])
@pytest.mark.parametrize("value", [0, 1.5, True])
def test_measurer_rejects_bad_counts(name, value):
    with pytest.raises(ValueError, match=f"`{name}`. Received: {name}={value!r}. Expected an int >= 1"):
        precision_measure.Measurer((F32, BF16), **{name: value})


@pytest.mark.parametrize("candidates", [(BF16, F32), (F32,), (F32, F32)])
def test_measurer_rejects_bad_candidates(candidates):
    with pytest.raises(ValueError, match="Invalid value for argument `candidates`. Received"):
        precision_measure.Measurer(candidates)


@pytest.mark.parametrize(
    "accumulate, per_call, expected", [(1, 1, 1), (1, 4, 1), (2, 1, 2), (2, 3, 2), (4, 2, 2), (3, 3, 1)]
)
def test_calls_per_timing_holds_whole_windows(accumulate, per_call, expected):
    calls = measure_schedule.calls_per_timing(accumulate, per_call)
    assert calls == expected and (calls * per_call) % accumulate == 0


# -------------------------------------------------------------- the plan


def _plan(devices=CPU, keras_kwargs=None, precision="measure", **gradboost):
    kwargs = {"optimizer": "sgd", "loss": "mse", **(keras_kwargs or {})}
    return TrainPlan.build(
        GradBoostConfig(precision=precision, **gradboost), small_model(GradBoostModel), kwargs, devices
    )


@pytest.mark.parametrize("precision", ["auto", "measure"])
def test_plan_candidates_and_loss_scale_per_device(precision):
    cpu = _plan(CPU, precision=precision)
    assert cpu.precision_candidates == (F32, BF16)
    assert cpu.policy == BF16  # the static rule's pick, until measured
    assert cpu.loss_scale is None and cpu.precision_blocked is None
    gpu = _plan(GPU, precision=precision)
    assert gpu.precision_candidates == (F32, "mixed_float16")
    assert gpu.loss_scale == (True, 2.0**15)  # float16 is a candidate
    assert _plan(GPU, loss_scale=None, precision=precision).loss_scale is None
    assert _plan(CPU, loss_scale="dynamic", precision=precision).loss_scale[0] is True


def test_jit_measure_too_is_refused_naming_both():
    with pytest.raises(ValueError) as info:
        _plan(keras_kwargs={"jit_compile": "measure"})
    message = str(info.value)
    assert 'jit_compile="measure"' in message and 'precision="measure"' in message
    assert "Set only one" in message


def test_auto_under_jit_measure_keeps_the_static_pick_and_says_so():
    # precision="auto" asks for the faster policy, not for a measurement:
    # beside jit_compile="measure" it keeps its static rule's pick.
    plan = _plan(keras_kwargs={"jit_compile": "measure"}, precision="auto")
    assert plan.policy == BF16 and 'jit_compile="measure"' in plan.precision_blocked
    (note,) = [w for w in plan.warnings if "cannot measure" in w]
    assert note.startswith('precision="auto", but it cannot measure: jit_compile="measure"')
    assert "The model trains in mixed_bfloat16, the static rule's pick" in note


def test_a_bad_precision_names_measure():
    with pytest.raises(ValueError) as info:
        GradBoostConfig(precision="measured")
    message = str(info.value)
    assert "Invalid value for argument `precision`. Received: precision='measured'" in message
    assert '"measure"' in message


@pytest.mark.parametrize("precision", ["auto", "measure"])
def test_run_eagerly_keeps_the_static_pick_and_says_so(regression_data, precision):
    x, y = regression_data
    model = small_model(GradBoostModel)
    with pytest.warns(UserWarning, match=f'precision="{precision}", but it cannot measure: run_eagerly=True'):
        model.compile(optimizer="sgd", loss="mse", precision=precision, run_eagerly=True)
    measurement = model.precision_measurement
    assert not measurement.measured and "run_eagerly=True" in measurement.reason
    assert measurement.policy == model.train_plan.policy == model.dtype_policy_applied
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    assert model.precision_measurement is measurement


# ------------------------------------------- real fits with a fake clock


class FakeClock:
    """Each train call takes `ms[policy]`, the policy the measuring function
    is about to time (read at the call's second tick)."""

    def __init__(self, model, ms):
        self.model, self.ms = model, ms
        self.now, self.ticks = 0.0, 0

    def __call__(self):
        self.ticks += 1
        if self.ticks % 2 == 0:
            measuring = wrappers.base_train_function(self.model)
            policy, _ = measuring.measurer.next_call()
            self.now += self.ms[policy] / 1000
        return self.now


def _sequence(winner, calls, unit=1):
    """The policy of each call: the schedule, then the winner."""
    units = [F32, BF16] * (precision_measure.WARMUP_CALLS + precision_measure.TIMED_CALLS)
    measured = [p for p in units for _ in range(unit)]
    return (measured + [winner] * calls)[:calls]


def _replay(policies, x, y, accumulate_steps=1, batch=BATCH, replicas=1, epochs=1):
    """An independent computation: a plain Keras model (same initial
    weights), the hidden layer set to each step's policy (the output layer
    stays float32, as `apply_policy` keeps it), SGD by hand, the accumulated
    gradient weighted by sample count, a short window applied at each
    epoch's end (`policies` holds `epochs` epochs of equally many steps).
    Each policy's gradient is one `tf.function` traced under it (bfloat16
    rounds differently eagerly, where no op is fused). With `replicas`,
    each batch is split as a MirroredStrategy splits it, and the parts'
    gradients averaged (bfloat16 rounds a sum over 4 rows differently than
    over 8)."""
    model = small_model(keras.Model, regularize=False)
    hidden = model.get_layer("hidden")
    variables = model.trainable_variables

    def gradients(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(yb, model(xb, training=True)))
        return tape.gradient(loss, variables)

    functions = {}
    acc, count = None, 0
    per_epoch = len(policies) // epochs
    for index, policy in enumerate(policies):
        step = index % per_epoch
        xb, yb = x[step * batch : (step + 1) * batch], y[step * batch : (step + 1) * batch]
        hidden.dtype_policy = policy
        function = functions.setdefault(policy, tf.function(gradients))
        part = len(xb) // replicas
        parts = [
            function(tf.constant(xb[r * part : (r + 1) * part]), tf.constant(yb[r * part : (r + 1) * part]))
            for r in range(replicas)
        ]
        grads = [sum(g / replicas for g in gs) for gs in zip(*parts)]
        n = len(xb)
        acc = [n * g for g in grads] if acc is None else [a + n * g for a, g in zip(acc, grads)]
        count += n
        if (step + 1) % accumulate_steps == 0 or step == per_epoch - 1:
            for v, a in zip(variables, acc):
                v.assign(v - LR * a / count)
            acc, count = None, 0
    return model


def _weights_diff(model, other):
    return max(
        float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), other.get_weights())
    )


def _measured_fit(x, y, ms, monkeypatch, callbacks=None, batch=BATCH, epochs=1,
                  precision="measure", **compile_kwargs):
    model = small_model(GradBoostModel, regularize=False)
    monkeypatch.setattr(precision_measure, "perf_counter", FakeClock(model, ms))
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", precision=precision, **compile_kwargs)
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return model


@pytest.mark.parametrize("precision", ["auto", "measure"])
@pytest.mark.parametrize("ms, winner", [({F32: 2.0, BF16: 9.0}, F32), ({F32: 9.0, BF16: 2.0}, BF16)])
def test_measured_fit_equals_the_replay_of_its_policies(regression_data, monkeypatch, capsys, ms, winner,
                                                        precision):
    x, y = regression_data
    steps = len(x) // BATCH
    model = _measured_fit(x, y, ms, monkeypatch, precision=precision)
    measurement = model.precision_measurement
    assert measurement.policy == winner
    assert (measurement.float32_ms, measurement.mixed_ms) == pytest.approx((ms[F32], ms[BF16]))
    out = capsys.readouterr().out
    assert out.count(f'precision="{precision}"') == 1 and f'"{precision}": {winner};' in out
    # Every measured call was a real step, in its candidate's precision.
    assert int(model.optimizer.iterations) == steps
    policies = _sequence(winner, steps)
    assert _weights_diff(model, _replay(policies, x, y)) < REPLAY_TOLERANCE
    assert _weights_diff(model, _replay([winner] * steps, x, y)) > 20 * REPLAY_TOLERANCE
    # The layers hold the winner's policy: evaluate and predict use it.
    assert model.dtype_policy_applied == winner
    assert model.get_layer("hidden").dtype_policy.name == winner
    assert model.get_layer("out").compute_dtype == "float32"
    assert model.float32_layers == (["out"] if winner == BF16 else [])
    hidden = keras.Model(model.inputs[0], model.get_layer("hidden").output)
    assert keras.backend.standardize_dtype(hidden(x[:2]).dtype) == ("bfloat16" if winner == BF16 else F32)
    assert not isinstance(model.train_function, precision_measure.MeasuringTrainFunction)
    # The next fit keeps the choice, and measures nothing.
    model.fit(x[:16], y[:16], batch_size=BATCH, verbose=0)
    assert model.precision_measurement is measurement
    assert f'precision="{precision}"' not in capsys.readouterr().out


def test_accumulation_times_whole_windows_and_shares_them(regression_data, monkeypatch):
    # 26 micro-batches of 4, windows of 2: each timing is one window (2
    # calls) in one precision, 16 calls measured, then 10 in the winner's.
    x, y = regression_data
    steps = len(x) // 4
    model = _measured_fit(x, y, {F32: 9.0, BF16: 2.0}, monkeypatch, batch=4, accumulate_steps=2)
    assert model.precision_measurement.calls_per_timing == 2
    assert int(model.optimizer.iterations) == steps // 2
    policies = _sequence(BF16, steps, unit=2)
    replay = _replay(policies, x, y, accumulate_steps=2, batch=4)
    assert _weights_diff(model, replay) < REPLAY_TOLERANCE


def test_a_timing_that_ends_an_epoch_mid_window_goes_on_to_the_windows_end(
    regression_data, monkeypatch
):
    # 13 batches of 8 per epoch, windows of 2: the 7th timing (float32)
    # starts with the epoch's last batch, a partial window (flushed), and
    # goes on into the next epoch until its first window closes. Before, a
    # timing was 2 calls: that window ran its first batch in float32, its
    # second in bfloat16.
    x, y = regression_data
    model = _measured_fit(
        x, y, {F32: 9.0, BF16: 2.0}, monkeypatch, epochs=2, accumulate_steps=2
    )
    assert model.precision_measurement.policy == BF16
    first = [F32, F32, BF16, BF16] * 3 + [F32]
    second = [F32, F32] + [BF16] * 11
    replay = _replay(first + second, x, y, accumulate_steps=2, epochs=2)
    assert _weights_diff(model, replay) < REPLAY_TOLERANCE
    unit_of_two = first + [F32] + [BF16] * 12
    assert _weights_diff(model, _replay(unit_of_two, x, y, accumulate_steps=2, epochs=2)) > (
        20 * REPLAY_TOLERANCE
    )


def test_epochs_shorter_than_a_window_time_whole_flushed_windows(regression_data, monkeypatch):
    # 2 batches of 8 per epoch, windows of 4: no call closes a window, each
    # epoch's end flushes a partial one. A timing (4 calls) ends at every
    # second epoch's end: 8 timings in 16 epochs, decided at the last one's
    # end, each epoch's window in one policy. (A timing that ended only
    # after a call closing a window never ended here.)
    x, y = regression_data
    model = _measured_fit(
        x[:16], y[:16], {F32: 9.0, BF16: 2.0}, monkeypatch, epochs=17, accumulate_steps=4
    )
    assert model.precision_measurement.policy == BF16
    policies = [F32] * 4 + [BF16] * 4
    replay = _replay(policies * 4 + [BF16] * 2, x, y, accumulate_steps=4, epochs=17)
    assert _weights_diff(model, replay) < REPLAY_TOLERANCE


def test_steps_per_execution_and_a_short_last_chunk(regression_data, monkeypatch):
    # steps_per_execution=2, accumulate_steps=3: a timing is 3 calls (6
    # micro-batches, two whole windows). 13 batches make 7 calls: 3 in
    # float32, 3 in bfloat16, then a last call of 1 batch, in float32, that
    # traces the float32 function again (a new chunk length) under its own
    # policy; the epoch end flushes it. Not decided yet after 7 calls.
    x, y = regression_data
    model = _measured_fit(
        x, y, {F32: 2.0, BF16: 9.0}, monkeypatch, accumulate_steps=3, steps_per_execution=2
    )
    assert model.precision_measurement is None
    measuring = wrappers.base_train_function(model)
    assert measuring.measurer.calls_per_timing == 3
    policies = [F32] * 6 + [BF16] * 6 + [F32]
    assert _weights_diff(model, _replay(policies, x, y, accumulate_steps=3)) < REPLAY_TOLERANCE
    assert _weights_diff(model, _replay([F32] * 13, x, y, accumulate_steps=3)) > 20 * REPLAY_TOLERANCE


def test_with_a_nan_watcher_the_guarded_candidates_alternate(regression_data, monkeypatch):
    x, y = regression_data
    steps = len(x) // BATCH
    model = _measured_fit(
        x, y, {F32: 9.0, BF16: 2.0}, monkeypatch, callbacks=[NaNWatcher(action="skip", verbose=0)]
    )
    assert model.precision_measurement.policy == BF16
    assert _weights_diff(model, _replay(_sequence(BF16, steps), x, y)) < REPLAY_TOLERANCE
    history = model.fit(x[:16], y[:16], batch_size=BATCH, verbose=0)
    assert "nonfinite_steps" not in history.history  # no guarded function left
    base = wrappers.base_train_function(model)
    assert not isinstance(base, precision_measure.MeasuringTrainFunction)


def test_too_few_calls_stay_undecided_and_the_next_fit_goes_on(regression_data):
    x, y = regression_data
    model = small_model(GradBoostModel)
    model.compile(optimizer="sgd", loss="mse", precision="measure")
    calls = 2 * (precision_measure.WARMUP_CALLS + precision_measure.TIMED_CALLS)
    model.fit(x[: BATCH * (calls - 1)], y[: BATCH * (calls - 1)], batch_size=BATCH, verbose=0)
    assert model.precision_measurement is None
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
    assert model.precision_measurement.policy in (F32, BF16)
    assert model.dtype_policy_applied == model.precision_measurement.policy


def test_save_and_load_keep_measure_and_its_decision(regression_data, monkeypatch, tmp_path, capsys):
    x, y = regression_data
    model = _measured_fit(x, y, {F32: 9.0, BF16: 2.0}, monkeypatch)
    assert model.get_compile_config()["gradboost"]["precision"] == "measure"
    path = str(tmp_path / "m.keras")
    model.save(path)
    capsys.readouterr()
    loaded = keras.saving.load_model(path)
    assert loaded.gradboost_config.precision == "measure"
    _kept_without_measuring(loaded, model.precision_measurement, monkeypatch, capsys)
    loaded.fit(x, y, batch_size=BATCH, verbose=0)
    assert loaded.precision_measurement.restored


# --------------------------------------------- the decision in checkpoints

MS = {F32: 9.0, BF16: 2.0}  # the fake clock: bfloat16 wins


def _no_clock():
    raise AssertionError("measured although the decision was loaded")


def _kept_without_measuring(model, saved, monkeypatch, capsys):
    """`model` holds the `saved` decision, restored, and will not time."""
    monkeypatch.setattr(precision_measure, "perf_counter", _no_clock)
    measurement = model.precision_measurement
    assert measurement.restored and measurement.measured
    assert (measurement.policy, measurement.float32_ms, measurement.mixed_ms, measurement.reason) == (
        saved.policy, saved.float32_ms, saved.mixed_ms, saved.reason
    )
    assert model.dtype_policy_applied == saved.policy
    assert model.get_layer("hidden").dtype_policy.name == saved.policy
    out = capsys.readouterr().out
    precision = model.gradboost_config.precision
    assert f'precision="{precision}": {saved.policy};' in out and "restored with the weights" in out


def _fresh(precision="measure", **compile_kwargs):
    model = small_model(GradBoostModel, regularize=False, seed=1)  # other weights: all loaded
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", precision=precision, **compile_kwargs)
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.parametrize("saved_with, loaded_with",
                         [("measure", "measure"), ("measure", "auto"), ("auto", "measure")])
def test_load_weights_after_the_decision_goes_on_exactly(regression_data, monkeypatch, tmp_path, capsys,
                                                         saved_with, loaded_with):
    """Saved after epoch 0 (decided at its 8th call), loaded into a new
    model: epoch 1 runs in the saved choice, unmeasured, and ends with the
    weights of a fit that never stopped (the same traced step: exactly).
    A decision of `"measure"` and one of `"auto"` are the same."""
    x, y = regression_data
    never = _measured_fit(x, y, MS, monkeypatch, epochs=2)
    stopped = _measured_fit(x, y, MS, monkeypatch, precision=saved_with)
    path = str(tmp_path / "w.weights.h5")
    stopped.save_weights(path)
    capsys.readouterr()
    resumed = _fresh(precision=loaded_with)
    resumed.load_weights(path)
    _kept_without_measuring(resumed, stopped.precision_measurement, monkeypatch, capsys)
    resumed.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert int(resumed.optimizer.iterations) == int(never.optimizer.iterations)
    assert _weights_diff(resumed, never) == 0.0
    # Loaded before compile(): put back by it.
    early = small_model(GradBoostModel, regularize=False, seed=1)
    early.load_weights(path)
    early.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", precision="measure")
    _kept_without_measuring(early, stopped.precision_measurement, monkeypatch, capsys)


def _backup_run(x, y, monkeypatch, tmp_path, save_freq, stop_at, **compile_kwargs):
    """An uninterrupted 2-epoch fit, and one interrupted at `stop_at` and
    resumed by a new model from its BackupAndRestore backup."""
    never = _measured_fit(x, y, MS, monkeypatch, epochs=2, **compile_kwargs)
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _measured_fit(x, y, MS, monkeypatch, epochs=2, callbacks=[
            BackupAndRestore(backup_dir, save_freq=save_freq), InterruptAt(*stop_at)
        ], **compile_kwargs)
    resumed = _fresh(**compile_kwargs)
    return never, resumed, backup_dir


def test_a_backup_after_the_decision_resumes_without_measuring(regression_data, monkeypatch, tmp_path, capsys):
    # 13 batches an epoch; decided at batch 7 of epoch 0; backups every 4
    # batches, the last at batch 2 of epoch 1 (16 batches), stopped at 6.
    x, y = regression_data
    never, resumed, backup_dir = _backup_run(x, y, monkeypatch, tmp_path, 4, (1, 6))
    capsys.readouterr()
    monkeypatch.setattr(precision_measure, "perf_counter", _no_clock)
    resumed.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                callbacks=[BackupAndRestore(backup_dir, save_freq=4)])
    _kept_without_measuring(resumed, never.precision_measurement, monkeypatch, capsys)
    assert int(resumed.optimizer.iterations) == int(never.optimizer.iterations)
    assert _weights_diff(resumed, never) == 0.0


@pytest.mark.parametrize("accumulate_steps, save_freq, stop_at", [(1, 3, (0, 4)), (2, 5, (0, 8))])
def test_a_backup_while_measuring_goes_on_with_the_schedule(
    regression_data, monkeypatch, tmp_path, accumulate_steps, save_freq, stop_at
):
    """Saved after 3 calls (warm-ups and float32's first timing done), or,
    accumulating 2, after 5 calls (the second unit of two calls half done:
    mid-window): the resumed model takes the same policy at every call as
    the uninterrupted fit, decides the same, and ends with its weights. Its
    first call of each candidate traces, so that unit's timing is left out
    of the median."""
    x, y = regression_data
    never, resumed, backup_dir = _backup_run(
        x, y, monkeypatch, tmp_path, save_freq, stop_at, accumulate_steps=accumulate_steps
    )
    monkeypatch.setattr(precision_measure, "perf_counter", FakeClock(resumed, MS))
    resumed.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                callbacks=[BackupAndRestore(backup_dir, save_freq=save_freq)])
    measurement, expected = resumed.precision_measurement, never.precision_measurement
    assert measurement.policy == expected.policy == BF16 and not measurement.restored
    assert (measurement.float32_ms, measurement.mixed_ms) == pytest.approx((9.0, 2.0))
    assert "timing(s) left out: they traced in a function made anew" in measurement.reason
    measurer = resumed._gradboost.precision_measurer
    assert sum(measurer.dropped.values()) >= 1
    assert int(resumed.optimizer.iterations) == int(never.optimizer.iterations)
    assert _weights_diff(resumed, never) == 0.0


def test_progress_of_another_schedule_measures_again_and_says_so(regression_data, monkeypatch, tmp_path):
    x, y = regression_data
    model = small_model(GradBoostModel, regularize=False)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", precision="measure")
    model.fit(x[:3 * BATCH], y[:3 * BATCH], batch_size=BATCH, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    other = _fresh(accumulate_steps=2)
    with pytest.warns(UserWarning, match=r"measuring progress \(3 of 8 timings done, 0 call\(s\) into the next\).*another schedule.*\(1, 3, 1\).*\(1, 3, 2\).*"
                                         r"measures again from the start.*not an exact resume"):
        other.load_weights(path)
    assert other._gradboost.precision_measurer.started is False


def test_a_decision_among_other_candidates_is_not_adopted(regression_data, monkeypatch, tmp_path):
    x, y = regression_data
    path = str(tmp_path / "w.weights.h5")
    _measured_fit(x, y, MS, monkeypatch).save_weights(path)
    # As on a GPU: float32 against mixed_float16.
    from keras_gradboost import precision as precision_lib

    monkeypatch.setattr(precision_lib, "measure_candidates", lambda on_gpu: (F32, "mixed_float16"))
    gpu = _fresh()
    with pytest.warns(UserWarning) as caught:
        gpu.load_weights(path)
    (message,) = [str(w.message) for w in caught if "candidates" in str(w.message)]
    assert "('float32', 'mixed_bfloat16')" in message and "('float32', 'mixed_float16')" in message
    assert "not adopted, this model measures again" in message
    assert gpu.precision_measurement is None


def test_files_without_a_decision_and_models_without_measure(regression_data, monkeypatch, tmp_path):
    x, y = regression_data
    plain = small_model(GradBoostModel, regularize=False)
    plain.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", precision="float32")
    plain.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
    path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(path)
    measuring = _fresh()
    measuring.load_weights(path)  # as before: nothing to adopt, it measures
    assert measuring.precision_measurement is None
    decided = str(tmp_path / "decided.weights.h5")
    _measured_fit(x, y, MS, monkeypatch).save_weights(decided)
    same = small_model(GradBoostModel, regularize=False)
    same.compile(optimizer="sgd", loss="mse", precision=BF16)
    same.optimizer.build(same.trainable_variables)
    same.load_weights(decided)  # compiled with the policy it chose: silent
    other = small_model(GradBoostModel, regularize=False)
    other.compile(optimizer="sgd", loss="mse", precision="float32")
    other.optimizer.build(other.trainable_variables)
    with pytest.warns(UserWarning, match=r"cannot take: a measured precision decision "
                                         r"\(mixed_bfloat16\) \(this model is compiled with "
                                         r"precision='float32'\)"):
        other.load_weights(decided)
    assert other.dtype_policy_applied == F32


def test_a_file_saved_before_measuring_starts_the_schedule_again(regression_data, monkeypatch,
                                                                 tmp_path):
    # A model part way through measuring (3 calls) loads weights saved
    # before any measuring (no record): it measures from the schedule's
    # first unit, as a new model loading them would, and equals the replay
    # of that schedule. Before, it went on from its fourth unit.
    x, y = regression_data
    path = str(tmp_path / "start.weights.h5")
    start = small_model(GradBoostModel, regularize=False)
    start.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", precision="measure")
    start.save_weights(path)
    part_way = _measured_fit(x[: 3 * BATCH], y[: 3 * BATCH], {F32: 9.0, BF16: 2.0}, monkeypatch)
    assert wrappers.base_train_function(part_way).measurer.started
    part_way.load_weights(path)
    monkeypatch.setattr(precision_measure, "perf_counter", FakeClock(part_way, {F32: 9.0, BF16: 2.0}))
    part_way.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    steps = len(x) // BATCH
    assert part_way.precision_measurement.policy == BF16
    assert _weights_diff(part_way, _replay(_sequence(BF16, steps), x, y)) < REPLAY_TOLERANCE


def test_mirrored_strategy_measures_and_equals_the_replay(regression_data, monkeypatch):
    x, y = regression_data
    steps = len(x) // BATCH
    with shared_mirrored_strategy().scope():
        model = small_model(GradBoostModel, regularize=False)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", precision="measure")
    monkeypatch.setattr(precision_measure, "perf_counter", FakeClock(model, {F32: 9.0, BF16: 2.0}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strategy's own notices
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert model.precision_measurement.policy == BF16
    assert _weights_diff(model, _replay(_sequence(BF16, steps), x, y, replicas=2)) < REPLAY_TOLERANCE
