"""The patch/undo helper for instance attributes, the wrappers built on it,
and how they stack."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import kept_for_backward
from conftest import nested_model

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost import recompute
from keras_gradboost import wrappers
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import nan_watcher as nan_watcher_module

# ------------------------------------------------ recompute x NaNWatcher


class Block(keras.layers.Layer):
    """x + Dense(gelu(Dense(x))): much more inside than its input."""

    def __init__(self, width=64, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(2 * width, activation="gelu")
        self.down = keras.layers.Dense(width)

    def build(self, input_shape):
        self.up.build(input_shape)
        self.down.build(tuple(input_shape[:-1]) + (self.up.units,))

    def call(self, x):
        return x + self.down(self.up(x))


def _blocks_model(count=3, width=64):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    h = inputs
    for i in range(count):
        h = Block(width, name=f"block_{i}")(h)
    return GradBoostModel(inputs, keras.layers.Dense(3, name="head")(h))


def test_recompute_survives_a_nan_watcher_replay():
    # The replay wraps every layer's `call` to record it; the recompute mark
    # is a wrapper of the same attribute, and must be there after the replay.
    model = _blocks_model()
    names = [f"block_{i}" for i in range(3)]
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", recompute=names)
    before = model.recompute_plan(batch_size=32)
    assert all(block.cached_bytes > 0 for block in before.blocks)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 64)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    x[2 * 16 + 3] = np.nan  # step 2 of 4
    watcher = NaNWatcher(action="skip", verbose=0)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[watcher])
    assert [e.step for e in watcher.events] == [2]  # replayed by locate

    blocks_ = [model.get_layer(name) for name in names]
    assert all(recompute.is_marked(block) for block in blocks_)
    after = model.recompute_plan(batch_size=32)
    assert [
        (b.name, b.recomputed, b.cached_bytes, b.input_bytes) for b in after.blocks
    ] == [(b.name, b.recomputed, b.cached_bytes, b.input_bytes) for b in before.blocks]
    assert (after.bytes_with, after.bytes_without) == (before.bytes_with, before.bytes_without)
    # A retraced step still recomputes: its backward keeps only block inputs.
    with_rc, without = kept_for_backward(model, tf.TensorSpec((256, 64)))
    assert with_rc < 0.3 * without


# ------------------------------------------------------- holding batches


def _model():
    return nested_model()


def test_hold_batches_keeps_the_last_chunk_and_undoes():
    import tensorflow as tf

    model = _model()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x = np.arange(12, dtype="float32").reshape(4, 3)
    y = np.zeros((4, 2), "float32")
    model.fit(x, y, batch_size=1, verbose=0)  # makes the train function
    original = model.train_function
    held, undo = wrappers.hold_batches(model)
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


def test_hold_batches_calls_before_and_after_and_merges_logs():
    import tensorflow as tf

    model = _model()
    x = np.arange(12, dtype="float32").reshape(4, 3)
    y = np.zeros((4, 2), "float32")
    model.fit(x, y, batch_size=2, verbose=0)
    seen = []
    held, undo = wrappers.hold_batches(
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
    _, undo_inner = wrappers.hold_batches(model, extra_logs=lambda: calls.append("inner") or {})
    _, undo_outer = wrappers.hold_batches(model, extra_logs=lambda: calls.append("outer") or {})
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
    _, undo_hold = wrappers.hold_batches(model, extra_logs=lambda: {"held": 1.0})
    seen = []

    def replacement(iterator):
        seen.append(len(list(iterator)))
        return original(iterator[:0] or [next(iter(ds))])

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
    undo = wrappers.replace_base_train_function(model, replacement)
    assert wrappers.base_train_function(model) is replacement
    logs = model.train_function(iter(ds))
    assert seen == [1] and logs["held"] == 1.0  # the wrapper still runs
    undo()
    assert wrappers.base_train_function(model) is original
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
    held, undo = wrappers.hold_batches(
        model,
        before_call=lambda b: seen.append(len(b)),
        after_call=lambda b, logs: {"extra": 1.0},
        function="test",
    )
    assert model.train_function is None or not wrappers.is_patched(model.train_function)
    logs = model.test_function(iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(1)))
    assert seen == [2] and "loss" in logs and logs["extra"] == 1.0
    np.testing.assert_array_equal(held[1][0].numpy(), x[1:2])
    model.evaluate(x, y, batch_size=1, verbose=0)  # goes through it: 2 calls
    assert seen == [2, 2, 2]
    undo()
    assert model.test_function is test_fn

    seen.clear()
    held, undo = wrappers.hold_batches(
        model, before_call=lambda b: seen.append(tuple(tf.nest.flatten(b[0])[0].shape)),
        function="predict",
    )
    np.testing.assert_array_equal(model.predict(x, batch_size=1, verbose=0), expected)
    assert seen == [(1, 3), (1, 3)]  # two calls of two batches each
    assert len(held) == 2
    undo()
    assert model.predict_function is predict_fn
    assert wrappers.base_function(model, "predict") is predict_fn

    with pytest.raises(ValueError, match="function='eval'"):
        wrappers.hold_batches(model, function="eval")
    model.train_function = None
    with pytest.raises(ValueError, match="make_train_function"):
        wrappers.hold_batches(model)


def test_replace_base_train_function_undo_under_later_wrappers():
    # Replaced with no wrapper on top, then wrapped by a later callback: the
    # undo must still put the original back under that wrapper.
    model = _model()
    model.make_train_function()
    original = model.train_function

    def replacement(iterator):
        raise AssertionError("not called")

    undo = wrappers.replace_base_train_function(model, replacement)
    _, undo_hold = wrappers.hold_batches(model)
    undo()
    assert wrappers.base_train_function(model) is original
    undo_hold()
    assert model.train_function is original


def test_make_train_function_with_logs_binds_the_wrapped_step():
    # Keras binds `train_step` when it makes the train function: if it looked
    # it up at trace time instead, the extra key would be missing here.
    import tensorflow as tf

    model = _model()
    model.make_train_function()
    top = model.train_function
    made = wrappers.make_train_function_with_logs(
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
    keras_function = wrappers.base_train_function(model)

    def recorder(batches):
        calls.append((tf.executing_eagerly(), len(batches), batches[0][0].shape.as_list()))
        return keras_function(batches)

    undo_base = wrappers.replace_base_train_function(model, recorder)
    held, undo = wrappers.hold_batches(model)
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
    batches = wrappers.draw_batches(model, iterator)
    assert len(batches) == 3
    assert wrappers.draw_batches(model, batches) is batches  # already drawn
    before = int(model.optimizer.iterations)
    logs = wrappers.run_batches(model, model.train_function, batches)
    assert int(model.optimizer.iterations) == before + 3
    assert "loss" in logs
    assert len(wrappers.draw_batches(model, iterator)) == 2  # what is left


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
        return wrappers.run_batches(model, keras_function, batches)

    model.train_function = wrappers.runs_batches(dispatch)
    wrappers.hold_batches(model)
    model.fit(data, epochs=1, verbose=0)
    assert len(seen) == 2 and all(name == "_Chunk" for name in seen)


# ------------------------------------------------------ patch, on a plain object


class Thing:
    def f(self, x):
        return ("f", x)


def _logging(tag, log):
    def around(below, x):
        log.append(tag)
        return below(x)

    return around


def test_patch_on_a_method_leaves_no_instance_attribute_after_undo():
    thing, log = Thing(), []
    undo = wrappers.patch(thing, "f", _logging("a", log))
    assert "f" in vars(thing) and wrappers.is_patched(thing.f)
    assert thing.f(1) == ("f", 1) and log == ["a"]
    undo()
    assert "f" not in vars(thing)
    assert thing.f.__func__ is Thing.f
    undo()  # a second undo does nothing
    assert "f" not in vars(thing)


def test_patch_over_an_instance_attribute_puts_it_back():
    thing, log = Thing(), []

    def own(x):
        return ("own", x)

    thing.f = own
    undo = wrappers.patch(thing, "f", _logging("a", log))
    assert thing.f(2) == ("own", 2) and log == ["a"]
    assert wrappers.base(thing, "f") is own
    undo()
    assert vars(thing)["f"] is own


@pytest.mark.parametrize("first", ["a", "b"])
def test_two_patches_undone_in_either_order(first):
    thing, log = Thing(), []
    undos = {t: wrappers.patch(thing, "f", _logging(t, log)) for t in ("a", "b")}
    assert thing.f(1) == ("f", 1) and log == ["b", "a"]
    undos[first]()
    log.clear()
    thing.f(1)
    assert log == ["b" if first == "a" else "a"]
    undos["b" if first == "a" else "a"]()
    assert "f" not in vars(thing)


def test_undoing_a_middle_patch_makes_the_chain_skip_it():
    thing, log = Thing(), []
    a, b, c = (wrappers.patch(thing, "f", _logging(t, log)) for t in "abc")
    b()
    thing.f(1)
    assert log == ["c", "a"]
    assert [p.around for p in wrappers.patches(thing, "f")] == [c.around, a.around]
    c()  # on top: goes, and takes the undone b along
    assert vars(thing)["f"] is a.installed
    log.clear()
    thing.f(1)
    assert log == ["a"]
    b()  # again: nothing
    a()
    assert "f" not in vars(thing)


def test_undo_leaves_what_someone_else_set_and_passes_calls_on():
    thing, log = Thing(), []
    a = wrappers.patch(thing, "f", _logging("a", log))
    ours = thing.f

    def theirs(x):
        return ("theirs", ours(x))

    thing.f = theirs  # not through the helper
    assert a.state() == "covered"
    a()
    assert vars(thing)["f"] is theirs  # not deleted, not overwritten
    assert thing.f(3) == ("theirs", ("f", 3)) and log == []  # a pass-through
    assert a.state() == "removed"


def test_a_patch_over_someone_elses_attribute_restores_it():
    thing, log = Thing(), []
    a = wrappers.patch(thing, "f", _logging("a", log))

    def replaced(x):
        return ("replaced", x)

    thing.f = replaced  # drops a's chain
    b = wrappers.patch(thing, "f", _logging("b", log))
    assert thing.f(1) == ("replaced", 1) and log == ["b"]
    a()  # no longer on the attribute: changes nothing
    assert vars(thing)["f"] is b.installed
    b()
    assert vars(thing)["f"] is replaced


def test_passthrough_and_keep_wrapping():
    thing, log = Thing(), []
    a = wrappers.patch(
        thing, "f", _logging("a", log), passthrough=lambda below, x: ("passed", below(x))
    )
    taken = thing.f
    b = wrappers.patch(thing, "f", _logging("b", log), keep_wrapping=True)
    kept = thing.f
    b()
    assert vars(thing)["f"] is taken
    assert kept(1) == ("f", 1) and log == ["b", "a"]  # b still wraps for its taker
    thing.f = lambda x: taken(x)  # someone else, over a
    a()
    log.clear()
    assert thing.f(1) == ("passed", ("f", 1)) and log == []


def test_the_installed_function_has_the_signature_of_what_it_wraps():
    import inspect

    thing = Thing()
    wrappers.patch(thing, "f", lambda below, x: below(x))
    assert list(inspect.signature(thing.f).parameters) == ["x"]


@pytest.mark.parametrize("first", [0, 1])
def test_replaced_bases_stack_under_patches(first):
    thing, log = Thing(), []

    def own(x):
        return ("own", x)

    thing.f = own
    new = [lambda x: ("one", x), lambda x: ("two", x)]
    undo_one = wrappers.replace_base(thing, "f", new[0])
    assert vars(thing)["f"] is new[0]
    a = wrappers.patch(thing, "f", _logging("a", log))
    undo_two = wrappers.replace_base(thing, "f", new[1])
    assert wrappers.base(thing, "f") is new[1]
    assert thing.f(1) == ("two", 1) and log == ["a"]
    a()
    assert vars(thing)["f"] is new[1]
    [undo_one, undo_two][first]()
    assert vars(thing)["f"] is new[1 - first]
    [undo_one, undo_two][1 - first]()
    assert vars(thing)["f"] is own
    undo_one()  # again: nothing
    assert vars(thing)["f"] is own


def test_a_replaced_base_undone_under_a_later_patch():
    thing, log = Thing(), []
    undo = wrappers.replace_base(thing, "f", lambda x: ("new", x))
    a = wrappers.patch(thing, "f", _logging("a", log))
    undo()
    assert thing.f(1) == ("f", 1) and log == ["a"]
    a()
    assert "f" not in vars(thing)


# ---------------------------------------- every pair of the real wrappers


def _pair_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="d1")(inputs)
    outputs = keras.layers.Dense(2, name="out")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.make_train_function()
    model.make_test_function()
    model.make_predict_function()
    return model


def _hold(function):
    def install(model):
        _, undo = wrappers.hold_batches(model, function=function)
        return undo, lambda: undo in wrappers.patches(model, f"{function}_function")

    return install


def _replace_base(model):
    base = wrappers.base_train_function(model)

    def new(iterator):
        return base(iterator)

    undo = wrappers.replace_base_train_function(model, new)
    return undo, lambda: wrappers.base_train_function(model) is new


def _guard(model):
    from keras_gradboost import guard

    undo = guard.guard_optimizer(model.optimizer)
    return undo, lambda: undo in wrappers.patches(model.optimizer, "apply")


def _several(patches):
    def undo():
        for p in patches:
            p()

    return undo, lambda: all(p.state() == "wrapping" for p in patches)


def _step_tracer(model):
    from keras_gradboost import tracing

    return _several(tracing.StepTracer(model).patches)


def _gradient_tracer(model):
    from keras_gradboost import tracing

    tracer = tracing.GradientTracer(
        model.optimizer, model.distribute_strategy, model.trainable_variables
    )
    return _several([tracer.patch])


def _recompute_mark(model):
    layer = model.get_layer("d1")
    undo = recompute.mark(layer)
    return undo, lambda: recompute.is_marked(layer)


def _locate_recording(model):
    from keras_gradboost import hooks
    from keras_gradboost import locate

    return _several(locate.record_calls(hooks.flatten_layers(model, include_self=False), []))


def _count_traces(model):
    from keras_gradboost import compare

    compare.count_traces(model)
    return _several(wrappers.patches(model, "train_step")[:1])


def _with_logs(model):
    wrappers.make_train_function_with_logs(model, lambda: {})
    return (lambda: None), (lambda: True)  # nothing stays: in place while made


def _nan_watcher(model):
    watcher = NaNWatcher(action="skip", verbose=0)
    watcher.set_model(model)
    watcher.on_train_begin()

    def alive():
        guarded = vars(model)[nan_watcher_module._GUARDED][1]
        return wrappers.base_train_function(model) is guarded and (
            wrappers.is_patched(model.make_train_function)
        )

    return watcher.on_train_end, alive


REAL_WRAPPERS = {
    "hold_train": _hold("train"),
    "hold_test": _hold("test"),
    "replace_base_train_function": _replace_base,
    "guard_optimizer": _guard,
    "step_tracer": _step_tracer,
    "gradient_tracer": _gradient_tracer,
    "recompute_mark": _recompute_mark,
    "locate_recording": _locate_recording,
    "count_traces": _count_traces,
    "make_train_function_with_logs": _with_logs,
    "nan_watcher": _nan_watcher,
}


def _attributes(model):
    from keras_gradboost import hooks

    owners = [model, model.optimizer] + hooks.flatten_layers(model, include_self=False)
    names = {
        id(model): (
            "train_function", "test_function", "predict_function", "train_step",
            "test_step", "predict_step", "make_train_function",
        ),
        id(model.optimizer): ("apply",),
    }
    return {
        (id(owner), name): (owner, name, vars(owner).get(name, wrappers._ABSENT))
        for owner in owners
        for name in names.get(id(owner), ("call",))
    }


def _assert_restored(before, model):
    for key, (owner, name, value) in before.items():
        now = vars(owner).get(name, wrappers._ABSENT)
        assert now is value, f"{type(owner).__name__}.{name}: {now!r} is not {value!r}"


@pytest.mark.parametrize(
    "first, second",
    [(a, b) for i, a in enumerate(REAL_WRAPPERS) for b in list(REAL_WRAPPERS)[i + 1 :]],
)
def test_every_pair_of_wrappers_undone_in_either_order_restores_the_model(first, second):
    for order in ((first, second), (second, first)):
        for undo_first in order:
            model = _pair_model()
            before = _attributes(model)
            installed = {}
            for name in order:
                installed[name] = REAL_WRAPPERS[name](model)
            other = order[1] if undo_first == order[0] else order[0]
            installed[undo_first][0]()
            # (Making a train function tears a watcher down: a new fit.)
            if order != ("nan_watcher", "make_train_function_with_logs"):
                assert installed[other][1](), f"undoing {undo_first} took {other} along"
            installed[other][0]()
            _assert_restored(before, model)


def test_swap_base_puts_the_new_value_in_the_old_ones_place():
    class Thing:
        def f(self):
            return "class"

    thing = Thing()
    assert not wrappers.swap_base(thing, "f", object(), lambda: "x")  # not found
    old, new = (lambda: "old"), (lambda: "new")
    undo = wrappers.replace_base(thing, "f", old)
    top = wrappers.patch(thing, "f", lambda below: "top:" + below())
    assert thing.f() == "top:old"
    assert wrappers.swap_base(thing, "f", old, new)
    assert thing.f() == "top:new"
    undo()  # the entry's owner takes the swapped-in value away with it
    assert thing.f() == "top:class"
    top()
    assert "f" not in vars(thing)
    thing.f = old  # a plain attribute: swapped in place
    assert wrappers.swap_base(thing, "f", old, new) and vars(thing)["f"] is new
