"""MirroredStrategy over two logical CPUs vs one device on the same batches."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import max_weight_diff
from conftest import shared_mirrored_strategy
from conftest import small_model
from keras_gradboost import GradBoostModel


def _strategy():
    return shared_mirrored_strategy()


@pytest.mark.parametrize(
    "optimizer, loss_scale, batch_size",
    [
        ("sgd", None, 16),  # 7 micro-batches / epoch: an update of 4 and a remainder of 3
        ("adam", None, 16),
        ("sgd", "dynamic", 26),  # 4 micro-batches of 26: an uneven split per replica (13+13)
        ("adam", 8.0, 24),  # last micro-batch of 8
    ],
)
def test_mirrored_accumulation_equals_single_device(
    regression_data, optimizer, loss_scale, batch_size
):
    x, y = regression_data
    kwargs = dict(loss="mse", accumulate_steps=4, loss_scale=loss_scale)
    single = small_model(GradBoostModel)
    single.compile(optimizer=keras.optimizers.get(optimizer), **kwargs)
    single.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    with _strategy().scope():
        mirrored = small_model(GradBoostModel)
        mirrored.compile(optimizer=keras.optimizers.get(optimizer), **kwargs)
    mirrored.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    assert mirrored.optimizer.iterations.numpy() == single.optimizer.iterations.numpy()
    assert max_weight_diff(mirrored, single) < 2e-6


def test_mirrored_accumulation_equals_large_batch_reference(regression_data):
    # Independent reference: a plain single-device Keras model stepping on
    # the concatenated micro-batches.
    x, y = regression_data
    ref = small_model()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.train_on_batch(x[:64], y[:64])
    ref.train_on_batch(x[64:], y[64:])
    with _strategy().scope():
        model = small_model(GradBoostModel)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=4)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert model.optimizer.iterations.numpy() == 2
    assert max_weight_diff(model, ref) < 2e-6


def test_mirrored_skips_nonfinite_micro_batch_on_every_replica(regression_data):
    x, y = regression_data
    x = x.copy()
    x[3] = np.nan  # only replica 0 of micro-batch 0 sees it
    keep = np.r_[16:64]
    ref = small_model()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.train_on_batch(x[keep], y[keep])
    with _strategy().scope():
        model = small_model(GradBoostModel)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=4, loss_scale=1.0
        )
    model.fit(x[:64], y[:64], batch_size=16, shuffle=False, verbose=0)
    assert model.step_facts.read()["skipped_steps"] == 1
    assert max_weight_diff(model, ref) < 2e-6


class _CountingReduce(tf.distribute.ReductionToOneDevice):
    """Counts, in the graph, how many batch all-reduces of more than one
    tensor actually run (the optimizer all-reduces all gradients in one)."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        if len(value_destination_pairs) > 1:
            self.counter.assign_add(1)
        return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)


def test_gradients_are_all_reduced_once_per_update(regression_data):
    x, y = regression_data
    counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=_CountingReduce(counter))
    with strategy.scope():
        plain = small_model(GradBoostModel)
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(x[:96], y[:96], batch_size=12, shuffle=False, verbose=0)  # 8 steps
    assert int(counter.numpy()) == 8  # the counter sees Keras' own all-reduce
    counter.assign(0)
    with strategy.scope():
        model = small_model(GradBoostModel)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulate_steps=4)
    model.fit(x[:96], y[:96], batch_size=12, shuffle=False, verbose=0)  # 8 micro-batches
    assert model.optimizer.iterations.numpy() == 2
    assert int(counter.numpy()) == 2


@pytest.mark.parametrize(
    "kind, name, reason",
    [
        (tf.distribute.experimental.ParameterServerStrategy, "ParameterServerStrategy",
         "asynchronously"),
        (tf.distribute.TPUStrategy, "TPUStrategy", "not been proven on TPU"),
    ],
)
def test_strategies_without_one_all_replica_step_are_refused_by_name(kind, name, reason):
    from keras_gradboost.config import GradBoostConfig
    from keras_gradboost.plan import check_strategy

    # An uninitialised instance: only its type matters to the check.
    strategy = object.__new__(kind)
    refused = rf"accumulate_steps=4 cannot be used under {name}: .*{reason}"
    with pytest.raises(ValueError, match=refused):
        check_strategy(strategy, GradBoostConfig(accumulate_steps=4), None)
    refused = rf"loss_scale='dynamic' \(on for this model\) cannot be used under {name}"
    with pytest.raises(ValueError, match=refused):
        check_strategy(strategy, GradBoostConfig(loss_scale="dynamic"), (True, 1.0))
    check_strategy(strategy, GradBoostConfig(), None)  # plain Keras step: not refused here


def test_multi_worker_mirrored_strategy_is_accepted_and_named_publicly():
    """Proven exact across workers by tests/test_multi_worker.py."""
    from keras_gradboost.config import GradBoostConfig
    from keras_gradboost.plan import check_strategy
    from keras_gradboost.plan import strategy_name

    strategy = object.__new__(tf.distribute.MultiWorkerMirroredStrategy)
    assert type(strategy).__name__ != "MultiWorkerMirroredStrategy"  # the internal class
    assert strategy_name(strategy) == "MultiWorkerMirroredStrategy"
    check_strategy(strategy, GradBoostConfig(accumulate_steps=4), (True, 1.0))
    check_strategy(_strategy(), GradBoostConfig(accumulate_steps=4), (True, 1.0))
    with pytest.raises(
        ValueError,
        match=r"accumulate_check=True and recompute_check=True cannot be used under "
        r"MultiWorkerMirroredStrategy: .* train across workers with "
        r"accumulate_check=False and recompute_check=False\.",
    ):
        check_strategy(
            strategy,
            GradBoostConfig(
                accumulate_steps=2, accumulate_check=True, recompute="auto",
                recompute_check=True,
            ),
            None,
        )


def test_mirrored_recompute_equals_no_recompute():
    """Each replica's thread recomputes its own blocks, with its own Dropout
    masks and BatchNormalization statistics restored; selectively too (the
    replicas' threads split the kernel layers' activations off in turn)."""
    from recompute.models import residual_model

    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    models = {}
    selective = {"policy": "selective"}
    for setting in (None, "auto", selective):
        # ReductionToOneDevice: collective all-reduces of a second strategy in
        # one process can collide with an earlier one's instance keys.
        strategy = tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
        with strategy.scope():
            model = residual_model()
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", recompute=setting)
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        models[str(setting)] = model
    assert models["auto"].recompute_plan().recomputed  # something was recomputed
    # Every block but the last, whose replay would come first (no saving).
    assert models[str(selective)].recompute_plan().recomputed == ["res_0", "res_1"]
    for setting in ("auto", str(selective)):
        for a, b in zip(models["None"].variables, models[setting].variables):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), atol=1e-6, err_msg=f"{setting}: {a.path}"
            )


@pytest.mark.parametrize("samples, uneven", [(18, False), (19, True)])
def test_an_uneven_split_without_accumulation_warns(samples, uneven):
    """Global batches of 4 on 2 replicas: the last of 18 samples is 1 + 1
    rows (even, exact), the last of 19 is 2 + 1 (not the large-batch step)."""
    import warnings

    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 5)).astype("float32")
    y = rng.normal(size=(samples, 3)).astype("float32")
    with _strategy().scope():
        model = small_model(GradBoostModel)
        model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    said = [str(w.message) for w in caught if "split unevenly" in str(w.message)]
    assert len(said) == (1 if uneven else 0), said  # once, not every epoch
    if uneven:
        assert "1 of them" in said[0] and "accumulate_steps >= 2" in said[0]


def test_mirrored_auto_fed_by_a_generator_trains_as_on_arrays():
    """"auto" reads a generator's first batch for the batch size, and each
    replica traces half of it: the plan and the training equal those of
    the same batches given as arrays."""
    import warnings

    from recompute.models import residual_model

    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    models = {}
    for feed in ("arrays", "generator"):
        with _strategy().scope():
            model = residual_model(rate=0.0, blocks_count=6)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", recompute="auto")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if feed == "arrays":
                model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
            else:
                model.fit(((x[i : i + 32], y[i : i + 32]) for i in (0, 32)), verbose=0)
        assert not [w for w in caught if "cannot estimate" in str(w.message)]
        models[feed] = model
    plan = models["generator"].recompute_plan()
    assert plan.batch_size == 16  # each replica's share
    assert plan.recomputed and plan.recomputed == models["arrays"].recompute_plan().recomputed
    assert max_weight_diff(models["arrays"], models["generator"]) < 1e-6
