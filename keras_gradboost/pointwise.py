"""1x1 convolutions run as matrix products (`compile(pointwise="matmul")`).

A `keras.layers.Conv2D` with a 1x1 kernel (one group, no dilation) is a
matrix product over the channels at each pixel its strides keep (padding
adds nothing around a 1x1 kernel). Where oneDNN is off (TensorFlow's
default on CPUs without AVX-512), TensorFlow's own CPU kernels compute a
convolution's backward through im2col working buffers, for a 1x1 kernel
copies of its input: one for the filter's gradient (as many images as fit
a 30 MiB working set) and one for the input's, alive at once
(`recompute.estimates` counts them). Recompute cannot remove them, and in
MobileNetV2 and EfficientNetB0, where most convolutions are 1x1, they take
much of what it saves. The backward of a `MatMul` needs no such buffer.

The product sums in another order than the convolution kernel: values
equal Keras' to float rounding, not bit for bit, so it is opt-in. Layers
it cannot serve (another kernel size, groups, a dilation, channels_first,
a class with a `convolution_op` of its own, such as a weight-standardised
convolution) run as Keras runs them; `eligible` says why.
"""

import keras
import tensorflow as tf

from keras_gradboost import kernel_choice

SETTINGS = (None, "matmul")


def check_setting(value):
    """Raises if `value` is not an accepted `pointwise` compile argument."""
    return kernel_choice.check_setting(
        "pointwise", value, SETTINGS,
        'None (1x1 convolutions run as Keras runs them) or "matmul" (a Conv2D '
        "with a 1x1 kernel, one group and no dilation runs as a matrix product)",
    )


def eligible(layer):
    """Whether `layer` is a 1x1 convolution that a matrix product computes.

    Returns:
        `(True, None)`, or `(False, reason)`.
    """
    if not isinstance(layer, keras.layers.Conv2D):
        return False, "not a Conv2D"
    if kernel_choice.keeps_own_convolution(layer):
        return False, "its class overrides convolution_op"
    if tuple(layer.kernel_size) != (1, 1):
        return False, f"kernel size {tuple(layer.kernel_size)}"
    if layer.groups != 1:
        return False, f"{layer.groups} groups"
    if tuple(layer.dilation_rate) != (1, 1):
        return False, f"dilation {tuple(layer.dilation_rate)}"
    if layer.data_format != "channels_last":
        return False, "channels_first"
    return True, None


def candidates(model):
    """The layers of `model` that `pointwise="matmul"` runs as matmuls."""
    return kernel_choice.eligible_layers(model, eligible)


class _Matmul:
    """A `convolution_op` wrapper: a matrix product inside
    `kernel_choice.running(...)` for this layer, Keras' own convolution
    elsewhere (the layer may also belong to the un-boosted model)."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, original, inputs, kernel):
        if id(self.layer) not in kernel_choice.current() or len(inputs.shape) != 4:
            return original(inputs, kernel)
        return matmul_convolution(inputs, kernel, self.layer.strides)


def matmul_convolution(inputs, kernel, strides):
    """A 1x1 convolution of NHWC `inputs` by `kernel` (1, 1, C, F), as
    `Conv2D` computes it with these strides (either padding), written as a
    matrix product.

    Returns:
        A tensor `(N, ceil(H / sh), ceil(W / sw), F)`.
    """
    sh, sw = strides
    if (sh, sw) != (1, 1):
        inputs = inputs[:, ::sh, ::sw, :]
    channels, filters = kernel.shape[-2], kernel.shape[-1]
    flat = tf.matmul(tf.reshape(inputs, (-1, channels)), tf.reshape(kernel, (channels, filters)))
    shape = tf.shape(inputs)
    return tf.reshape(flat, tf.concat([shape[:3], [filters]], axis=0))


def apply(layers):
    """Marks `layers` (from `candidates`) to run as matmuls inside
    `kernel_choice.running` (idempotent; the marks do nothing outside it).

    Returns:
        A frozenset of their ids, for `kernel_choice.running`.
    """
    return kernel_choice.mark(layers, _Matmul)
