"""Depthwise convolutions written as grouped `Conv2D`s, run on TensorFlow's
native depthwise kernel (`compile(depthwise="native")`).

A `keras.layers.Conv2D` with `groups` equal to its input channels (ConvNeXt's
7x7 convolutions) is a depthwise convolution. On the TensorFlow backend,
Keras runs every grouped convolution as an XLA-compiled function (the CPU
`Conv2D` kernel has no groups), and XLA on a CPU computes its filter
gradient through a dense `(kh, kw, C, C)` filter: on ConvNeXtTiny (64x64
inputs, batch 16, this project's 2-core CPU) a 220 MiB temporary in each
stage-3 block's backward, which sets the training peak, and a step 4.5x
as long as with `tf.nn.depthwise_conv2d` computing the same convolution
(`benchmarks/bench_depthwise.py`).

The native kernel sums in another order: values equal Keras' to float
rounding, not bit for bit, so it is opt-in. Layers it cannot serve
(channels_first, unequal strides, a stride with a dilation, a class with a
`convolution_op` of its own) run as Keras runs them; `eligible` says why.
"""

import keras
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost import kernel_choice
from keras_gradboost import precision

SETTINGS = (None, "native")


def check_setting(value):
    """Raises if `value` is not an accepted `depthwise` compile argument."""
    return kernel_choice.check_setting(
        "depthwise", value, SETTINGS,
        'None (grouped convolutions run as Keras runs them) or "native" (a '
        "Conv2D whose groups equal its input channels runs TensorFlow's "
        "depthwise kernel)",
    )


def eligible(layer):
    """Whether `layer` is a depthwise convolution written as a grouped
    `Conv2D` that the native kernel computes (for an unbuilt layer, whether
    its groups equal its input channels is checked at each call).

    Returns:
        `(True, None)`, or `(False, reason)`.
    """
    if not isinstance(layer, keras.layers.Conv2D) or layer.groups == 1:
        return False, "not a grouped Conv2D"
    if kernel_choice.keeps_own_convolution(layer):
        return False, "its class overrides convolution_op"
    if layer.built and layer.kernel.shape[-2] != 1:
        return False, "its groups are not its input channels"
    if layer.data_format != "channels_last":
        return False, "channels_first"
    strides, dilation = tuple(layer.strides), tuple(layer.dilation_rate)
    if strides[0] != strides[1]:
        return False, f"unequal strides {strides}"
    if max(strides) > 1 and max(dilation) > 1:
        return False, f"strides {strides} with dilation {dilation}"
    return True, None


def candidates(model):
    """The layers of `model` that `depthwise="native"` runs natively."""
    return kernel_choice.eligible_layers(model, eligible)


class _Native:
    """A `convolution_op` wrapper: the native depthwise kernel inside
    `kernel_choice.running(...)` for this layer, Keras' own convolution
    elsewhere (the layer may also belong to the un-boosted model)."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, original, inputs, kernel):
        layer = self.layer
        channels = inputs.shape[-1]
        if (
            id(layer) not in kernel_choice.current()
            or len(inputs.shape) != 4
            or channels != layer.groups  # an unbuilt layer's groups < channels
        ):
            return original(inputs, kernel)
        multiplier = kernel.shape[-1] // channels
        # Keras' grouped kernel (kh, kw, 1, C * m), output c * m + j from
        # input c, is the depthwise kernel (kh, kw, C, m).
        depthwise_kernel = tf.reshape(kernel, tuple(kernel.shape[:2]) + (channels, multiplier))
        return tf.nn.depthwise_conv2d(
            inputs,
            depthwise_kernel,
            strides=(1,) + tuple(layer.strides) + (1,),
            padding=layer.padding.upper(),
            dilations=tuple(layer.dilation_rate),
        )


def apply(layers):
    """Marks `layers` (from `candidates`) to run natively inside
    `kernel_choice.running` (idempotent; the marks do nothing outside it).

    Returns:
        A frozenset of their ids, for `kernel_choice.running`.
    """
    return kernel_choice.mark(layers, _Native)


# XLA's CPU backward of a depthwise convolution that Keras runs as a grouped
# convolution (multiplier 1) holds about this many float32 copies of the
# dense (kh, kw, C, C) filter at once: it added 1.9-2.0 of them to the
# training peak of ConvNeXtTiny and of a one-convolution model, in requested
# bytes (2.0-2.4 for the layer's gradient alone; float32, mixed_bfloat16 and
# mixed_float16 alike: XLA computes them in float32 here). With a
# multiplier of 2 nothing of that size was seen, so only a multiplier of 1
# is counted.
XLA_DENSE_FILTER_COPIES = 2
_GROUPED = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)


def xla_backward_temporaries(model):
    """The temporaries of the XLA backward of each depthwise convolution
    Keras runs as a grouped convolution (`Conv1D`/`Conv2D`/`Conv3D` with
    groups = input channels = filters) on a CPU: about
    `XLA_DENSE_FILTER_COPIES` float32 copies of a dense `(k..., C, C)`
    filter (ConvNeXtTiny's last stage: ~220 MiB; measured for `Conv2D`,
    channels_last; the others assumed alike). Layers running natively
    here (`kernel_choice.current()`) have none, and neither has a GPU
    (cuDNN runs grouped convolutions). A layer not yet built is skipped
    (the estimates trace the model first, which builds it).

    Returns:
        A list of `(layer, bytes)`.
    """
    if precision.gpu_available():
        return []
    native = kernel_choice.current()
    found = []
    for layer in hooks.flatten_layers(model, include_self=False):
        if (
            not isinstance(layer, _GROUPED)
            or layer.groups == 1
            or not layer.built
            or id(layer) in native
        ):
            continue
        *window, per_group, filters = layer.kernel.shape
        if per_group != 1 or filters != layer.groups:
            continue
        itemsize = max(4, tf.as_dtype(layer.compute_dtype).size)
        dense = filters * filters * itemsize
        for size in window:
            dense *= size
        found.append((layer, int(XLA_DENSE_FILTER_COPIES * dense)))
    return found


def xla_backward_temporary(model):
    """The largest of `xla_backward_temporaries(model)`.

    Returns:
        `(bytes, layer)`, or `(0, None)` when there is none.
    """
    layer, size = max(xla_backward_temporaries(model), key=lambda found: found[1], default=(None, 0))
    return size, layer
