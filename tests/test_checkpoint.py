"""The loss scale, skip counters and a pending accumulation window survive
save/load: save mid-window -> load -> continue equals never saving."""

import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import SaveAfterBatch
from conftest import max_weight_diff
from conftest import shared_mirrored_strategy
from keras_gradboost import GradBoostModel
from keras_gradboost import boost

BATCH = 8
NAN_ROWS = (3, 20, 41)  # in batches 0, 2 and 5: three skipped steps


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 5)).astype("float32")
    y = rng.normal(size=(80, 3)).astype("float32")
    x[list(NAN_ROWS)] = np.nan
    return x, y


def _model(accumulate_steps, loss_scale="dynamic", compile=True):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    model = GradBoostModel(inputs, keras.layers.Dense(3, name="out")(hidden))
    if compile:
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss="mse",
            accumulate_steps=accumulate_steps,
            loss_scale=loss_scale,
        )
    return model


def _train(model, x, y, batches):
    for i in batches:
        model.train_on_batch(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])


def _state(model):
    facts = model.step_facts.read()
    scaler = model._gradboost.scaler
    return (
        None if scaler is None else float(scaler.scale.numpy()),
        facts["skipped_steps"],
        facts["checked_steps"],
        int(model.optimizer.iterations.numpy()),
    )


def _save(model, path, form):
    if form == "keras":
        model.save(path + ".keras")
        return path + ".keras"
    model.save_weights(path + ".weights.h5")
    return path + ".weights.h5"


def _load(path, form, accumulate_steps):
    if form == "keras":
        return keras.models.load_model(path)
    model = _model(accumulate_steps)
    model.optimizer.build(model.trainable_variables)  # else Keras skips its state
    model.load_weights(path)
    return model


@pytest.mark.parametrize("form", ["weights", "keras"])
@pytest.mark.parametrize("accumulate_steps", [1, 4])
def test_save_mid_window_load_and_continue_equals_never_saving(tmp_path, form, accumulate_steps):
    x, y = _data()
    never_saved = _model(accumulate_steps)
    _train(never_saved, x, y, range(10))

    model = _model(accumulate_steps)
    _train(model, x, y, range(6))  # k=4: one update and 2 micro-batches pending
    scale_at_save = _state(model)[0]
    assert scale_at_save == 2.0**15 / 8  # three overflows halved it
    path = _save(model, str(tmp_path / "mid"), form)
    loaded = _load(path, form, accumulate_steps)
    assert _state(loaded)[:3] == _state(model)[:3]
    if accumulate_steps > 1:
        assert int(loaded._gradboost.accumulator.micro_step.numpy()) == 2
    _train(loaded, x, y, range(6, 10))
    assert _state(loaded) == _state(never_saved)
    assert max_weight_diff(loaded, never_saved) == 0.0


def test_state_loaded_before_compile_is_put_back_by_compile(tmp_path):
    x, y = _data()
    never_saved = _model(4)
    _train(never_saved, x, y, range(10))
    model = _model(4)
    _train(model, x, y, range(6))
    path = _save(model, str(tmp_path / "mid"), "weights")
    loaded = _model(4, compile=False)
    loaded.load_weights(path)
    loaded.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", accumulate_steps=4, loss_scale="dynamic")
    assert _state(loaded)[:3] == _state(model)[:3]
    loaded.optimizer.build(loaded.trainable_variables)
    for variable, value in zip(loaded.optimizer.variables, model.optimizer.variables):
        variable.assign(value)  # Keras cannot load an optimizer before compile
    _train(loaded, x, y, range(6, 10))
    assert _state(loaded) == _state(never_saved)
    assert max_weight_diff(loaded, never_saved) == 0.0


def _mirrored():
    return shared_mirrored_strategy()


def test_a_window_saved_under_mirrored_strategy_loads_on_one_device(tmp_path):
    # Each replica holds its part of the window's sums; their sum is saved.
    x, y = _data()
    x = np.nan_to_num(x)  # NaN-free: the replicas' halves differ otherwise
    single = _model(4, loss_scale=None)
    _train(single, x, y, range(10))
    path = str(tmp_path / "mirrored.weights.h5")
    with _mirrored().scope():
        mirrored = _model(4, loss_scale=None)
    mirrored.fit(
        x[: 6 * BATCH], y[: 6 * BATCH], batch_size=BATCH, shuffle=False, verbose=0,
        callbacks=[SaveAfterBatch(5, path)],  # mid-window, before the epoch's flush
    )
    loaded = _model(4, loss_scale=None)
    loaded.optimizer.build(loaded.trainable_variables)
    with pytest.warns(UserWarning, match="saved with 2 replicas and goes on with 1: exact when `fit`"):
        loaded.load_weights(path)
    assert int(loaded._gradboost.accumulator.micro_step.numpy()) == 2
    _train(loaded, x, y, range(6, 10))
    assert int(loaded.optimizer.iterations.numpy()) == 2
    assert max_weight_diff(loaded, single) < 2e-6


def test_a_plain_keras_model_loads_the_weights_of_a_boosted_one(tmp_path):
    x, y = _data()
    model = _model(4)
    _train(model, x, y, range(6))
    path = _save(model, str(tmp_path / "boosted"), "weights")
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    plain = keras.Model(inputs, keras.layers.Dense(3, name="out")(hidden))
    plain.load_weights(path)
    assert max_weight_diff(plain, model) == 0.0


def test_state_the_model_cannot_take_is_named_in_a_warning(tmp_path):
    x, y = _data()
    model = _model(4)
    _train(model, x, y, range(6))
    path = _save(model, str(tmp_path / "scaled"), "weights")
    other = _model(1, loss_scale=None)
    with pytest.warns(UserWarning) as caught:
        other.load_weights(path)
    message = " ".join(str(w.message) for w in caught)
    assert "the loss scale 4096 (loss scaling is off)" in message
    assert "2 accumulated micro-batches (accumulate_steps=1)" in message


class _InterruptAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("accumulate_steps", [1, 4])
def test_backup_and_restore_keeps_the_loss_scale_and_counters(tmp_path, accumulate_steps):
    x, y = _data()
    never = _model(accumulate_steps)
    never.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    model = _model(accumulate_steps)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(
            x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
            callbacks=[backup, _InterruptAtEpoch(2)],
        )
    restarted = _model(accumulate_steps)
    restarted.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[backup])
    # The skips of the first two epochs are not repeated: the scale came back.
    assert _state(restarted) == _state(never)
    assert _state(never)[1] == 9  # three skipped steps an epoch
    assert max_weight_diff(restarted, never) == 0.0
    assert os.path.exists(str(tmp_path / "backup")) is False  # done: deleted


def test_fit_goes_on_with_a_window_loaded_mid_way(tmp_path):
    x, y = _data()
    never_saved = _model(4)
    _train(never_saved, x, y, range(10))
    never_saved.flush_accumulated_gradients()  # what fit does at its epoch's end
    model = _model(4)
    _train(model, x, y, range(6))
    loaded = keras.models.load_model(_save(model, str(tmp_path / "mid"), "keras"))
    rows = slice(6 * BATCH, 10 * BATCH)
    loaded.fit(x[rows], y[rows], batch_size=BATCH, shuffle=False, verbose=0)
    # 2 loaded + 2 drawn micro-batches make the first update, 2 the flush.
    assert _state(loaded) == _state(never_saved)
    assert int(loaded.optimizer.iterations.numpy()) == 3
    assert max_weight_diff(loaded, never_saved) == 0.0


@pytest.mark.parametrize("loss_scale", [128.0, None])
def test_a_saved_dynamic_scale_never_overwrites_a_fixed_one(tmp_path, loss_scale):
    x, y = _data()
    model = _model(1)  # dynamic, brought down to 4096 by three overflows
    _train(model, x, y, range(6))
    path = _save(model, str(tmp_path / "dynamic"), "weights")
    fixed = _model(1, loss_scale=loss_scale)
    fixed.optimizer.build(fixed.trainable_variables)
    with pytest.warns(UserWarning, match="loss scale 4096 \\(") as caught:
        fixed.load_weights(path)
    message = " ".join(str(w.message) for w in caught)
    if loss_scale is None:
        assert "(loss scaling is off)" in message
    else:
        assert "the dynamic loss scale 4096 (this model's scale is fixed at 128)" in message
        assert float(fixed._gradboost.scaler.scale.numpy()) == 128.0


@pytest.mark.usefixtures("no_graph_rewrites")
def test_a_real_architecture_saved_mid_window_goes_on_as_if_never_saved(tmp_path):
    # keras.applications MobileNetV2 (BatchNormalization, depthwise convs)
    # through boost(): loss scale, skip counter and window survive `.keras`.
    def make():
        keras.utils.set_random_seed(0)
        base = keras.applications.MobileNetV2(
            weights=None, input_shape=(32, 32, 3), classes=4, alpha=0.35
        )
        model = boost(base)
        with pytest.warns(UserWarning, match="BatchNormalization layers"):
            model.compile(
                optimizer=keras.optimizers.SGD(0.01),
                loss="sparse_categorical_crossentropy",
                accumulate_steps=2,
                loss_scale="dynamic",
            )
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 4, 40)
    x[9] = np.nan  # batch 1 is skipped and halves the scale
    model = make()
    _train(model, x, y, range(3))  # one update, one micro-batch pending
    path = _save(model, str(tmp_path / "mobilenet"), "keras")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras' own notes while loading
        loaded = keras.models.load_model(path)
    # The reference: the saved model itself goes on, never reloaded (one
    # MobileNetV2 fewer to build and trace than a run from scratch).
    never_saved = model
    _train(never_saved, x, y, range(3, 5))
    _train(loaded, x, y, range(3, 5))
    assert _state(loaded) == _state(never_saved)
    assert _state(never_saved)[:2] == (2.0**14, 1)
    assert max_weight_diff(loaded, never_saved) == 0.0
