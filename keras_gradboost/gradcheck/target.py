"""What `gradcheck` differentiates: a function or Keras layer, its inputs,
and the sources of its gradients (float inputs, and a layer's trainable
weights), with one way to run it per kind of derivative.

* `vjp(u)`: reverse mode, as the user's training runs it (real variables);
* `jvp(i, v)`: forward mode (`tf.autodiff.ForwardAccumulator`);
* `outputs64(values)`: the function re-run at given source values, in the
  numeric dtype (float64 by default): a float64 clone of a layer, whose
  weights are read from `values` through a `keras.StatelessScope`.
"""

import inspect

import keras
import numpy as np
import tensorflow as tf


def _floating(value):
    return tf.as_dtype(value.dtype).is_floating


def _as_tensor(value):
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return tf.convert_to_tensor(value)
    if isinstance(value, (np.ndarray, np.generic)):
        return tf.constant(value)
    if isinstance(value, float):
        return tf.constant(value, tf.float32)
    return tf.convert_to_tensor(value)


def flat_floats(outputs):
    """The float tensors of a (nested) output, in `tf.nest` order."""
    return [
        t
        for t in tf.nest.flatten(outputs)
        if isinstance(t, (tf.Tensor, tf.Variable)) and _floating(t)
    ]


def as_vector(tensors, dtype=tf.float64):
    """Tensors flattened and concatenated into one vector of `dtype`."""
    if not tensors:
        return tf.zeros([0], dtype)
    return tf.concat([tf.reshape(tf.cast(t, dtype), [-1]) for t in tensors], 0)


def _input_names(fn, count):
    """"input 'x'" for each positional argument, from `fn`'s signature
    ("input 2" past its named parameters)."""
    call = fn.call if isinstance(fn, keras.layers.Layer) else fn
    try:
        parameters = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function
        parameters = []
    named = [
        p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return [f"input {named[i]!r}" if i < len(named) else f"input {i}" for i in range(count)]


def _float64_config(config, dtype):
    """A layer config with every dtype (policies, InputLayer dtypes) set to
    `dtype`, recursively (a Functional's config nests its layers')."""
    if isinstance(config, dict):
        out = {}
        for key, value in config.items():
            if key == "dtype" and (
                isinstance(value, str) or (isinstance(value, dict) and "config" in value)
            ):
                is_float = isinstance(value, dict) or tf.as_dtype(
                    value.replace("mixed_", "").split("_")[-1]
                ).is_floating
                out[key] = dtype if is_float else value
            else:
                out[key] = _float64_config(value, dtype)
        return out
    if isinstance(config, (list, tuple)):
        return type(config)(_float64_config(v, dtype) for v in config)
    return config


def float64_clone(layer, inputs, dtype):
    """`layer` re-built in `dtype` from its config, with its weights' values.

    Raises:
        ValueError: the layer cannot be re-built from its config, or the
            clone's weights do not match the layer's.
    """
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)
    try:
        clone = type(layer).from_config(_float64_config(layer.get_config(), dtype))
        clone(*[tf.cast(x, dtype) if _floating(x) else x for x in inputs])
    except Exception as error:  # anything from_config or the call raises
        raise ValueError(
            f"gradcheck could not re-build layer {layer.name!r} "
            f"({type(layer).__name__}) in {dtype} from its config ({error}). "
            "Give the layer a `get_config`/`from_config` that round-trips, or "
            "pass numeric_dtype=None (differences in the layer's own dtype, "
            "with larger steps and tolerances)."
        ) from error
    finally:
        keras.config.set_dtype_policy(previous)
    ours, theirs = layer.weights, clone.weights
    if [tuple(w.shape) for w in ours] != [tuple(w.shape) for w in theirs]:
        raise ValueError(
            f"gradcheck re-built layer {layer.name!r} in {dtype}, but the "
            f"clone's weights {[tuple(w.shape) for w in theirs]} do not match "
            f"the layer's {[tuple(w.shape) for w in ours]}. Pass "
            "numeric_dtype=None."
        )
    not_float = [w.path for w in _float_weights(clone) if w.dtype != dtype]
    if not_float:
        raise ValueError(
            f"gradcheck re-built layer {layer.name!r} in {dtype}, but some of "
            f"its weights stay in another dtype: {not_float[:3]}. Pass "
            "numeric_dtype=None."
        )
    for w, v in zip(theirs, ours):
        w.assign(tf.cast(v.value, w.dtype))
    return clone


def _float_weights(layer):
    """The float weights of `layer`."""
    return [w for w in layer.weights if tf.as_dtype(w.dtype).is_floating]


class Target:
    """`fn` at `inputs`, seen as a function of its gradient sources.

    Args:
        fn: a function of tensors, or a Keras layer or model (called as
            `fn(*inputs)`; its trainable weights are sources too).
        inputs: the positional arguments.
        numeric_dtype: "float64", or None for the sources' own dtypes.

    Raises:
        ValueError: nothing to differentiate, or no float output.
        TypeError: `fn` fails when re-run in the numeric dtype.
    """

    def __init__(self, fn, inputs, numeric_dtype):
        self.fn = fn
        self.layer = fn if isinstance(fn, keras.layers.Layer) else None
        self.inputs = [_as_tensor(x) for x in inputs]
        self.positions = [i for i, x in enumerate(self.inputs) if _floating(x)]
        outputs = flat_floats(fn(*self.inputs))  # builds a layer
        if not outputs:
            raise ValueError(
                "gradcheck needs `fn` to return at least one float tensor; "
                f"it returned {type(fn(*self.inputs)).__name__}."
            )
        self.output_specs = [(tuple(o.shape), o.dtype) for o in outputs]
        self.m = sum(int(np.prod(s)) for s, _ in self.output_specs)
        self.weights = list(self.layer.trainable_variables) if self.layer else []
        names = _input_names(fn, len(self.inputs))
        self.names = [names[i] for i in self.positions] + [
            f"weight {w.path!r}" for w in self.weights
        ]
        self.values = [self.inputs[i] for i in self.positions] + [
            tf.convert_to_tensor(w.value) for w in self.weights
        ]
        if not self.values:
            raise ValueError(
                "gradcheck found nothing to differentiate: no float input "
                f"(received dtypes {[x.dtype.name for x in self.inputs]}) and "
                "no trainable weight."
            )
        self.n_inputs = len(self.positions)
        self.numeric_dtype = numeric_dtype
        self.clone = None
        if self.layer is not None and numeric_dtype is not None:
            self.clone = float64_clone(self.layer, self.inputs, numeric_dtype)
        try:
            self.base64 = self.outputs64(self.numeric_values())
        except (TypeError, ValueError, tf.errors.InvalidArgumentError) as error:
            raise TypeError(
                f"`fn` failed when re-run in {numeric_dtype} for the numeric "
                f"differences ({type(error).__name__}: {error}). Make it "
                "dtype-generic (no float32 constants), or pass "
                "numeric_dtype=None (differences in the inputs' own dtype)."
            ) from error
        if numeric_dtype is not None and self._numeric_output_dtypes - {numeric_dtype}:
            raise TypeError(
                f"`fn` re-run on {numeric_dtype} inputs returned "
                f"{sorted(self._numeric_output_dtypes)} outputs: it computes in "
                "a lower precision inside (e.g. tf.image.resize works in "
                f"float32), so differences in {numeric_dtype} would be "
                "wrong. Pass numeric_dtype=None (differences in the inputs' "
                "own dtype)."
            )

    # ------------------------------------------------------------- helpers

    def source_dtype(self, i):
        return self.values[i].dtype

    def numeric_values(self):
        return [tf.cast(v, self.numeric_dtype or v.dtype) for v in self.values]

    def _args(self, xs):
        args = list(self.inputs)
        for pos, x in zip(self.positions, xs):
            args[pos] = x
        return args

    # -------------------------------------------------------------- reverse

    def outputs(self, xs):
        """The float outputs at input values `xs` (the real weights)."""
        return flat_floats(self.fn(*self._args(xs)))

    def vjp(self, u, xs=None):
        """Reverse-mode gradients of `sum(u * outputs)` for every source,
        as TensorFlow returns them (None, IndexedSlices, any shape)."""
        # Copies, so that one tensor passed twice is two sources.
        xs = [tf.identity(x) for x in (self.values[: self.n_inputs] if xs is None else xs)]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            outputs = self.outputs(xs)
        return tape.gradient(
            outputs,
            xs + self.weights,
            output_gradients=[tf.cast(a, o.dtype) for a, o in zip(u, outputs)],
        )

    # -------------------------------------------------------------- forward

    def jvp(self, i, v):
        """Forward-mode derivative of the outputs along `v` for source `i`,
        as one float64 vector (zeros where TensorFlow says disconnected)."""
        xs = [tf.identity(x) for x in self.values[: self.n_inputs]]
        # A weight's primal is the tf.Variable behind the Keras variable.
        primal = xs[i] if i < self.n_inputs else self.weights[i - self.n_inputs].value
        tangent = tf.cast(v, self.source_dtype(i))
        with tf.autodiff.ForwardAccumulator(primal, tangent) as acc:
            outputs = self.outputs(xs)
        tangents = acc.jvp(outputs, unconnected_gradients="zero")
        return as_vector(tangents)

    # -------------------------------------------------------------- numeric

    def outputs64(self, values):
        """The outputs as one vector of the numeric dtype, at source values
        `values` (inputs, then weights), computed in that dtype."""
        xs, ws = values[: self.n_inputs], values[self.n_inputs :]
        dtype = self.numeric_dtype
        if self.layer is None:
            outputs = self.fn(*self._args(xs))
        elif self.clone is not None:
            with keras.StatelessScope(
                state_mapping=list(zip(self.clone.trainable_variables, ws))
            ):
                outputs = self.clone(*self._args(xs))
        else:
            with keras.StatelessScope(state_mapping=list(zip(self.weights, ws))):
                outputs = self.layer(*self._args(xs))
        floats = flat_floats(outputs)
        self._numeric_output_dtypes = {t.dtype.name for t in floats}
        return as_vector(floats, dtype or floats[0].dtype)
