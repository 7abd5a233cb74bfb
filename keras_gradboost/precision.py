"""Dtype-policy switching on a built model, and loss scaling.

The "auto" rule for CPUs comes from `benchmarks/bench_foundation.py` (MLP
784-1024-1024-10, batch 256, Adam; step time relative to float32). On this
project's CPU (AMX and avx512_bf16) mixed_bfloat16 is faster than float32
without XLA and slower with XLA, and mixed_float16 without XLA is hundreds of
times slower (TensorFlow's grappler `remapping` pass rewrites float16 MatMuls
into a slow fused CPU kernel). So, on a CPU, "auto" picks mixed_bfloat16 when
the CPU has native bfloat16 instructions and XLA is off, and float32 otherwise;
it never picks mixed_float16. On a GPU it picks mixed_float16.
"""

import keras
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost.state import replica_local_variable

# Dynamic loss scaling, as in `keras.optimizers.LossScaleOptimizer`.
INITIAL_SCALE = 2.0**15
GROWTH_STEPS = 2000
SCALE_FLOOR = 1.0
# Growth stops here: float32 and bfloat16 never overflow to bring a dynamic
# scale down, and a scale that grew to inf would turn every step into NaN.
SCALE_CEILING = 2.0**24
# Loss-scale health: warn when more than this share of an epoch's steps were
# skipped, and at least MIN_SKIPS_TO_WARN of them (the first few skips while
# the scale comes down from 2**15 are normal).
SKIP_SHARE_TO_WARN = 0.5
MIN_SKIPS_TO_WARN = 8


def cpu_has_native_bfloat16():
    """Whether this CPU has bfloat16 instructions (avx512_bf16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def gpu_available():
    return bool(tf.config.list_physical_devices("GPU"))


def resolve_precision(precision, jit_compile, on_gpu, cpu_bf16):
    """The dtype policy name for a `precision` argument, or None to keep.

    Args:
        precision: the validated `precision` compile argument.
        jit_compile: whether the train step is XLA-compiled.
        on_gpu: whether training runs on a GPU.
        cpu_bf16: whether the CPU has native bfloat16 instructions.

    Returns:
        A dtype policy name, or `None` to leave the model as built.
    """
    if precision != "auto":
        return precision
    if on_gpu:
        return "mixed_float16"
    if cpu_bf16 and not jit_compile:
        return "mixed_bfloat16"
    return "float32"


def float16_cpu_warning(policy, jit_compile, on_gpu):
    """The warning for mixed_float16 on a CPU without XLA, or None."""
    if policy != "mixed_float16" or on_gpu or jit_compile:
        return None
    return (
        'precision="mixed_float16" on a CPU without XLA is very slow (many '
        "times slower than float32; see benchmarks/RESULTS.md): TensorFlow's "
        "grappler `remapping` pass rewrites float16 MatMuls into a slow fused "
        "CPU kernel. Use "
        'precision="auto" or "mixed_bfloat16", or compile with '
        "jit_compile=True, or turn the pass off with "
        "tf.config.optimizer.set_experimental_options({'remapping': False})."
    )


def output_layers(model):
    """The layers that produce the model's outputs (best effort).

    For a functional model, the layers named in `output_names`, descending
    into a nested model that produces an output. For other models (whose
    outputs are not known before they run), the last layer they track.
    """
    names = getattr(model, "output_names", None)
    if not (hooks.is_functional(model) and names):
        return hooks.flatten_layers(model, include_self=False)[-1:]
    found = []
    for name in names:
        try:
            layer = model.get_layer(name)
        except ValueError:
            continue
        found.extend(output_layers(layer) if isinstance(layer, keras.Model) else [layer])
    return found


# Layers that read their inputs as indices (or hash or look up their exact
# values). Ids carried in a float input (keras.io text models feed them as a
# float32 `Input`) must reach them as given: bfloat16 holds integers exactly
# only up to 256 (1366 of the ids 1..1999 change), float16 up to 2048.
INDEX_LAYERS = (
    keras.layers.Embedding,
    keras.layers.CategoryEncoding,
    keras.layers.IntegerLookup,
    keras.layers.StringLookup,
    keras.layers.Hashing,
    keras.layers.HashedCrossing,
)


def index_input_layers(model):
    """The layers of `model` that may carry ids on their way to an
    `INDEX_LAYERS` layer, and would cast them under a mixed policy.

    A layer casts its float inputs to its compute dtype in `__call__`
    (Keras' `Layer.__call__`; an `Embedding` itself does not, nor do a
    Functional model or the preprocessing layers). The ids pass through:
    - every layer that holds an index layer (a custom layer such as a
      token-and-position embedding, a subclassed model, `boost()`'s wrapper),
      and its sub-layers without weights (a `Reshape` or `Lambda` inside a
      subclassed call, whose data flow is not known);
    - in a functional graph (or a Sequential), the layers without weights
      between a float input and a layer of the above (`Reshape`, `Lambda`,
      `Concatenate`, ...). A layer with weights computes: its inputs are
      activations, not ids.

    Returns:
        The layers, each once, that cast a float input to float16 or
        bfloat16 now.
    """
    holders = {}

    def holds(layer):
        if id(layer) not in holders:
            holders[id(layer)] = False  # a layer reached again while visited
            found = isinstance(layer, INDEX_LAYERS)
            for child in hooks.child_layers(layer):
                found = holds(child) or found
            holders[id(layer)] = found
        return holders[id(layer)]

    holds(model)
    found = []
    for layer in hooks.flatten_layers(model, include_self=True):
        if not holders.get(id(layer)):
            continue
        found.append(layer)
        if hooks.is_functional(layer):
            found.extend(_graph_path(hooks.functional_nodes(layer), holders))
        elif isinstance(layer, keras.Sequential):
            found.extend(_sequential_path(layer.layers, holders))
        else:
            for child in hooks.child_layers(layer):
                if not child.weights:
                    found.extend(hooks.flatten_layers(child, include_self=True))
    unique = {id(layer): layer for layer in found}
    return [layer for layer in unique.values() if _casts_to_half(layer)]


def _graph_path(nodes, holders):
    """The weightless layers of a functional graph through which a float
    tensor reaches a layer in `holders` (see `index_input_layers`)."""
    produced = {id(t): (layer, ins) for layer, ins, outs in nodes for t in outs}
    stack = [t for layer, ins, _ in nodes if holders.get(id(layer)) for t in ins]
    found, seen = [], set()
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen or not keras.backend.is_float_dtype(tensor.dtype):
            continue
        seen.add(id(tensor))
        if id(tensor) not in produced:
            continue  # a model input
        layer, ins = produced[id(tensor)]
        if isinstance(layer, keras.layers.Layer):
            if layer.weights:
                continue
            found.append(layer)
        stack.extend(ins)  # a plain op (slicing, cast) casts nothing
    return found


def _sequential_path(layers, holders):
    """The weightless layers of a Sequential just before a layer in
    `holders`."""
    found = []
    for i, layer in enumerate(layers):
        if holders.get(id(layer)):
            j = i - 1
            while j >= 0 and not layers[j].weights:
                found.append(layers[j])
                j -= 1
    return found


def _casts_to_half(layer):
    return (
        layer.autocast
        and hooks.casts_inputs(layer)
        and layer.input_dtype in ("float16", "bfloat16")
    )


def apply_policy(model, policy):
    """Sets `policy` on every layer of `model`, built or not.

    Variables keep their dtype (mixed policies store variables in float32).
    With a mixed policy the output layers stay float32, as the Keras
    mixed-precision guide advises (a float16 softmax, or a float16 logit over
    65504, breaks the loss). Quantized layers keep their policy, and so do
    layers with an integer policy (`Hashing` and `HashedCrossing` output
    int64 bins: a float policy would make them float).

    Ids reach the layers that read them as indices (`INDEX_LAYERS`) exactly
    as given, as without a policy: the layers that would cast them on the way
    (`index_input_layers`) pass their inputs on uncast
    (`hooks.keep_input_dtypes`); their dtype policy, the autocasting of their
    variables, and the layers they call, are unchanged.

    Returns:
        The names of the layers kept in float32.
    """
    layers = hooks.flatten_layers(model, include_self=True)
    for layer in layers:
        hooks.keep_input_dtypes(layer, keep=False)  # an earlier compile's
    kept = output_layers(model) if policy.startswith("mixed") else []
    for layer in layers:
        policy_of_layer = layer.dtype_policy
        if policy_of_layer.quantization_mode is not None or not (
            keras.backend.is_float_dtype(policy_of_layer.compute_dtype)
        ):
            continue
        layer.dtype_policy = "float32" if layer in kept else policy
    for layer in index_input_layers(model):
        hooks.keep_input_dtypes(layer)
    return [l.name for l in kept]


def computes_in_float16(model):
    """Whether any layer of the model computes in float16."""
    return any(
        l.compute_dtype == "float16"
        for l in hooks.flatten_layers(model, include_self=True)
    )


class LossScaler:
    """Loss scale state: fixed, or dynamic (halve on overflow, double after
    `GROWTH_STEPS` finite steps, within `[SCALE_FLOOR, SCALE_CEILING]`)."""

    def __init__(self, dynamic, initial):
        self.dynamic = dynamic
        self.scale = replica_local_variable(float(initial), "loss_scale")
        self.good_steps = replica_local_variable(0, "loss_scale_good_steps", tf.int64)

    def update(self, finite):
        """Updates the scale after a micro-batch; `finite` is all-reduced."""
        if not self.dynamic:
            return
        good = tf.where(finite, self.good_steps + 1, tf.zeros_like(self.good_steps))
        grow = good >= GROWTH_STEPS
        scale = self.scale.read_value()
        new_scale = tf.where(
            finite,
            tf.where(grow, tf.minimum(scale * 2.0, SCALE_CEILING), scale),
            tf.maximum(scale / 2.0, SCALE_FLOOR),
        )
        self.scale.assign(new_scale)
        self.good_steps.assign(tf.where(grow, tf.zeros_like(good), good))


def health_warning(scale, skipped_in_epoch, steps_in_epoch, dynamic=True):
    """A loss-scale health warning, or None (pure: for the epoch-end check)."""
    if dynamic and skipped_in_epoch and scale <= SCALE_FLOOR:
        return (
            f"The loss scale is at its floor ({SCALE_FLOOR:g}) and steps are "
            f"still skipped as non-finite ({skipped_in_epoch} this epoch): the "
            "model produces inf/NaN even unscaled. Lower the learning rate, "
            "guard log/sqrt/division in the loss, or train in float32 "
            '(precision="float32") to find the cause.'
        )
    if (
        skipped_in_epoch >= MIN_SKIPS_TO_WARN
        and skipped_in_epoch > SKIP_SHARE_TO_WARN * steps_in_epoch
    ):
        return (
            f"{skipped_in_epoch} of {steps_in_epoch} steps this epoch were "
            f"skipped as non-finite (loss scale now {scale:g}): the model is "
            "barely training. Lower the learning rate or use "
            'precision="mixed_bfloat16", which needs no loss scaling.'
        )
    return None

