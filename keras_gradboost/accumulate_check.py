"""`accumulate_check=True`: the first accumulation window's gradient must
equal the gradient of one step on its micro-batches concatenated."""

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import gradient_diff
from keras_gradboost import hooks
from keras_gradboost import wrappers
from keras_gradboost.accumulate import listed
from keras_gradboost.accumulate import loss_normaliser
from keras_gradboost.accumulate import mean_activity_loss
from keras_gradboost.accumulate import random_layers
from keras_gradboost.accumulate import reduces_like_keras
from keras_gradboost.accumulate import sample_count
from keras_gradboost.guard import gradient_array
from keras_gradboost.recompute import mechanism

class AccumulationCheckError(RuntimeError):
    """Raised when accumulating micro-batches does not give the large-batch
    gradient.

    Attributes:
        causes: what the check could identify as the reason, as short
            sentences (empty when it found none).
        variables: `(variable path, largest difference)` of the variables
            whose gradients differ most, largest first.
    """

    def __init__(self, message, causes, variables):
        super().__init__(message)
        self.causes = tuple(causes)
        self.variables = tuple(variables)


def check(model, window, rtol=None):
    """Compares the accumulated gradient of `window` with one large batch.

    Both sides are computed at the current weights, without changing any
    variable (moving statistics, seed-generator states and metrics are read
    through a `StatelessScope`). The accumulated side weights each
    micro-batch by what Keras divides its loss by (`loss_normaliser`), as
    the train step does. Random layers (a `SeedGenerator` among their
    attributes: Dropout, GaussianNoise, random augmentation) act as the
    identity on both sides (an RNN cell takes dropout 0): this check
    compares the accumulation, not the draws (training draws each
    micro-batch's rows of the large batch's Dropout masks,
    `window_dropout`).

    Args:
        model: the GradBoostModel.
        window: the window's micro-batches (local, one device).
        rtol: tolerance relative to each gradient's largest magnitude.
            Defaults to 1e-4 in float32 and 2e-2 with a mixed policy.

    Returns:
        True when checked; False when a micro-batch's gradients (or the
        large batch's) are not finite: such a window says nothing about
        the accumulation (NaNWatcher or the loss scale deals with it), and
        the next window is checked instead.

    Raises:
        AccumulationCheckError: naming the causes found and the variables
            that differ most.
    """
    if rtol is None:
        rtol = 1e-4 if model.dtype_policy.compute_dtype == "float32" else 2e-2
    variables = model.trainable_variables
    state = mechanism.snapshot(model.non_trainable_variables + model.metrics_variables)

    adding = {}  # the layers that add losses of their own, by id
    masked = []  # whether a micro-batch is weighted by a mask's entries

    def gradients(x, y, sample_weight):
        # Losses the layers add (`add_loss`) are part of the loss, as in
        # the train step; a scope drops them unless it collects them.
        with keras.StatelessScope(state_mapping=state, collect_losses=True):
            with tf.GradientTape() as tape:
                with hooks.collecting_losses(keep=True) as added:
                    y_pred = model(x, training=True)
                adding.update((id(layer), layer) for layer, _ in added)
                loss = hooks.compute_loss(model, x, y, y_pred, sample_weight, training=True)
            samples = sample_count(x)
            count, _ = loss_normaliser(y_pred, samples)
            masked.append(count is not samples)
        return tape.gradient(loss, variables), count

    run = tf.function(gradients, autograph=False)
    undo = [_without_randomness(layer) for layer in random_layers(model)]
    try:
        accumulated, total = None, 0.0
        for batch in window:
            grads, count = run(*keras.utils.unpack_x_y_sample_weight(batch))
            count = float(count)
            total += count
            weighted = [None if g is None else count * gradient_array(g, np.float64) for g in grads]
            accumulated = weighted if accumulated is None else [
                a if g is None else a + g for a, g in zip(accumulated, weighted)
            ]
        accumulated = [None if a is None else a / max(total, 1e-30) for a in accumulated]
        large, _ = run(*keras.utils.unpack_x_y_sample_weight(_concatenate(window)))
    finally:
        for patch in undo:
            patch()
    large = [None if g is None else gradient_array(g, np.float64) for g in large]
    if not all(np.isfinite(g).all() for g in large + accumulated if g is not None):
        return False
    differing = gradient_diff.differing(variables, large, accumulated, rtol)
    if differing:
        causes = _causes(model, list(adding.values()), by_samples=not any(masked))
        shown = ", ".join(f"{path!r} ({diff:.3g})" for path, diff in differing[:3])
        raise AccumulationCheckError(
            f"accumulate_check: {len(window)} accumulated micro-batches do not "
            "give the gradient of one step on them concatenated; the gradients "
            f"that differ most: {shown} (largest absolute difference; tolerance "
            f"{rtol:g} of each gradient's largest magnitude). "
            + (
                "Causes found: " + " ".join(causes)
                if causes
                else "No cause found in the layers or the loss: look for a custom "
                "loss that divides by a per-batch quantity, or a layer whose "
                "output for a sample depends on the rest of its batch."
            )
            + " Nothing was updated. Fix the cause, or train with "
            "accumulate_steps=1 and the large batch.",
            causes,
            differing,
        )
    return True


def _identity(call, inputs, *args, **kwargs):
    return inputs


def _without_randomness(layer):
    """Turns off what `layer` draws for the check, on both sides; returns
    the undo. An RNN cell, whose call must return its states too, takes
    dropout rates of 0 (read where the check traces); any other layer runs
    as the identity."""
    if not hasattr(layer, "state_size"):
        return wrappers.patch(layer, "call", _identity)
    saved = {name: getattr(layer, name) for name in ("dropout", "recurrent_dropout")
             if hasattr(layer, name)}
    for name in saved:
        setattr(layer, name, 0.0)

    def undo():
        for name, value in saved.items():
            setattr(layer, name, value)

    return undo


def _concatenate(window):
    shapes = {tuple(tuple(t.shape[1:]) for t in tf.nest.flatten(b) if t is not None)
              for b in window}
    if len(shapes) > 1:
        raise ValueError(
            "accumulate_check=True needs the window's micro-batches to have one "
            f"shape besides the batch size, to compare them with their "
            f"concatenation; these have {len(shapes)} (e.g. sequences padded "
            "per batch). Pad to one length for the check, or drop it."
        )
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *window)


def _causes(model, adding=(), by_samples=True):
    """What makes k micro-batches differ from one large batch, as far as the
    layers and the loss show it (`adding`: the layers that added losses of
    their own in the forward; `by_samples`: the micro-batches are weighted
    by their samples, not a mask's entries)."""
    causes = []
    own = [l.name for l in adding if not (by_samples and mean_activity_loss(l))]
    if own:
        causes.append(
            f"Layers add losses of their own ({listed(own, 4)}): a window averages "
            "each micro-batch's, which equals the large batch's only for a mean "
            "over samples (a mixture of experts' load-balancing loss over the "
            "batch's tokens is not one)."
        )
    layers = hooks.flatten_layers(model)
    bn = [  # a frozen one runs in inference mode
        l.name for l in layers if isinstance(l, keras.layers.BatchNormalization) and l.trainable
    ]
    if bn:
        causes.append(
            f"The BatchNormalization layers ({listed(bn, 4)}) normalise each "
            "micro-batch with its own statistics; use LayerNormalization or "
            "GroupNormalization."
        )
    for loss in tf.nest.flatten(model.loss) if model.loss is not None else []:
        if not isinstance(loss, keras.losses.Loss):
            continue
        if not reduces_like_keras(loss):
            own_call = type(loss).__call__ is not keras.losses.Loss.__call__
            causes.append(
                f"The loss {loss.name!r} ({type(loss).__name__}"
                + (", its own __call__" if own_call else f", reduction={loss.reduction!r}")
                + ") may normalise per batch; accumulation is exact for "
                'reduction="sum_over_batch_size" through Loss.call.'
            )
    random = random_layers(model)
    stateful = [
        l.name
        for l in layers
        if not hooks.child_layers(l)  # a leaf: its own state, not its children's
        and not isinstance(l, keras.layers.BatchNormalization)
        and l not in random
        and l.non_trainable_weights
    ]
    if stateful:
        causes.append(
            f"Layers with state of their own ({', '.join(map(repr, stateful[:4]))}) may "
            "compute each sample from batch-wide state."
        )
    return causes
