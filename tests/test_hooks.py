"""Each Keras internal used by keras_gradboost, checked against this Keras.

If one of these fails after a Keras upgrade, fix `keras_gradboost/hooks.py`:
it is the only module that touches Keras internals.
"""

import numpy as np
import tensorflow as tf

import keras
from keras_gradboost import hooks


def _model():
    inputs = keras.Input((3,))
    inner = keras.Sequential([keras.layers.Dense(4, name="inner_dense")], name="inner")
    outputs = keras.layers.Dense(2, name="head")(inner(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_flatten_layers_includes_nested_layers():
    names = [l.name for l in hooks.flatten_layers(_model(), include_self=False)]
    assert "inner_dense" in names and "head" in names and "inner" in names
    assert hooks.flatten_layers(_model())[0].__class__.__name__ == "Functional"


def test_loss_tracker_is_the_metric_behind_logs_loss():
    model = _model()
    tracker = hooks.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean)
    logs = model.train_on_batch(np.ones((2, 3)), np.ones((2, 2)), return_dict=True)
    np.testing.assert_allclose(float(tracker.result()), logs["loss"])


def test_compute_loss_wrapper():
    model = _model()
    y = np.ones((2, 2), "float32")
    loss = hooks.compute_loss(model, None, y, np.zeros((2, 2), "float32"), None)
    np.testing.assert_allclose(float(loss), 1.0)


def test_call_has_training_arg():
    class WithTraining(keras.Model):
        def call(self, x, training=False):
            return x

    class Without(keras.Model):
        def call(self, x):
            return x

    assert hooks.call_has_training_arg(WithTraining()) is True
    assert hooks.call_has_training_arg(Without()) is False


def test_functional_class_and_detection():
    model = _model()
    assert isinstance(model, hooks.functional_model_class())
    assert hooks.is_functional(model)
    assert not hooks.is_functional(keras.Sequential([keras.layers.Dense(1)]))

    class Sub(keras.Model):
        def call(self, x):
            return x

    assert not hooks.is_functional(Sub())
    assert hooks.functional_init_arguments((1, 2), {})
    assert hooks.functional_init_arguments((), {"inputs": 1, "outputs": 2})
    assert not hooks.functional_init_arguments((), {"name": "x"})


def test_check_runs_every_hook():
    assert hooks.check() is True


def test_hold_batches_keeps_the_last_chunk_and_undoes():
    import tensorflow as tf

    model = _model()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x = np.arange(12, dtype="float32").reshape(4, 3)
    y = np.zeros((4, 2), "float32")
    model.fit(x, y, batch_size=1, verbose=0)  # makes the train function
    original = model.train_function
    held, undo = hooks.hold_batches(model)
    ds = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(1))
    model.train_function(ds)
    assert len(held) == 2
    np.testing.assert_array_equal(held[1][0].numpy(), x[1:2])
    model.train_function(ds)
    np.testing.assert_array_equal(held[0][0].numpy(), x[2:3])
    try:
        model.train_function(ds)
        raise AssertionError("expected StopIteration at the end of the data")
    except StopIteration:
        pass
    undo()
    assert model.train_function is original


def test_fit_validation_flag():
    assert hooks.is_fit_validation({"_use_cached_eval_dataset": True})
    assert not hooks.is_fit_validation({})


def test_hold_batches_calls_before_and_after_and_merges_logs():
    import tensorflow as tf

    model = _model()
    x = np.arange(12, dtype="float32").reshape(4, 3)
    y = np.zeros((4, 2), "float32")
    model.fit(x, y, batch_size=2, verbose=0)
    seen = []
    held, undo = hooks.hold_batches(
        model,
        before_call=lambda batches: seen.append(("before", tuple(batches[0][0].shape))),
        after_call=lambda batches, logs: seen.append(("after", sorted(logs))) or {"extra": 1.0},
    )
    logs = model.train_function(iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(2)))
    assert seen == [("before", (2, 3)), ("after", ["loss"])]
    assert logs["extra"] == 1.0 and "loss" in logs
    undo()


def test_stacked_hold_batches_undo_in_any_order():
    import tensorflow as tf

    model = _model()
    x = np.arange(12, dtype="float32").reshape(4, 3)
    y = np.zeros((4, 2), "float32")
    model.fit(x, y, batch_size=2, verbose=0)
    original = model.train_function
    calls = []
    _, undo_inner = hooks.hold_batches(model, extra_logs=lambda: calls.append("inner") or {})
    _, undo_outer = hooks.hold_batches(model, extra_logs=lambda: calls.append("outer") or {})
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
    model.train_function(iter(ds))
    assert calls == ["inner", "outer"]
    undo_inner()  # not on top: becomes a pass-through
    calls.clear()
    model.train_function(iter(ds))
    assert calls == ["outer"]
    undo_outer()  # on top: removes itself and the pass-through below
    assert model.train_function is original
    calls.clear()
    before = model.get_weights()[0].copy()
    model.fit(x, y, batch_size=2, verbose=0)
    assert not np.array_equal(before, model.get_weights()[0])
    assert calls == []


def test_replace_base_train_function_goes_under_the_wrappers():
    import tensorflow as tf

    model = _model()
    x = np.arange(12, dtype="float32").reshape(4, 3)
    y = np.zeros((4, 2), "float32")
    model.fit(x, y, batch_size=2, verbose=0)
    original = model.train_function
    _, undo_hold = hooks.hold_batches(model, extra_logs=lambda: {"held": 1.0})
    seen = []

    def replacement(iterator):
        seen.append(len(list(iterator)))
        return original(iterator[:0] or [next(iter(ds))])

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
    undo = hooks.replace_base_train_function(model, replacement)
    assert hooks.base_train_function(model) is replacement
    logs = model.train_function(iter(ds))
    assert seen == [1] and logs["held"] == 1.0  # the wrapper still runs
    undo()
    assert hooks.base_train_function(model) is original
    undo_hold()
    assert model.train_function is original


def test_hold_batches_on_the_test_and_predict_functions():
    import pytest
    import tensorflow as tf

    model = _model()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x = np.arange(12, dtype="float32").reshape(4, 3)
    y = np.zeros((4, 2), "float32")
    model.evaluate(x, y, batch_size=1, verbose=0)  # makes the test function
    model.predict(x, batch_size=1, verbose=0)  # and the predict function
    test_fn, predict_fn = model.test_function, model.predict_function
    expected = model.predict(x, batch_size=1, verbose=0)

    seen = []
    held, undo = hooks.hold_batches(
        model,
        before_call=lambda b: seen.append(len(b)),
        after_call=lambda b, logs: {"extra": 1.0},
        function="test",
    )
    assert model.train_function is None or not hasattr(model.train_function, "_held_original")
    logs = model.test_function(iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(1)))
    assert seen == [2] and "loss" in logs and logs["extra"] == 1.0
    np.testing.assert_array_equal(held[1][0].numpy(), x[1:2])
    model.evaluate(x, y, batch_size=1, verbose=0)  # goes through it: 2 calls
    assert seen == [2, 2, 2]
    undo()
    assert model.test_function is test_fn

    seen.clear()
    held, undo = hooks.hold_batches(
        model, before_call=lambda b: seen.append(tuple(tf.nest.flatten(b[0])[0].shape)),
        function="predict",
    )
    np.testing.assert_array_equal(model.predict(x, batch_size=1, verbose=0), expected)
    assert seen == [(1, 3), (1, 3)]  # two calls of two batches each
    assert len(held) == 2
    undo()
    assert model.predict_function is predict_fn
    assert hooks.base_function(model, "predict") is predict_fn

    with pytest.raises(ValueError, match="function='eval'"):
        hooks.hold_batches(model, function="eval")
    model.train_function = None
    with pytest.raises(ValueError, match="make_train_function"):
        hooks.hold_batches(model)


def test_replace_base_train_function_undo_under_later_wrappers():
    # Replaced with no wrapper on top, then wrapped by a later callback: the
    # undo must still put the original back under that wrapper.
    model = _model()
    model.make_train_function()
    original = model.train_function

    def replacement(iterator):
        raise AssertionError("not called")

    undo = hooks.replace_base_train_function(model, replacement)
    _, undo_hold = hooks.hold_batches(model)
    undo()
    assert hooks.base_train_function(model) is original
    undo_hold()
    assert model.train_function is original


def test_make_train_function_with_logs_binds_the_wrapped_step():
    # Keras binds `train_step` when it makes the train function: if it looked
    # it up at trace time instead, the extra key would be missing here.
    import tensorflow as tf

    model = _model()
    model.make_train_function()
    top = model.train_function
    made = hooks.make_train_function_with_logs(
        model, lambda: {"extra": tf.constant(7.0)}
    )
    assert model.train_function is top and "train_step" not in vars(model)
    batch = (tf.ones((2, 3)), tf.ones((2, 2)))
    logs = made([batch])
    assert float(logs["extra"]) == 7.0 and "loss" in logs
    assert "extra" not in top([batch])


def test_hold_batches_runs_a_chunk_in_one_call_traced_for_the_spec():
    # Keras' function, called with the drawn batches, would run each as a
    # call of its own and trace the step for their concrete shapes. Through
    # the wrapper it is traced once per chunk length, for the dataset's spec.
    import tensorflow as tf

    model = _model()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
    x = np.arange(30, dtype="float32").reshape(10, 3) / 30
    y = np.zeros((10, 2), "float32")
    model.fit(x, y, batch_size=1, verbose=0)
    calls = []
    keras_function = hooks.base_train_function(model)

    def recorder(batches):
        calls.append((tf.executing_eagerly(), len(batches), batches[0][0].shape.as_list()))
        return keras_function(batches)

    undo_base = hooks.replace_base_train_function(model, recorder)
    held, undo = hooks.hold_batches(model)
    before = model.get_weights()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(1)
    for _ in range(2):  # two epochs: 3 + 3 + 3 + 1 batches each
        iterator = iter(ds)
        for _ in range(4):
            model.train_function(iterator)
    # Python ran `recorder` only while tracing: once for chunks of 3, once
    # for the last chunk of 1, both with the batch dim of the spec (None).
    assert calls == [(False, 3, [None, 3]), (False, 1, [None, 3])]
    assert len(held) == 1  # the last call's batch
    # And the 20 steps did train (the graph is not a no-op).
    after = model.get_weights()
    assert all(np.isfinite(w).all() for w in after)
    assert any(np.abs(a - b).max() > 0 for a, b in zip(before, after))
    undo()
    undo_base()


def test_draw_and_run_batches_run_one_chunk_as_one_call():

    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((10, 2), "float32"), np.ones((10, 1), "float32"))
    ).batch(2)
    model.fit(data, epochs=1, verbose=0)  # makes the train function
    iterator = iter(data)
    batches = hooks.draw_batches(model, iterator)
    assert len(batches) == 3
    assert hooks.draw_batches(model, batches) is batches  # already drawn
    before = int(model.optimizer.iterations)
    logs = hooks.run_batches(model, model.train_function, batches)
    assert int(model.optimizer.iterations) == before + 3
    assert "loss" in logs
    assert len(hooks.draw_batches(model, iterator)) == 2  # what is left


def test_runs_batches_functions_get_the_list_from_wrappers():

    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((4, 2), "float32"), np.ones((4, 1), "float32"))
    ).batch(2)
    model.fit(data, epochs=1, verbose=0)
    keras_function = model.train_function
    seen = []

    def dispatch(batches):
        seen.append(type(batches).__name__)  # Python: runs at every call
        return hooks.run_batches(model, keras_function, batches)

    model.train_function = hooks.runs_batches(dispatch)
    hooks.hold_batches(model)
    model.fit(data, epochs=1, verbose=0)
    assert len(seen) == 2 and all(name == "_Chunk" for name in seen)
