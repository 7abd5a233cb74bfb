"""Finding the layer that produced the first non-finite value of a step.

The batch is replayed eagerly: every layer's `call` is wrapped (on the
instance with `wrappers.patch`, over what is there, for the replay only) to
record its inputs and outputs in execution order,
`tf.debugging.check_numerics` style. The producer is the first layer
whose output is non-finite although its inputs are finite (a layer that only
passes a NaN on is a propagator, not the producer). If the forward pass is
finite, the backward pass is searched the same way from the loss down.
"""

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost import wrappers
from keras_gradboost.op_advice import layer_advice
from keras_gradboost.state import every_copy


@dataclasses.dataclass
class Finding:
    """Where a replayed step first went non-finite.

    Attributes:
        phase: "forward", "loss", "backward", or None if the replay was finite.
        layer: the name of the producing layer (its path, e.g.
            `"encoder/block_1/mlp/dense_1"`, where another layer of the model
            has the same name, as each block of a keras-hub backbone does),
            or None.
        variables: paths of trainable variables with non-finite gradients.
        detail: one sentence saying what was seen.
        advice: which `kgb.ops` the producing layer could use, from the
            ops its call runs ("" when none applies).
    """

    phase: object = None
    layer: object = None
    variables: tuple = ()
    detail: str = ""
    advice: str = ""


def _floats(structure):
    return [
        t
        for t in tf.nest.flatten(structure)
        if isinstance(t, (tf.Tensor, tf.Variable, np.ndarray))
        and tf.as_dtype(t.dtype).is_floating
    ]


def _finite(tensors):
    return all(bool(tf.reduce_all(tf.math.is_finite(t))) for t in tensors if t is not None)


def as_local_batch(data, strategy):
    """Concatenates per-replica batch parts into one batch."""

    def local(v):
        if isinstance(v, tf.distribute.DistributedValues):
            return tf.concat(strategy.experimental_local_results(v), axis=0)
        return v

    return tf.nest.map_structure(local, data)


def record_calls(layers, records):
    """Wraps each layer's `call` (with `wrappers.patch`, over what is there)
    to append `(layer, float inputs, float outputs)` to `records` as each
    call completes.

    Returns:
        The undo of each wrapper, in the order of `layers`.
    """

    def recording(layer):
        def call(original, *args, **kwargs):
            outputs = original(*args, **kwargs)
            records.append((layer, _floats((args, kwargs)), _floats(outputs)))
            return outputs

        return call

    return [wrappers.patch(layer, "call", recording(layer)) for layer in layers]


def locate_nonfinite(model, data):
    """Replays one training batch eagerly and finds where it went non-finite.

    The model's state is left as it was: non-trainable variables (e.g.
    BatchNormalization statistics) and metric variables are restored after
    the replay, and no weight is updated.

    Args:
        model: a compiled Keras model.
        data: one batch as `fit` sees it: `x`, `(x, y)` or
            `(x, y, sample_weight)`.

    Returns:
        A `Finding`.
    """
    data = as_local_batch(data, model.distribute_strategy)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    # Every layer, nested ones too. Calls complete innermost first, so the
    # first record with finite inputs and a non-finite output is the
    # innermost layer that produced it (a block computing `log` itself is
    # named, not the Dense inside it).
    layers = hooks.flatten_layers(model, include_self=False)
    records = []  # (layer, inputs, outputs), in the order calls complete

    saved = every_copy(hooks.forward_state(model), model.distribute_strategy)
    undos = record_calls(layers, records)
    try:
        with tf.GradientTape(persistent=True) as tape:
            for t in _floats(x):
                if isinstance(t, tf.Tensor):
                    tape.watch(t)
            with hooks.collecting_losses(keep=True) as added:  # `add_loss` calls
                if hooks.call_has_training_arg(model):
                    y_pred = model(x, training=True)
                else:
                    y_pred = model(x)
            loss = None
            if _has_a_loss(model):
                loss = hooks.compute_loss(model, x, y, y_pred, sample_weight, training=True)
        finding = _analyse(model, records, y_pred, loss, tape, added)
    finally:
        for undo in reversed(undos):
            undo()
        for copy, value in saved:
            copy.assign(value)
        del tape
    if finding.layer is not None:
        # Traced once more, now that the recording wrappers are gone.
        for layer, inputs, _ in records:
            if _label(layer, records) == finding.layer:
                finding.advice = layer_advice(layer, inputs)
                break
    return finding


def _label(layer, records):
    """How a finding names `layer`: its name, or its path (Keras'
    `layer.path`, from the outermost layer that holds it) where another
    layer of the replay has the same name; keras-hub backbones name the
    layers of every block alike (`dense_1` in each transformer block)."""
    namesakes = {id(other) for other, _, _ in records if other.name == layer.name}
    if len(namesakes) > 1 and getattr(layer, "path", None):
        return layer.path
    return layer.name


def _has_a_loss(model):
    """Whether the replay can compute the loss: compiled with one, or an own
    `compute_loss` (a train_step of its own may compute its losses itself,
    with no loss compiled)."""
    if getattr(model, "loss", None) is not None:
        return True
    definer = next(c for c in type(model).__mro__ if "compute_loss" in vars(c))
    return not definer.__module__.startswith(("keras.", "keras_gradboost."))


def _analyse(model, records, y_pred, loss, tape, added=()):
    """The `Finding` of a replay: forward first, then the losses layers add
    (`added`: `(layer, loss)` of their `add_loss` calls), then the loss,
    then the backward pass from the loss down (no loss: the forward
    only)."""
    finding = _forward_finding(records, y_pred)
    if finding is not None:
        return finding
    for layer, added_loss in added:
        if not _finite([added_loss]):
            return Finding(
                "loss", _label(layer, records),
                detail="the model's outputs are finite, but a loss this layer adds "
                "(`add_loss`, or its activity regularizer) is not",
            )
    if loss is None:
        return Finding(
            "loss", None,
            detail="the model's outputs are finite; it has no compiled loss "
            "(its own train_step computes it), so the replay could go no "
            "further than the forward pass",
        )
    if not _finite([loss]):
        return Finding("loss", None, detail="the model's outputs are finite but the loss is not")
    return _backward_finding(model, records, loss, tape)


def _forward_finding(records, y_pred):
    """The forward producer (the first layer with finite inputs and a
    non-finite output), or what else made the output non-finite; None when
    the forward pass is finite."""
    first_bad = None
    for layer, inputs, outputs in records:
        if _finite(outputs):
            continue
        if _finite(inputs):
            label = _label(layer, records)
            return Finding(
                "forward",
                label,
                detail=f"layer '{label}' produced a non-finite output from finite inputs",
            )
        first_bad = first_bad or layer
    if first_bad is not None:
        return Finding(
            "forward",
            None,
            detail=f"a non-finite value reached layer '{_label(first_bad, records)}' "
            "from its input: the data, or an operation that is not a layer",
        )
    if not _finite(_floats(y_pred)):
        return Finding(
            "forward",
            None,
            detail="every layer's output is finite but the model's output is "
            "not: an operation that is not a layer produced it",
        )
    return None


def _backward_finding(model, records, loss, tape):
    """From the loss down: the innermost layer whose output gradient is
    finite but whose input or weight gradient is not (a block containing
    such a layer qualifies too)."""
    variables = model.trainable_variables
    var_grads = tape.gradient(loss, variables)
    bad_vars = tuple(
        v.path for v, g in zip(variables, var_grads) if g is not None and not _finite([g])
    )
    candidates = []
    for layer, inputs, outputs in reversed(records):
        out_grads = tape.gradient(loss, outputs) if outputs else []
        in_grads = tape.gradient(loss, inputs) if inputs else []
        own = [
            g
            for v, g in zip(variables, var_grads)
            if any(v is w for w in layer.trainable_variables)
        ]
        if _finite(out_grads) and not (_finite(in_grads) and _finite(own)):
            candidates.append(layer)
    for layer in candidates:
        inner = hooks.flatten_layers(layer, include_self=False)
        if not any(c is not layer and c in inner for c in candidates):
            label = _label(layer, records)
            return Finding(
                "backward",
                label,
                bad_vars,
                detail=f"the gradient turned non-finite inside layer '{label}' "
                "(its output gradient is finite)",
            )
    if bad_vars:
        return Finding("backward", None, bad_vars, detail="non-finite variable gradients")
    return Finding(detail="the replayed step was finite")
