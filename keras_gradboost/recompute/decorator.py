"""Recompute for a user's own block or training loop: `Recompute(layer)` and
`recompute_function(fn)`, on the mechanism `compile(recompute=...)` uses.

`Recompute(layer)` marks the layer (`mechanism.mark`) and calls it inside
`mechanism.active` for that layer alone, exactly what GradBoostModel's
training forward does for a block its plan chose: the same Dropout masks,
the same batch statistics, moving statistics and seeds updated once.
`recompute_function(fn, layers=...)` wraps a function of tensors in
`mechanism.recomputed`, with the listed layers' state read back as the
forward saw it.
"""

import keras

from keras_gradboost.recompute import mechanism
from keras_gradboost.recompute import selective

POLICIES = ("full", "selective")


def _policy_arg(policy):
    if policy not in POLICIES:
        raise ValueError(
            f"Invalid value for argument `policy`. Received: policy={policy!r}. "
            'Expected "full" (everything recomputed) or "selective" (the '
            "kernel layers' outputs kept, the rest recomputed)."
        )
    return policy


def _mark_kernel_layers(layers):
    """Lets a selective recompute keep the outputs of the kernel layers in
    and below `layers`."""
    for layer in selective.kernel_layers(layers):
        mechanism.mark(layer)


@keras.saving.register_keras_serializable(package="keras_gradboost")
class Recompute(keras.layers.Wrapper):
    """Recomputes `layer`'s forward pass in the backward pass instead of
    keeping its activations (gradient checkpointing of one block).

    Only the block's inputs are kept for the backward pass; its gradients
    equal the plain block's, Dropout and BatchNormalization included (the
    recompute reads the seeds and batch statistics the forward saw). The
    mechanism is the one of `GradBoostModel.compile(recompute=...)`, usable
    in any Keras model or custom training loop. A `Recompute` inside
    `layer` recomputes inside this one's replay (nested recompute: the
    inner block runs three times in a step, and this block's backward holds
    its activations less the inner block's), selectively if its policy is
    `"selective"`: its kernel layers then run twice, not three times, and
    the outer backward holds their outputs from the outer replay until
    the inner block's backward.

    Args:
        layer: the Keras layer (a block: a layer, `Sequential` or model).
        policy: `"full"` (the whole block runs again) or `"selective"` (the
            outputs of its kernel layers, `Dense`, `EinsumDense` and the
            convolutions, are kept and only the rest runs again, as
            `compile(recompute={"policy": "selective"})`). Defaults to
            `"full"`.
        **kwargs: `keras.layers.Layer` arguments (`name`, ...).

    Example:

    ```python
    import keras
    import tensorflow as tf
    import keras_gradboost as kgb

    block = keras.Sequential([keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.1),
                              keras.layers.Dense(16)])
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(1)(kgb.Recompute(block)(inputs)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(tf.ones((4, 8)), training=True) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    ```
    """

    def __init__(self, layer, policy="full", **kwargs):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"Invalid type for argument `layer`. Received: layer={layer!r} "
                f"of type {type(layer).__name__}. Expected a keras.layers.Layer "
                "(for a function, use kgb.recompute_function(fn))."
            )
        self.policy = _policy_arg(policy)
        super().__init__(layer, **kwargs)
        mechanism.mark(layer)
        if self.policy == "selective":
            _mark_kernel_layers([layer])

    def call(self, *args, training=None, **kwargs):
        if training is not None:
            kwargs["training"] = training
        with mechanism.active([id(self.layer)], selective=self.policy == "selective"):
            return self.layer(*args, **kwargs)

    def get_config(self):
        return {**super().get_config(), "policy": self.policy}

    def compute_output_spec(self, *args, training=None, **kwargs):
        return self.layer.compute_output_spec(*args, **kwargs)


def recompute_function(fn=None, *, layers=(), name=None, policy="full"):
    """`fn` with the same forward, whose backward recomputes `fn`'s forward
    instead of keeping its activations (a decorator).

    For a function of tensors in a custom training loop. A Keras layer is
    wrapped in `Recompute(layer)`. The Keras layers `fn` calls go in
    `layers`: their Dropout seeds and batch statistics are read back as the
    forward saw them (so the recompute draws the same masks), and their
    weights are held at the forward's read, as `compile(recompute=...)`
    does. A layer that updates state (a Dropout seed, moving statistics)
    and is left out of `layers` is refused with a `ValueError` when the
    gradient is built (the recompute would draw a new mask), before any
    update is applied.

    Args:
        fn: a function of (nested) tensors and Python values, or a Keras
            layer. Defaults to `None` (then `recompute_function(layers=...)` returns
            the decorator).
        layers: the Keras layers `fn` calls. Defaults to `()`.
        name: used in error messages. Defaults to `None` (the function's
            name).
        policy: `"full"` or `"selective"` (the outputs of the kernel
            layers among `layers` are kept, the rest recomputed; see
            `Recompute`). Defaults to `"full"`.

    Returns:
        A function with `fn`'s signature (or a `Recompute` layer).

    Raises:
        TypeError: `fn` is not callable, or `layers` holds a non-layer.
        ValueError: when the gradient is built, if `fn` updates a variable
            of a layer not in `layers`.

    Example:

    ```python
    import keras
    import tensorflow as tf
    import keras_gradboost as kgb

    dense, drop = keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.2)

    @kgb.recompute_function(layers=[dense, drop])
    def block(x):
        return drop(dense(x), training=True)

    x = tf.ones((4, 8))
    dense.build(x.shape)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(block(x))
    grads = tape.gradient(loss, dense.trainable_variables)
    ```
    """
    _policy_arg(policy)
    layers = list(layers)
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"Invalid type for argument `layers`. Received: an element "
                f"{layer!r} of type {type(layer).__name__}. Expected Keras "
                "layers (the layers `fn` calls)."
            )
    if fn is None:
        return lambda f: recompute_function(f, layers=layers, name=name, policy=policy)
    if isinstance(fn, keras.layers.Layer):
        return Recompute(fn, policy=policy)
    if not callable(fn):
        raise TypeError(
            f"Invalid type for argument `fn`. Received: fn={fn!r} of type "
            f"{type(fn).__name__}. Expected a function or a Keras layer."
        )
    state, weights, seen = [], [], set()
    for layer in layers:
        for v in mechanism.state_variables(layer) + list(layer.trainable_variables):
            if id(v) not in seen:
                seen.add(id(v))
                (weights if v.trainable else state).append(v)
    label = name or getattr(fn, "__name__", "block")
    if policy == "selective":
        _mark_kernel_layers(layers)
    return mechanism.recomputed(fn, state, label, weights, selective=policy == "selective")
