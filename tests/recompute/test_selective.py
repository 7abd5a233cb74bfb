"""Selective recompute (`recompute={"policy": "selective"}`): the kernel
layers' outputs are kept, the rest replays; weights, Dropout masks and
BatchNormalization statistics equal no recompute; the replay runs no matmul
of the forward; a block whose replay takes another path is refused."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from conftest import grappler
from keras_gradboost import GradBoostModel
from keras_gradboost.recompute import estimates
from recompute.models import WIDTH
from recompute.models import ResBlock
from recompute.models import assert_same_state
from recompute.models import residual_model
from recompute.models import train

SELECTIVE = {"policy": "selective"}


# Weights, Dropout seeds and BatchNormalization statistics equal no
# recompute's: test_mechanism's test_weights_and_statistics_equal_no_recompute,
# with the selective settings (under XLA the one limited to a block; the
# whole-model policy under XLA in a cell of tests/test_interactions.py).


@pytest.mark.filterwarnings("ignore:accumulate_steps=3. the BatchNormalization")
def test_with_accumulation_mixed_precision_and_a_shared_block(data):
    x, y = data
    plain, selective = residual_model(), residual_model()
    train(plain, x, y, epochs=2, accumulate_steps=3, precision="mixed_bfloat16")
    train(selective, x, y, epochs=2, accumulate_steps=3, precision="mixed_bfloat16",
          recompute=SELECTIVE)
    assert selective.get_layer("res_0").up.compute_dtype == "bfloat16"
    assert_same_state(plain, selective)

    plain, selective = residual_model(shared=True), residual_model(shared=True)
    train(plain, x, y)
    train(selective, x, y, recompute={"policy": "selective", "blocks": ["res_shared"]})
    assert_same_state(plain, selective)


def _step_graph(model, x):
    """The live backward operations of one traced training step as the
    model's plan runs it, and the forward tensors they keep."""
    model._prepare_forward(tf.constant(x))
    setup = model._gradboost.recompute
    spec = tf.TensorSpec((16,) + x.shape[1:], tf.float32)
    if setup is None:
        return estimates.live_backward(model, lambda v, _: model(v, training=True), spec)
    return estimates.live_backward(model, lambda v, _: setup.forward(model, v), spec)


def _matmuls(operations):
    return sum(op.type in ("MatMul", "_FusedMatMul") for op in operations)


def test_the_replay_runs_no_matmul_and_keeps_less_than_no_recompute(data):
    # The independent reference is the step without recompute: its backward
    # runs two matmuls per Dense (the gradients of input and kernel). Full
    # recompute adds the forward matmul of each block's `up` (whose output
    # gelu's gradient and `down`'s need; `down`'s own output feeds only the
    # residual add, so its replay is dead code even there); selective
    # recompute must add none, and keep more than full recompute (the kept
    # outputs) but less than none.
    x, y = data
    models = {}
    for name, setting in [("none", None), ("full", ["res_*"]), ("selective", SELECTIVE)]:
        model = residual_model(rate=0.0)
        model.compile(optimizer="sgd", loss="mse", recompute=setting)
        models[name] = _step_graph(model, x)
    matmuls = {name: _matmuls(ops) for name, (ops, _) in models.items()}
    kept = {
        name: sum(estimates._bytes(t) for t in tensors.values())
        for name, (_, tensors) in models.items()
    }
    assert matmuls["selective"] == matmuls["none"], matmuls
    assert matmuls["full"] == matmuls["none"] + 3, matmuls  # the 3 blocks' `up`s
    assert kept["full"] < kept["selective"] < kept["none"], kept


def test_the_activation_is_split_off_and_put_back(data):
    # The kept output of `up` (gelu) is the one before its activation, which
    # the replay applies again; the layer keeps its activation and config.
    x, y = data
    model = residual_model()
    config = model.get_layer("res_0").up.get_config()
    train(model, x, y, recompute=SELECTIVE)
    up = model.get_layer("res_0").up
    assert up.activation is keras.activations.gelu
    assert up.get_config() == config


class TwiceDense(keras.layers.Dense):
    """A Dense subclass with a `call` of its own: kept whole (its output
    after its activation), still exact."""

    def call(self, inputs, training=None):
        return 2.0 * super().call(inputs)


class SubclassBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = TwiceDense(2 * WIDTH, activation="gelu")
        self.down = keras.layers.Dense(WIDTH)

    def build(self, input_shape):
        self.up.build(input_shape)
        self.down.build(tuple(input_shape[:-1]) + (2 * WIDTH,))

    def call(self, x):
        return x + self.down(keras.ops.tanh(self.up(x)))


def _model_with(block_factory):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(WIDTH, name="stem")(inputs)
    h = block_factory()(h)
    return GradBoostModel(inputs, keras.layers.Dense(3, name="head")(h))


def test_a_kernel_layer_subclass_with_its_own_call_stays_exact(data):
    x, y = data
    plain = _model_with(lambda: SubclassBlock(name="blk"))
    selective = _model_with(lambda: SubclassBlock(name="blk"))
    train(plain, x, y)
    train(selective, x, y, recompute=SELECTIVE)
    assert_same_state(plain, selective)


class Wandering(keras.layers.Layer):
    """Calls its two Dense layers in turn, call by call: a Python state that
    changes between the forward and the replay."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a, self.b = keras.layers.Dense(WIDTH), keras.layers.Dense(WIDTH)
        self.calls = 0

    def build(self, input_shape):
        self.a.build(input_shape)
        self.b.build(input_shape)

    def call(self, x):
        self.calls += 1
        return (self.a if self.calls % 2 else self.b)(x)


def test_a_block_whose_replay_takes_another_path_is_refused(data):
    x, y = data
    model = _model_with(lambda: Wandering(name="wander"))
    with pytest.raises(RuntimeError, match=r"block 'wander'.*recompute it fully"):
        train(model, x, y, recompute={"policy": "selective", "blocks": ["wander"]})


class NormBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization()

    def build(self, input_shape):
        self.norm.build(input_shape)

    def call(self, x):
        return x + self.norm(x)


def test_blocks_without_kernel_layers_are_refused():
    model = _model_with(lambda: NormBlock(name="norm_block"))
    with pytest.raises(ValueError, match=r"\['norm_block'\].*hold none.*\"full\""):
        model.compile(
            optimizer="sgd", loss="mse",
            recompute={"policy": "selective", "blocks": ["norm_block"]},
        )


def test_plan_reports_the_selective_estimate(data):
    x, y = data
    model = residual_model(rate=0.0)
    train(model, x, y, recompute=SELECTIVE)
    plan = model.recompute_plan(batch_size=16)
    assert "selective" in str(plan)
    full = residual_model(rate=0.0)
    train(full, x, y, recompute="auto")
    full_plan = full.recompute_plan(batch_size=16)
    assert full_plan.bytes_with < plan.bytes_with < plan.bytes_without


def _ops_graph():
    """A functional graph whose residual adds are `keras.ops` nodes (no
    layers), as in keras.applications.ConvNeXt: selective "auto" recomputes
    its segments."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(WIDTH, name="stem")(inputs)
    for i in range(4):
        h = keras.ops.add(h, keras.layers.Dense(WIDTH, activation="gelu", name=f"up_{i}")(h))
    return GradBoostModel(inputs, keras.layers.Dense(3, name="head")(h))


def test_a_graph_with_operation_nodes(data):
    x, y = data
    plain, selective = _ops_graph(), _ops_graph()
    train(plain, x, y)
    train(selective, x, y, recompute=SELECTIVE)
    assert len(selective.recompute_plan().recomputed) >= 1  # segments
    assert_same_state(plain, selective)


def _selective_peak(rows, kept=0, gradients=None):
    """`selective_plan_bytes` of blocks given as rows `(key, recomputed,
    cached bytes, kernel outputs among them, weight bytes)` in the
    forward's order, nothing outside them."""
    from keras_gradboost.recompute.estimates import selective_plan_bytes

    per_block = {
        key: {"cached": cached, "kernel_cached": kernel, "weights": {f"w_{key}": weight},
              "largest": 0, "after": {}, "before": {},
              # The kernel outputs the block reads on (optional sixth).
              "kernel_kept": kept_outputs[0] if kept_outputs else kernel}
        for key, _, cached, kernel, weight, *kept_outputs in rows
    }
    total = sum(row[2] for row in rows)
    chosen = {row[0] for row in rows if row[1]}
    return selective_plan_bytes(total, per_block, chosen, kept, gradients)


def test_a_chosen_block_holds_its_kernel_outputs_until_its_replay():
    """A chosen block holds its kernel layers' outputs until the backward
    reaches it; there it has all its activations alive, and the blocks
    after it have freed theirs."""
    # Alike blocks, the one the backward meets first kept: the end of the
    # forward (20 * 3 + 60) is the peak; the replays add nothing.
    assert _selective_peak([("a", True, 60, 20, 0), ("b", True, 60, 20, 0),
                            ("c", True, 60, 20, 0), ("d", False, 60, 20, 0)]) == 120
    # A larger block first: at its replay (120) the later blocks are gone;
    # the end of the forward holds 20 + 20 + 60.
    rows = [("a", True, 120, 20, 0), ("b", True, 60, 20, 0), ("c", False, 60, 0, 0)]
    assert _selective_peak(rows) == 120
    # The selective step's own trace keeps 30 more than the figures say
    # (outputs the figures count as rebuilt): alive throughout, at the
    # replay too.
    assert _selective_peak(rows, kept=130) == 150
    # Nothing chosen: no recompute's peak, the whole forward.
    assert _selective_peak([("a", False, 60, 20, 0), ("b", False, 40, 10, 0)]) == 100


def test_a_kept_output_no_backward_reads_counts_until_the_replay():
    """A Dense before a gelu: the backward without recompute reads the
    gelu's intermediates (cached), not the Dense's output, which a
    selective replay keeps (`kernel_kept`): held until the replay, where
    the rebuilt intermediates are made from it and it is freed. (On
    ConvNeXtTiny, selective, the estimate read 129.9 MiB, 0.75 of the 97.6
    requested, when only the step's own trace counted such outputs, at
    every moment.)"""
    rows = [("a", True, 60, 0, 0, 20), ("b", True, 30, 0, 0, 25), ("c", False, 10, 0, 0)]
    # At c: 20 + 25 + 10; at b's replay: 20 + 30 (b's 25 were made into
    # those 30); at a's: 60.
    assert _selective_peak(rows) == 60
    rows[2] = ("c", False, 40, 0, 0)
    assert _selective_peak(rows) == 85  # at c: 20 + 25 + 40
    # The step's own trace keeps those 45 too: nothing left to count twice.
    assert _selective_peak(rows, kept=85) == 85


def test_the_figures_count_the_kernel_outputs_a_block_reads_on():
    """`kernel_kept` on a traced block: a Dense before a separate gelu is
    kept (its output, which the gelu's gradient does not read, is not
    cached), a last projection into the block's residual add is not, and
    neither is a Dense whose output the block only passes out through a
    concatenation (DenseNet's pattern)."""
    from keras_gradboost import GradBoostModel

    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.expand = keras.layers.Dense(4 * WIDTH, name="expand")
            self.gelu = keras.layers.Activation("gelu", name="gelu")
            self.project = keras.layers.Dense(WIDTH, name="project")
            self.side = keras.layers.Dense(WIDTH, name="side")

        def call(self, h):
            body = keras.ops.add(h, self.project(self.gelu(self.expand(h))))
            return keras.ops.concatenate([body, self.side(h)], axis=-1)

    h = Block(name="block")(inputs)
    model = GradBoostModel(inputs, keras.layers.Dense(3, name="head")(h))
    model.compile(optimizer="sgd", loss="mse", recompute={"policy": "selective",
                                                          "blocks": ["block"]})
    _, per_block, _ = model._gradboost.recompute._estimate(
        model, tf.TensorSpec((16, WIDTH), tf.float32))
    (figures,) = per_block.values()
    assert figures["kernel_kept"] == 16 * 4 * WIDTH * 4  # expand's output alone
    assert figures["kernel_cached"] < figures["kernel_kept"]


def test_the_largest_replay_and_the_largest_gradients_need_not_coincide():
    """ConvNeXtTiny's shape: large activations first, large weights last.
    The gradients of the last block's weights are gone when the backward
    reaches the first block's replay. The estimate summed the largest of
    each, 150 here; on ConvNeXtTiny (64x64, batch 16, depthwise="native")
    it read 152.7 MiB where the step requested 110.2."""
    grappler(False)  # the default set-up: gradients by moments (the fixture restores it)
    rows = [("a", True, 100, 20, 5), ("b", False, 10, 0, 50)]
    # At b: a's 20 kept, b's 10 and its weights' 50 gradients (80); at
    # a's replay: its 100 and its 5 (105).
    assert _selective_peak(rows, gradients=55) == 105


def test_kernel_outputs_are_told_from_the_rest_in_a_traced_graph():
    """`_kernel_output`: a contraction by a weight, or that plus a bias; not
    an activation, a normalisation, or a depthwise half that feeds a
    pointwise one (which the replay rebuilds)."""
    from keras_gradboost.recompute.estimates import _kernel_output

    layers = [
        keras.layers.Dense(4, activation="relu", name="dense"),
        keras.layers.Conv2D(4, 3, use_bias=False, name="nobias"),
        keras.layers.SeparableConv2D(4, 3, name="sep"),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(4, use_bias=False, name="linear"),  # into another Dense
        keras.layers.Dense(4, name="after"),
        keras.layers.Conv1D(4, 3, name="conv1d"),  # ExpandDims, Conv2D, Squeeze
        keras.layers.EinsumDense("abc,cd->abd", (None, 4), bias_axes="d", name="einsum"),
        keras.layers.Dense(4, name="dense3d"),  # on a 3-D input
    ]

    @tf.function(autograph=False)
    def run(v, x, s):
        dense, nobias, sep, norm, linear, after, conv1d, einsum, dense3d = layers
        return [dense(v), nobias(x), sep(x), norm(v), after(linear(v)), conv1d(s),
                einsum(s), dense3d(s)]

    graph = run.get_concrete_function(
        tf.TensorSpec((2, 3)), tf.TensorSpec((2, 8, 8, 3)), tf.TensorSpec((2, 6, 3))).graph
    flagged = {
        (op.name.split("/")[0].rsplit("_", 1)[0], op.type)  # "dense_1/..": dense's
        for op in graph.get_operations()
        if op.outputs and op.type != "Identity" and _kernel_output(op.outputs[0])
    }
    # dense: its bias add (not the matmul, not the relu); nobias: the
    # convolution; sep: the pointwise convolution's bias add, not the
    # depthwise half; norm: nothing; a Dense without a bias: its matmul,
    # though another Dense reads it; the others: their bias adds only (not
    # the contraction behind a reshape).
    assert flagged == {
        ("dense", "BiasAdd"), ("nobias", "Conv2D"), ("sep", "BiasAdd"), ("linear", "MatMul"),
        ("after", "BiasAdd"), ("conv1d", "BiasAdd"), ("einsum", "BiasAdd"), ("dense3d", "BiasAdd"),
    }, flagged
