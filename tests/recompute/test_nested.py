"""Nested recompute: a chosen block inside a recomputed one recomputes inside
the outer block's replay; gradients and state equal no recompute."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost import recompute
from recompute.models import WIDTH
from recompute.models import ResBlock
from recompute.models import assert_same_state
from recompute.models import train

CALLS = {}


class Counted(ResBlock):
    """A ResBlock that counts the calls traced (forward and replays)."""

    def call(self, x, training=None):
        CALLS[self.name] = CALLS.get(self.name, 0) + 1
        return super().call(x, training=training)


class Outer(keras.layers.Layer):
    """Two inner blocks and a Dropout of its own between them."""

    def __init__(self, index, **kwargs):
        super().__init__(**kwargs)
        self.first = Counted(name=f"inner_{index}a", seed=index)
        self.drop = keras.layers.Dropout(0.2, seed=10 + index)
        self.second = Counted(name=f"inner_{index}b", seed=20 + index)

    def build(self, input_shape):
        self.first.build(input_shape)
        self.second.build(input_shape)

    def call(self, x, training=None):
        h = self.first(x, training=training)
        return self.second(self.drop(h, training=training), training=training)


def nested_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(WIDTH, name="stem")(inputs)
    for i in range(2):
        h = Outer(i, name=f"outer_{i}")(h)
    return GradBoostModel(inputs, keras.layers.Dense(3, name="head")(h))


@pytest.mark.parametrize(
    "setting, jit_compile",
    [
        (["outer_*", "inner_*"], False),  # both inner blocks of both outer ones
        (["outer_0", "inner_0b", "inner_1a"], False),  # one inside, one at the top
        (["outer_*", "inner_*"], True),  # (XLA: also tests/test_interactions.py)
    ],
)
def test_nested_blocks_equal_no_recompute(data, jit_compile, setting):
    x, y = data
    plain, nested = nested_model(), nested_model()
    h_plain = train(plain, x, y, jit_compile=jit_compile).history
    h_nested = train(nested, x, y, jit_compile=jit_compile, recompute=setting).history
    # Weights, moving statistics, seed states. Without XLA both graphs run
    # the same kernels and agree exactly (0.0 measured); XLA fuses the
    # nested replays differently (1.1e-6 apart after 4 SGD steps, one
    # kernel of 36 variables).
    assert_same_state(plain, nested, atol=1e-5 if jit_compile else 1e-6)
    np.testing.assert_allclose(h_plain["loss"], h_nested["loss"], rtol=1e-6)


def _traced_calls(setting, data):
    x, y = data
    model = nested_model()
    CALLS.clear()
    train(model, x[:16], y[:16], recompute=setting)
    return dict(CALLS)


def test_the_inner_block_replays_inside_the_outer_replay(data):
    """Traced once each: the forward, the outer block's replay, and (when
    it is chosen too) the inner block's own replay."""
    outer_only = _traced_calls(["outer_0"], data)
    both = _traced_calls(["outer_0", "inner_0a"], data)
    assert outer_only["inner_0a"] == 2 and outer_only["inner_0b"] == 2
    assert both["inner_0a"] == 3 and both["inner_0b"] == 2
    assert both["inner_1a"] == 1  # not chosen, outside any chosen block


class _Wrapping(keras.layers.Layer):
    """A `Recompute`d block (of `policy`; `None`: the plain block) and a
    Dense of its own."""

    def __init__(self, policy="full", **kwargs):
        super().__init__(**kwargs)
        block = ResBlock(name="inner", rate=0.3)
        block.build((None, WIDTH))
        self.inner = block if policy is None else recompute.Recompute(block, policy=policy)
        self.dense = keras.layers.Dense(WIDTH)

    def call(self, x, training=None):
        return self.dense(self.inner(x, training=training))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_the_recompute_wrapper_nests(data, policy):
    """`Recompute` around a layer holding a `Recompute`d layer (recomputed
    fully or selectively inside the outer replay): the same gradients as
    the plain layers (the inner weights' gradients pass through the outer
    replay)."""
    keras.utils.set_random_seed(0)
    outer = _Wrapping(policy, name="wrapping")
    wrapped = recompute.Recompute(outer)
    h = tf.constant(np.random.default_rng(0).normal(size=(16, WIDTH)), tf.float32)
    outer(h)

    @tf.function
    def gradients(fn):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fn(h, training=True) ** 2)
        return tape.gradient(loss, outer.trainable_variables)

    seeds = [np.asarray(v) for v in outer.non_trainable_variables]
    def plain(h, training):  # the same layers, no recompute at all
        return outer.dense(outer.inner.layer(h, training=training))

    expected = gradients(plain)
    for v, value in zip(outer.non_trainable_variables, seeds):  # the same masks
        v.assign(value)
    got = gradients(wrapped)
    assert len(outer.trainable_variables) == 8
    for e, g, v in zip(expected, got, outer.trainable_variables):
        assert g is not None, v.path
        np.testing.assert_allclose(e, g, rtol=1e-5, atol=1e-6, err_msg=v.path)


def _wrapping_model(policy):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(WIDTH, name="stem")(inputs)
    h = _Wrapping(policy, name="wrapping")(h)
    return GradBoostModel(inputs, keras.layers.Dense(3, name="head")(h))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_selective_recompute_inside_a_chosen_block_equals_no_recompute(data, jit_compile):
    """`compile(recompute=[...])` chooses the block holding a
    `Recompute(policy="selective")`: weights, Dropout seeds and
    BatchNormalization statistics after `fit` equal the plain layers'."""
    x, y = data
    plain, nested = _wrapping_model(None), _wrapping_model("selective")
    train(plain, x, y, jit_compile=jit_compile)
    train(nested, x, y, jit_compile=jit_compile, recompute=["wrapping"])
    assert_same_state(plain, nested, atol=1e-5 if jit_compile else 1e-6)


def test_a_selective_block_inside_a_full_replay_runs_no_matmul_again(data):
    """A `Recompute(policy="selective")` inside a fully recomputed block
    keeps its kernel outputs from the outer replay: its own replay runs
    none of its matmuls again. Counted on the traced step's live backward
    against no recompute: the outer replay runs the inner `up` and `down`
    (the outer `dense`'s kernel gradient reads their result); a full inner
    replay runs `up` once more (gelu's gradient and `down`'s read its
    output), a selective one nothing."""
    from keras_gradboost.recompute import estimates

    matmuls = {}
    for policy in (None, "full", "selective"):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((WIDTH,))
        wrapping = _Wrapping(policy, name="wrapping")
        wrapping(tf.zeros((16, WIDTH)))  # built by a call, as a user's layer is
        h = (wrapping if policy is None else recompute.Recompute(wrapping))(inputs)
        model = GradBoostModel(inputs, keras.layers.Dense(3, name="head")(h))
        spec = tf.TensorSpec((16, WIDTH), tf.float32)
        operations, _ = estimates.live_backward(model, lambda v, _: model(v, training=True), spec)
        matmuls[policy] = sum(op.type in ("MatMul", "_FusedMatMul") for op in operations)
    assert matmuls["full"] == matmuls[None] + 3, matmuls
    assert matmuls["selective"] == matmuls[None] + 2, matmuls


def _ancestors(op):
    """The operations `op` waits for (data and control inputs), transitively."""
    seen, pending = set(), [op]
    while pending:
        current = pending.pop()
        for up in [t.op for t in current.inputs] + list(current.control_inputs):
            if up not in seen:
                seen.add(up)
                pending.append(up)
    return seen


def test_an_inner_replay_waits_for_the_inner_forward_in_the_outer_replay():
    """In the outer block's replay the upstream gradient of a nested block
    can arrive before that block's forward there has finished (a Dense
    after it passes the gradient to its input without reading its
    activations): unless its replay waits for that forward's outputs too,
    TensorFlow runs the two at once and both copies of its activations are
    alive (keras-hub GPT-2, "auto" nesting its feed-forward blocks: 82.1
    MiB requested against 67.1 once the replay waits). In the traced step
    the inner block's `up` matmul runs twice in the backward (the outer
    replay, the inner replay): the second must depend on the first."""
    from keras_gradboost.recompute import estimates

    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    wrapping = _Wrapping("full", name="wrapping")
    wrapping(tf.zeros((16, WIDTH)))
    model = GradBoostModel(
        inputs, keras.layers.Dense(3, name="head")(recompute.Recompute(wrapping)(inputs))
    )
    spec = tf.TensorSpec((16, WIDTH), tf.float32)
    operations, _ = estimates.live_backward(model, lambda v, _: model(v, training=True), spec)
    ups = [  # the inner block's `up`: (16, WIDTH) @ (WIDTH, 2 * WIDTH)
        op for op in operations
        if op.type == "MatMul" and op.inputs[0].shape == (16, WIDTH)
        and op.inputs[1].shape == (WIDTH, 2 * WIDTH)
        and not op.get_attr("transpose_a") and not op.get_attr("transpose_b")
    ]
    assert len(ups) == 2, [op.name for op in ups]
    first, second = ups
    assert first in _ancestors(second) or second in _ancestors(first)


class _Tail(keras.layers.Layer):
    """A Dense of its own, then a (`Recompute`d, with `policy`) block last:
    what follows it in the outer replay (nothing) reads none of its values."""

    def __init__(self, policy="full", **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(WIDTH)
        block = ResBlock(name="inner", rate=0.3)
        block.build((None, WIDTH))
        self.inner = block if policy is None else recompute.Recompute(block, policy=policy)

    def call(self, x, training=None):
        return self.inner(self.dense(x), training=training)


def test_an_inner_block_last_in_its_outer_block_runs_once_in_its_replay():
    """The replay of an inner block waits for its forward in the outer
    replay only where the backward reads that forward: at the end of the
    outer block nothing does, TensorFlow prunes it, and the inner block's
    own replay is its only run there. Live matmuls of the traced step's
    backward: as many as without the inner recompute (9; waiting for the
    forward always made it 11, the inner `up` and `down` once more)."""
    from keras_gradboost.recompute import estimates

    matmuls = {}
    for policy in (None, "full"):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((WIDTH,))
        tail = _Tail(policy, name="tail")
        tail(tf.zeros((16, WIDTH)))
        model = GradBoostModel(
            inputs, keras.layers.Dense(3, name="head")(recompute.Recompute(tail)(inputs))
        )
        spec = tf.TensorSpec((16, WIDTH), tf.float32)
        operations, _ = estimates.live_backward(model, lambda v, _: model(v, training=True), spec)
        matmuls[policy] = sum(op.type in ("MatMul", "_FusedMatMul") for op in operations)
    assert matmuls["full"] == matmuls[None] == 9, matmuls


class _Tied(keras.layers.Layer):
    """Reads a weight of another layer, untracked (a tied projection)."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self._source = lambda: source.kernel  # not tracked: not its weight

    def call(self, x):
        return tf.matmul(x, self._source())


class _Holder(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(WIDTH, name="dense")
        self.tied = _Tied(self.dense, name="tied")

    def call(self, x):
        return self.tied(self.dense(x))


def test_an_inner_block_reading_another_layers_weight_is_refused(data):
    x, y = data
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    model = GradBoostModel(inputs, keras.layers.Dense(3)(_Holder(name="holder")(inputs)))
    model.compile(optimizer="sgd", loss="mse", recompute=["holder", "tied"])
    xs = np.tile(x[:16], 2)[:, :WIDTH]
    with pytest.raises(ValueError, match=r"'tied'.*tied weights"):
        model.fit(xs, y[:16], batch_size=16, epochs=1, verbose=0)


def test_the_plan_names_nested_blocks_and_counts_them_inside(data):
    """The estimate places each inner block under its outer one (traced
    call ranges): the plan names it by both, and recomputing the inner
    blocks too lowers the estimated peak below the outer blocks alone."""
    x, y = data

    def plan(setting):
        model = nested_model()
        model.compile(optimizer="sgd", loss="mse", recompute=setting)
        return model.recompute_plan(batch_size=64)

    outer = plan(["outer_*"])
    nested = plan(["outer_*", "inner_*"])
    names = [b.name for b in nested.blocks]
    assert "outer_0/inner_0a" in names and "outer_1/inner_1b" in names, names
    assert nested.bytes_with < outer.bytes_with
    # The outer blocks' rows are the same in both plans.
    rows = {b.name: b.cached_bytes for b in nested.blocks}
    assert all(rows[b.name] == b.cached_bytes for b in outer.blocks)


class _DenseDrop(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(WIDTH, activation="gelu")
        self.drop = keras.layers.Dropout(0.5, seed=7)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x, training=None):
        return self.drop(self.dense(x), training=training)


class _SharedTwice(keras.layers.Layer):
    """A `Recompute`d Dropout block called twice: two different masks."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        block = _DenseDrop(name="dense_drop")
        block.build((None, WIDTH))
        self.shared = recompute.Recompute(block)

    def call(self, x, training=None):
        return self.shared(self.shared(x, training=training), training=training)


class _Outer3(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.twice = _SharedTwice(name="twice")
        self.dense = keras.layers.Dense(WIDTH)

    def call(self, x, training=None):
        return self.dense(self.twice(x, training=training))


def test_three_levels_with_a_shared_dropout_block(data):
    """A `Recompute`d Dropout block called twice inside a chosen block
    nested in another: each call reads the seed its forward read (the
    nested replay's own scope), so the two masks differ as in the forward
    and training equals the same model without `compile`'s recompute."""
    x, y = data

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        h = keras.layers.Dense(WIDTH, name="stem")(inputs)
        h = _Outer3(name="outer3")(h)
        return GradBoostModel(inputs, keras.layers.Dense(3, name="head")(h))

    plain, nested = model(), model()
    train(plain, x, y)
    train(nested, x, y, recompute=["outer3", "twice"])
    assert_same_state(plain, nested)


def test_recompute_check_checks_the_nested_replays(data):
    """recompute_check=True on a nested plan passes, and trains exactly as
    no recompute."""
    x, y = data
    plain, checked = nested_model(), nested_model()
    train(plain, x, y)
    train(checked, x, y, recompute=["outer_0", "inner_0b"], recompute_check=True)
    assert checked._gradboost.recompute_check_pending is False
    assert_same_state(plain, checked)


def test_recompute_check_names_a_nested_replay_that_differs(data, monkeypatch):
    """A fault planted in the nested path only (a block recomputed inside
    another's replay): each block recomputed alone agrees, so only the
    nested comparison can catch it, and it names the outer and inner
    blocks."""
    from keras_gradboost import RecomputeCheckError
    from keras_gradboost.recompute import mechanism

    original = mechanism._recomputed_in_replay

    def off_by_one_percent(*args, **kwargs):
        call = original(*args, **kwargs)
        return lambda *a, **k: tf.nest.map_structure(lambda t: t * 1.01, call(*a, **k))

    monkeypatch.setattr(mechanism, "_recomputed_in_replay", off_by_one_percent)
    x, y = data
    model = nested_model()
    before = model.get_weights()
    with pytest.raises(RecomputeCheckError) as info:
        train(model, x, y, recompute=["outer_0", "inner_0b"], recompute_check=True)
    message = str(info.value)
    assert "block 'outer_0' with the block(s) 'outer_0/inner_0b'" in message
    assert info.value.block == "outer_0" and info.value.difference > 0
    assert info.value.inner == ["outer_0/inner_0b"]
    for a, b in zip(before, model.get_weights()):  # nothing trained
        np.testing.assert_array_equal(a, b)


class _TiedBlock(keras.layers.Layer):
    """Holds a Dense of its own and reads its holder's Dense kernel,
    untracked (a tied projection)."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.own = keras.layers.Dense(WIDTH, activation="gelu", name="own")
        self._source = lambda: source.kernel

    def call(self, x):
        return self.own(tf.matmul(x, self._source()))


class _TiedHolder(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(WIDTH, activation="gelu", name="dense")
        self.tied = _TiedBlock(self.dense, name="tied")

    def call(self, x):
        return self.tied(self.dense(x)) + x


def test_auto_leaves_out_an_inner_block_reading_its_holders_weight(data):
    """With two blocks "auto" also weighs the blocks inside them; one that
    reads a weight of another layer of its holder cannot recompute inside
    the holder's replay (the refusal above), so "auto" must not choose it:
    it chose `h0` with `h0/tied` inside, and `fit` raised. Now it trains,
    exactly as no recompute."""

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((WIDTH,))
        h = _TiedHolder(name="h1")(_TiedHolder(name="h0")(inputs))
        return GradBoostModel(inputs, keras.layers.Dense(3, name="head")(h))

    x, y = data
    xs = np.tile(x, 2)[:, :WIDTH]
    plain, auto = model(), model()
    train(plain, xs, y)
    train(auto, xs, y, recompute="auto")
    plan = auto.recompute_plan(batch_size=16)
    assert plan.recomputed, str(plan)
    assert not any(row.name.endswith("/tied") and row.recomputed for row in plan.blocks)
    assert_same_state(plain, auto)

    # The trace finds exactly the two tied blocks among the nested family's.
    from keras_gradboost.recompute.estimates import tied_inner_blocks

    probe = model()
    setup = recompute.RecomputeSetup(probe, ["h0", "h1", "tied", "dense", "own"])
    setup.apply()
    spec = tf.TensorSpec([16, WIDTH], tf.float32)
    _, per_block, _ = setup._estimate(probe, spec)
    names = setup.names()
    assert sorted(names[k] for k in tied_inner_blocks(per_block)) == ["h0/tied", "h1/tied"]


class _Branches(keras.layers.Layer):
    """Two inner blocks, one after the other (`x + b(a(x))`), side by side
    (`x + a(x) + b(x)`, a parallel residual), or one twice (`a(a(x))`)."""

    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        self.a = ResBlock(name="branch_a", rate=0.0)
        self.b = ResBlock(name="branch_b", rate=0.0)

    def build(self, input_shape):
        self.a.build(input_shape)
        self.b.build(input_shape)

    def call(self, x, training=None):
        if self.kind == "sequence":
            return x + self.b(self.a(x, training=training), training=training)
        if self.kind == "parallel":
            return x + self.a(x, training=training) + self.b(x, training=training)
        return self.a(self.a(x, training=training), training=training)


@pytest.mark.parametrize("kind", ["sequence", "parallel", "shared"])
def test_a_nested_moment_keeps_what_does_not_come_from_the_nested_block(kind):
    """When the backward reaches a nested block, its parent's activations
    made from it are freed; those of a branch beside it (a parallel
    residual) may still be alive, and everything is, between two calls of
    a block called twice: there the figures stay out and every activation
    of the parent counts, as before."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    outer = _Branches(kind, name="outer")
    model = GradBoostModel(inputs, keras.layers.Dense(3, name="head")(outer(inputs)))
    model.compile(optimizer="sgd", loss="mse", recompute=["outer", "branch_*"])
    setup = model._gradboost.recompute
    _, per_block, _ = setup._estimate(model, tf.TensorSpec((16, WIDTH), tf.float32))
    names = setup.names()
    figures = {names[key]: f for key, f in per_block.items()}
    a, b = figures["outer/branch_a"], figures.get("outer/branch_b")
    if kind == "shared":
        assert "parent_before" not in a
        return
    if kind == "sequence":  # a's output, which b's Dense keeps, comes from a
        assert a["parent_outputs"] > 0 and a["parallel"] == []
        assert b["parent_before"] >= a["parent_outputs"]
    else:  # b, beside a, does not come from it
        assert a["parallel"] == [id(outer.b)]
    assert b["parallel"] == []
