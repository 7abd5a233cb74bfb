"""`recompute_check=True`: gradients with each block recomputed must equal
the gradients without recompute, on the first training batch; and so must
each block that holds chosen blocks, recomputed with them (nested)."""

import contextlib
import logging

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import gradient_diff
from keras_gradboost import hooks
from keras_gradboost.guard import gradient_array
from keras_gradboost.recompute import mechanism


class RecomputeCheckError(RuntimeError):
    """Raised when a recomputed block changes the gradients.

    Attributes:
        block: name of the block.
        variable: path of the variable whose gradient differs most.
        difference: the largest absolute difference (inf when a gradient is
            None on one side only).
        inner: the names of the chosen blocks recomputed inside `block`'s
            replay in the comparison that failed (empty: `block` alone).
    """

    def __init__(self, message, block, variable, difference, inner=()):
        super().__init__(message)
        self.block = block
        self.variable = variable
        self.difference = difference
        self.inner = list(inner)


def check(model, setup, batch, rtol=None):
    """Compares gradients without recompute and with each block recomputed
    (then each block holding chosen blocks, recomputed with them).

    Runs once, on `batch`, without changing any variable: moving statistics,
    seed-generator states and metrics are read through a `StatelessScope`,
    so both passes see the same state and nothing is committed.

    Args:
        model: the GradBoostModel.
        setup: its `RecomputeSetup`.
        batch: one (local) training batch.
        rtol: tolerance relative to each gradient's largest magnitude.
            Defaults to 1e-5 in float32 and 1e-2 with a mixed policy.

    Raises:
        RecomputeCheckError: naming the first block that changes a gradient.
    """
    with _graph_rewrites_off(), _quiet_retracing():
        _check(model, setup, batch, rtol)


@contextlib.contextmanager
def _quiet_retracing():
    """Leaves out TensorFlow's warnings that the check's functions
    "triggered tf.function retracing" while it traces one per block (from
    the fifth block on), with advice about the user's code that does not
    apply: the check traces each on purpose, once. Other messages pass."""
    logger = tf.get_logger()
    quiet = _Without("triggered tf.function retracing")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _Without(logging.Filter):
    """Drops the log records whose message holds `text`."""

    def __init__(self, text):
        super().__init__()
        self.text = text

    def filter(self, record):
        return self.text not in record.getMessage()


@contextlib.contextmanager
def _graph_rewrites_off():
    """Grappler off while the check's functions are made and run (a
    process-wide option, set back after; the check runs before the first
    training step, and a function another thread first calls meanwhile
    would run without grappler too). Grappler fuses ops (a MatMul with
    its BiasAdd and activation) only where the backward does not need what
    is between them, so the graphs with and without a recompute round
    differently: about 1e-8 in float32 and 0.4% in bfloat16, which a small
    batch's BatchNormalization amplifies, and `recompute_check` then blamed
    blocks that repeat their forward exactly (a keras-hub Gemma and ViT in
    mixed_bfloat16, MobileNetV3Small at 32x32). Without it both graphs run
    the same kernels, and a block that repeats its forward gives the same
    gradients bit for bit."""
    previous = tf.config.optimizer.get_experimental_options().get(
        "disable_meta_optimizer", False
    )
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": previous})


def _check(model, setup, batch, rtol):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    if rtol is None:
        rtol = 1e-5 if model.dtype_policy.compute_dtype == "float32" else 1e-2
    state = mechanism.snapshot(model.non_trainable_variables + model.metrics_variables)
    variables = model.trainable_variables

    def gradients(only):
        def run(x, y, sample_weight):
            # Losses the layers add (`add_loss`) are part of the loss, as in
            # the train step; a scope drops them unless it collects them.
            with keras.StatelessScope(state_mapping=state, collect_losses=True):
                with tf.GradientTape() as tape:
                    y_pred = setup.forward(model, x, only=only)
                    loss = hooks.compute_loss(
                        model, x, y, y_pred, sample_weight, training=True
                    )
            return tape.gradient(loss, variables)

        grads = tf.function(run, autograph=False)(x, y, sample_weight)
        return [None if g is None else gradient_array(g) for g in grads]

    reference = gradients(())
    names = setup.names()
    for key in sorted(setup.chosen, key=setup.keys.index):
        found = gradient_diff.differing(variables, reference, gradients((key,)), rtol)
        path, difference = found[0] if found else (None, 0.0)
        if path is not None:
            raise RecomputeCheckError(
                f"recompute_check: recomputing block {names[key]!r} changes "
                f"the gradient of {path!r} (largest difference "
                f"{difference:.3g}; a None gradient on one side counts as inf). "
                "The block's second forward pass does not repeat the first: "
                "typical causes are random ops that do not use a Keras "
                "seed generator (tf.random.* instead of keras.random.* with a "
                "SeedGenerator, or keras.layers.Dropout), state changed in "
                "Python during call(), or a frozen input whose gradient is "
                "None. Fix the block, or leave it out of `recompute`.",
                names[key],
                path,
                difference,
            )
    # Each block alone replays plain inside; a chosen block inside another
    # is replayed as a recomputed block within the outer block's replay
    # (a third forward of it, with its state read from the outer scope):
    # that path is checked with the outer block and all it holds.
    for key, inner in _nested(setup):
        found = gradient_diff.differing(
            variables, reference, gradients((key, *inner)), rtol
        )
        path, difference = found[0] if found else (None, 0.0)
        if path is not None:
            held = ", ".join(repr(names[k]) for k in inner)
            raise RecomputeCheckError(
                f"recompute_check: recomputing block {names[key]!r} with the "
                f"block(s) {held} recomputed inside its replay changes the "
                f"gradient of {path!r} (largest difference {difference:.3g}; "
                "a None gradient on one side counts as inf), while each block "
                "recomputed alone does not: the inner blocks' third forward "
                "pass, inside the outer replay (which reads their state and "
                "weights from the outer replay's scope), does not repeat the "
                "first. Leave the outer block or the inner ones out of "
                "`recompute`, and report it: nested recompute is meant to be "
                "exact.",
                names[key],
                path,
                difference,
                inner=[names[k] for k in inner],
            )


def _nested(setup):
    """`(key, inner keys)` of each chosen block holding chosen blocks (as
    Keras tracks them: a chosen block called inside another that does not
    track it is not grouped with it), in model order."""
    if setup.segments or setup.selective:  # segments do not nest; nor does selective
        return []
    chosen = [layer for layer in setup.layers if id(layer) in setup.chosen]
    groups = []
    for layer in chosen:
        below = {id(l) for l in hooks.flatten_layers(layer, include_self=False)}
        inner = tuple(id(l) for l in chosen if id(l) in below)
        if inner:
            groups.append((id(layer), inner))
    return groups
