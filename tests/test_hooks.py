"""Each Keras internal used by keras_gradboost, checked against this Keras.

If one of these fails after a Keras upgrade, fix `keras_gradboost/hooks.py`:
it is the only module that touches Keras internals.
"""

import numpy as np
import pytest

import keras
import tensorflow as tf
from conftest import nested_model
from keras_gradboost import hooks


def _model():
    return nested_model()


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


def test_keep_input_dtypes_stops_the_policy_cast_and_undoes():
    """A mixed-policy layer casts a float32 input (bfloat16 turns 257 into
    256); kept, it passes it on as given, a NumPy array included."""
    layer = keras.layers.Reshape((2,), dtype="mixed_bfloat16")
    x = np.array([[257.0, 1999.0]], "float32")
    assert hooks.casts_inputs(layer)
    assert not hooks.casts_inputs(_model())  # a Functional converts itself
    assert not hooks.casts_inputs(keras.layers.IntegerLookup(vocabulary=[1]))
    cast = layer(keras.ops.convert_to_tensor(x))
    assert cast.dtype == "bfloat16"
    assert keras.ops.convert_to_numpy(keras.ops.cast(cast, "float32")).tolist() == [
        [256.0, 2000.0]
    ]

    hooks.keep_input_dtypes(layer)
    assert hooks.keeps_input_dtypes(layer) and not hooks.casts_inputs(layer)
    for given in (x, keras.ops.convert_to_tensor(x)):
        kept = layer(given)
        assert kept.dtype == "float32"
        assert keras.ops.convert_to_numpy(kept).tolist() == x.tolist()
    assert layer.dtype_policy.name == "mixed_bfloat16"

    hooks.keep_input_dtypes(layer, keep=False)
    assert hooks.casts_inputs(layer) and not hooks.keeps_input_dtypes(layer)
    assert layer(keras.ops.convert_to_tensor(x)).dtype == "bfloat16"
    with pytest.raises(ValueError, match="Only input tensors"):
        layer([[1.0, 2.0]])  # non-tensor positional arguments refused again


def test_check_runs_every_hook():
    assert hooks.check() is True


def test_fit_validation_flag():
    assert hooks.is_fit_validation({"_use_cached_eval_dataset": True})
    assert not hooks.is_fit_validation({})


def test_multi_worker_trainer_facts_hold():
    """Keras' TensorFlow trainer still reduces the logs across workers with
    axis=0, and has the two methods `hooks.MultiWorkerTrainer` overrides;
    tests/test_multi_worker.py runs them on two workers."""
    hooks.check_multi_worker_trainer()


def test_first_local_batch_keeps_one_replica_part_of_each_structure():
    import tensorflow as tf
    from conftest import shared_mirrored_strategy

    strategy = shared_mirrored_strategy()
    data = {"a": np.arange(8, dtype="float32").reshape(4, 2), "b": np.ones((4,), "int32")}
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((data, np.zeros((4, 1), "float32"))).batch(4)
    )))
    local = hooks.first_local_batch(strategy, batch)
    assert local[0]["a"].shape == (2, 2) and local[0]["b"].dtype == tf.int32
    assert local[1].shape == (2, 1)
    assert hooks.first_local_batch(strategy, {"x": 1.0}) == {"x": 1.0}


def test_the_fit_epoch_iterator_says_where_the_data_iterator_is():
    """`fit_epoch_iterator` finds Keras' epoch iterator from a callback;
    `stream_position` counts the batches drawn from a data iterator kept
    across epochs (None without `steps_per_epoch`); `advance_stream` moves
    Keras' count, so Keras starts the data again that much earlier."""
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices(
        (np.zeros((32, 2), "float32"), np.zeros((32, 1), "float32"))
    ).batch(4)  # 8 batches
    seen = []

    class Look(keras.callbacks.Callback):
        def __init__(self, advance=0):
            super().__init__()
            self.advance = advance

        def on_train_begin(self, logs=None):
            self.found = hooks.fit_epoch_iterator(self.model)

        def on_train_batch_begin(self, batch, logs=None):
            # (After Keras started the epoch's data iterator.)
            if self.advance:
                hooks.advance_stream(self.found, self.advance)
                self.advance = 0

        def on_train_batch_end(self, batch, logs=None):
            seen.append(hooks.stream_position(self.found))

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    look = Look()
    fit = dict(shuffle=False, verbose=0)
    model.fit(data, steps_per_epoch=3, epochs=2, callbacks=[look], **fit)
    assert look.found is not None and seen == [1, 2, 3, 4, 5, 6]
    seen.clear()
    model.fit(data, epochs=1, callbacks=[Look()], **fit)
    assert seen == [None] * 8
    assert hooks.fit_epoch_iterator(model) is None  # no fit() running
    seen.clear()
    # 2 more counted as drawn: epoch 1 ends the data, epoch 2 starts it again.
    model.fit(data, steps_per_epoch=3, epochs=3, callbacks=[Look(advance=2)], **fit)
    assert seen == [3, 4, 5, 6, 7, 8, 1, 2, 3]


def test_symbolic_build_builds_the_compiled_metrics_from_one_batch():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", metrics=["mae"])
    before = len(model.metrics_variables)  # the loss tracker's only
    hooks.symbolic_build(model, (np.zeros((4, 2), "float32"), np.zeros((4, 1), "float32")))
    assert len(model.metrics_variables) == before + 2  # mae's total and count


def test_the_update_recording_scope_sees_reads_assignments_and_values():
    """The recompute reads a Keras variable's value through the stateless
    scope's `get_current_value`, and an `assign` reaches it through
    `add_update`; `scope_values` reads Keras' `state_mapping`."""
    seen = keras.Variable(np.ones(2, "float32"), name="seen")
    assigned = keras.Variable(np.zeros(2, "float32"), name="assigned")
    outside = keras.Variable(np.ones(2, "float32"), name="outside")
    with hooks.update_recording_scope([(seen, np.full(2, 3.0, "float32"))]) as scope:
        np.testing.assert_allclose(seen.value, [3.0, 3.0])  # the scope's value
        assigned.assign(np.full(2, 5.0, "float32"))
        np.testing.assert_allclose(assigned.value, [5.0, 5.0])
        np.asarray(outside.value)  # not in the scope: not counted
    assert scope.read == {id(seen), id(assigned)}
    assert scope.updated == [assigned]
    values = {v.name: np.asarray(t) for v, t in hooks.scope_values(scope)}
    assert sorted(values) == ["assigned", "seen"]
    np.testing.assert_allclose(values["assigned"], [5.0, 5.0])
    np.testing.assert_allclose(hooks.scope_value(scope, seen), [3.0, 3.0])
    assert hooks.scope_value(scope, outside) is None
    np.testing.assert_allclose(assigned.numpy(), [0.0, 0.0])  # not assigned


def test_onednn_enabled_reads_tensorflows_own_flag():
    """TensorFlow's `IsMklEnabled` (private): a bool here; the recompute
    plan's `eigen_convolutions` note depends on it."""
    assert isinstance(hooks.onednn_enabled(), bool)


def test_in_xla_context_reads_tensorflows_own_tracing_state():
    """TensorFlow's `GraphOrParentsInXlaContext` (private): True while a
    `tf.function(jit_compile=True)` traces, in a function it calls too;
    False in a plain `tf.function` and eagerly. `depthwise="chunked"`
    runs Keras' way in a step XLA compiles as a whole."""
    seen = []

    def probe(x):
        seen.append(hooks.in_xla_context())
        return x + 1

    tf.function(probe, jit_compile=True)(1.0)
    tf.function(probe)(1.0)
    probe(1.0)
    tf.function(lambda x: tf.function(probe)(x), jit_compile=True)(1.0)
    assert seen == [True, False, False, True]


def test_collecting_losses_records_instead_of_adding_and_nests():
    hooks.check_collecting_losses()
    dense = keras.layers.Dense(1, activity_regularizer="l1")
    x = tf.ones((2, 3))
    with hooks.collecting_losses() as outer:
        dense(x)
        with hooks.collecting_losses() as inner:
            dense(x)
        dense(x)
    assert len(outer) == 2 and len(inner) == 1 and not dense.losses
    # Outside, Keras' own: added to the layer, and its error for a non-tensor.
    dense(x)
    assert len(dense.losses) == 1
    with pytest.raises(ValueError, match="add_loss"):
        dense.add_loss(1.0)


def test_untracked_state_lists_a_stateful_rnns_states_once():
    # Keras leaves a stateful RNN's states out of `variables` (they are
    # not saved); whatever puts state back after a forward pass needs them.
    inputs = keras.Input((3, 2), batch_size=2)
    inner = keras.layers.Bidirectional(keras.layers.LSTM(2, stateful=True, return_sequences=True))
    outputs = keras.layers.GRU(2, stateful=True)(inner(inputs))
    model = keras.Model(inputs, keras.layers.GRU(2)(keras.layers.Reshape((1, 2))(outputs)))
    states = hooks.untracked_state(model)
    assert len(states) == 5  # two LSTMs' h and c, the stateful GRU's h
    assert not {id(v) for v in states} & {id(v) for v in model.variables}
    assert hooks.untracked_state(keras.layers.LSTM(2)) == []
