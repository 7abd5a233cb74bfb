"""Selective recompute: inside a recomputed block, the outputs of the layers
that multiply by a kernel (`Dense`, `EinsumDense`, the convolutions) are kept
from the forward pass, and only the rest (normalisation, activations, dropout,
softmax and the attention scores between them) runs again in the backward.

Megatron's selective recompute (Korthikanti et al., 2022, "Reducing
Activation Recomputation in Large Transformer Models", arXiv 2205.05198): the
kept matmul outputs are what is expensive to compute; what is recomputed is
cheap in FLOPs but large in memory (a softmax over the sequence, a Dropout
mask, a gelu's input and output).

How: the forward records each kernel layer's output before its activation
(`Kept.capture`); the replay in the backward gives the same layer, called in
the same order, a custom gradient (`Kept.replay`) whose value is the recorded
output and whose gradient differentiates the layer's own `call` (without its
activation) at the replay's inputs and weights. That gradient reads the
layer's inputs and weights but not its output, so the graph never runs the
matmul of the replay (dead code, pruned), and a recorded output nothing in
the replay needs (a last projection before a residual add) is not kept
either.

Exact like full recompute: the recorded outputs are the forward's own, and
the rest replays in the forward's state (Dropout seeds, BatchNormalization
statistics) through `mechanism.recomputed`.
"""

import threading

import keras
import tensorflow as tf

from keras_gradboost import kernel_choice
from keras_gradboost import hooks

# The layers whose outputs are kept: each multiplies by a kernel (the FLOPs
# of a block) and applies its `activation` last, in its own `call`.
KERNEL_LAYERS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)

# `layer.activation` is set to None for the length of one call, to get the
# output before the activation; replicas of a MirroredStrategy trace in
# threads, so the swaps are serialised.
_SWAP = threading.RLock()


def is_kernel_layer(layer):
    """Whether selective recompute keeps `layer`'s output."""
    return isinstance(layer, KERNEL_LAYERS)


def kernel_layers(layers):
    """The kernel layers among `layers` and every layer below them."""
    found = {}
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            continue  # a functional graph's operation (keras.ops.add): no layers
        for inner in hooks.flatten_layers(layer):
            if is_kernel_layer(inner):
                found[id(inner)] = inner
    return list(found.values())


def _splits_activation(layer):
    """Whether `layer`'s `call` is the Keras class's own, which applies
    `self.activation` last: then the output before it can be had by setting
    the attribute to None. A subclass with a `call` of its own is kept
    whole (its output after the activation; its backward then runs the
    layer again, exactly, at full cost)."""
    activation = getattr(layer, "activation", None)
    if activation is None or activation is keras.activations.linear:
        return False
    own = next(c for c in KERNEL_LAYERS if isinstance(layer, c))
    return type(layer).call is own.call


def _linear_call(layer, call, args, kwargs):
    """`(output before the activation, the activation)` of one call (the
    activation is the identity where it is not split off)."""
    if not _splits_activation(layer):
        return call(*args, **kwargs), None
    with _SWAP:
        activation = layer.activation
        layer.activation = None
        try:
            return call(*args, **kwargs), activation
        finally:
            layer.activation = activation


class Kept:
    """The kernel layers' outputs one recomputed block keeps.

    Args:
        name: the block's name, for error messages.
    """

    def __init__(self, name):
        self.name = name
        self.layers, self.tensors, self.activations = [], [], []

    def capture(self):
        """A handler (see `mechanism.handling`) for the block's forward: a
        kernel layer's call records its output before the activation."""

        def handle(layer, call, args, kwargs):
            if not is_kernel_layer(layer):
                return call(*args, **kwargs)
            linear, activation = _linear_call(layer, call, args, kwargs)
            self.layers.append(layer)
            self.tensors.append(linear)
            self.activations.append(activation)
            return linear if activation is None else activation(linear)

        return handle

    def replay(self, tensors):
        """A handler for the block's replay: the i-th kernel layer call gets
        `tensors[i]` (the recorded output, made to wait for the backward) as
        its value, and its own gradient; its split-off activation replays
        like the rest of the block. (Running the activation once more in its
        own backward, to free its intermediates sooner, measured the same
        memory, within 2%, for 4% more step time on the BERT and the residual
        MLP: their activation's backward comes right after the next kernel
        layer's.)

        Raises:
            RuntimeError: the replay calls the kernel layers in another order
                or number than the forward did.
        """
        calls = []

        def handle(layer, call, args, kwargs):
            if not is_kernel_layer(layer):
                return call(*args, **kwargs)
            i = len(calls)
            calls.append(layer)
            if i >= len(self.layers) or self.layers[i] is not layer:
                raise RuntimeError(
                    f"Selective recompute of block {self.name!r}: its "
                    f"backward's replay called layer {layer.name!r} as kernel "
                    f"layer call {i + 1}, where the forward called "
                    + (
                        f"{self.layers[i].name!r}"
                        if i < len(self.layers)
                        else f"only {len(self.layers)}"
                    )
                    + ". The block's call must take the same path both times "
                    "(no Python state that changes between calls); "
                    'recompute it fully instead ({"policy": "full"}).'
                )
            value = _substituted(layer, call, tensors[i], args, kwargs)
            activation = self.activations[i]
            return value if activation is None else activation(value)

        handle.calls = calls
        return handle

    def check_replayed(self, handler):
        """Raises if the replay made fewer kernel layer calls than the
        forward (see `replay`)."""
        if len(handler.calls) != len(self.layers):
            raise RuntimeError(
                f"Selective recompute of block {self.name!r}: its backward's "
                f"replay called {len(handler.calls)} kernel layers, the "
                f"forward {len(self.layers)}. The block's call must take the "
                'same path both times; recompute it fully instead ({"policy": '
                '"full"}).'
            )


def _substituted(layer, call, kept, args, kwargs):
    """`kept` (the forward's output of `layer(*args, **kwargs)` before its
    activation) with the gradient of that call at `args` and the layer's
    weights as the replay reads them."""
    flat = tf.nest.flatten((args, kwargs))
    positions = [
        i
        for i, v in enumerate(flat)
        if isinstance(v, tf.Tensor) and v.dtype.is_floating
    ]
    weights = list(layer.trainable_variables)
    with hooks.autocast(None):  # the replay's values (the held weights), as stored
        values = [tf.convert_to_tensor(v.value) for v in weights]
    dtype = hooks.current_autocast()
    native = kernel_choice.current()  # the gradient's call runs the forward's kernel
    count = len(positions)

    @tf.custom_gradient
    def linear(*tensors):
        def grad(upstream):
            inputs, held = list(tensors[:count]), list(tensors[count:])
            with tf.GradientTape() as tape:
                tape.watch(inputs + held)
                rebuilt = list(flat)
                for i, t in zip(positions, inputs):
                    rebuilt[i] = t
                a, k = tf.nest.pack_sequence_as((args, kwargs), rebuilt)
                with keras.StatelessScope(
                    state_mapping=list(zip(weights, held))
                ), hooks.autocast(dtype), kernel_choice.running(native):
                    again, _ = _linear_call(layer, call, a, k)
            return tape.gradient(again, inputs + held, output_gradients=upstream)

        return tf.identity(kept), grad

    return linear(*[flat[i] for i in positions], *values)
