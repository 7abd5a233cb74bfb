"""Dtype-policy switching on a built model, and loss scaling.

The static rule `precision="auto"` starts from comes, for CPUs, from
`benchmarks/bench_foundation.py` (MLP 784-1024-1024-10, batch 256, Adam;
step time relative to float32). On this project's CPU (AMX and
avx512_bf16) mixed_bfloat16 is faster than float32 without XLA and slower
with XLA, and mixed_float16 without XLA is hundreds of times slower
(TensorFlow's grappler `remapping` pass rewrites float16 MatMuls into a slow
fused CPU kernel). So, on a CPU, the rule picks mixed_bfloat16
when the CPU has native bfloat16 instructions and XLA is off, and float32
otherwise; it never picks mixed_float16. On a GPU it picks mixed_float16.

That rule is a guess from one model: it picks mixed_bfloat16 for ResNet50 on
an Intel CPU with AMX, where bfloat16 is slower than float32 (0.75x the speed). So
`precision="auto"` (and `"measure"`, which must measure) times both
candidates (`measure_candidates`) on the real training steps of `fit`
(`precision_measure`); the static rule is its starting point, and its
answer where it cannot measure (`plan.precision_measure_blocker`).
"""

import keras
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost import precision_ids
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
    """Whether TensorFlow sees a GPU (asked here by the precision rule, the
    plan and the memory estimates)."""
    return bool(tf.config.list_physical_devices("GPU"))


# The `precision` values that time the candidates in `fit`.
MEASURED = ("auto", "measure")


def measures(precision):
    """Whether the `precision` compile argument times float32 against the
    device's mixed policy in `fit` (`precision_measure`)."""
    return precision in MEASURED


def resolve_precision(precision, jit_compile, on_gpu, cpu_bf16):
    """The dtype policy name for a `precision` argument, or None to keep.

    Args:
        precision: the validated `precision` compile argument (`"auto"` and
            `"measure"` resolve to the static rule's pick: the policy the
            layers hold until measured, and where it cannot measure).
        jit_compile: whether the train step is XLA-compiled.
        on_gpu: whether training runs on a GPU.
        cpu_bf16: whether the CPU has native bfloat16 instructions.

    Returns:
        A dtype policy name, or `None` to leave the model as built.
    """
    if not measures(precision):
        return precision
    if on_gpu:
        return "mixed_float16"
    if cpu_bf16 and not jit_compile:
        return "mixed_bfloat16"
    return "float32"


def static_pick(jit_compile):
    """The policy `precision="auto"` starts from on this machine (its static
    rule, `resolve_precision`), for a step XLA-compiled or not."""
    return resolve_precision("auto", jit_compile, gpu_available(), cpu_has_native_bfloat16())


def measure_candidates(on_gpu):
    """The policies `precision="auto"` times against each other: float32
    and the device's mixed policy (mixed_float16 on a GPU, mixed_bfloat16
    on a CPU: float16 on a CPU without XLA is hundreds of times slower)."""
    return ("float32", "mixed_float16" if on_gpu else "mixed_bfloat16")


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
    outputs are not known before they run), the last layer they hold
    directly (the head, defined last in the keras.io pattern), descending
    into it if it is a model (boost()'s wrapper of a subclassed model holds
    just that model). Before, it was the last of all their nested layers in
    Keras' flattening order, which is the first one defined.
    """
    names = getattr(model, "output_names", None)
    if not (hooks.is_functional(model) and names):
        children = hooks.child_layers(model)
        if not children:
            return []
        last = children[-1]
        return output_layers(last) if isinstance(last, keras.Model) else [last]
    found = []
    for name in names:
        try:
            layer = model.get_layer(name)
        except ValueError:
            continue
        found.extend(output_layers(layer) if isinstance(layer, keras.Model) else [layer])
    return found


def apply_policy(model, policy):
    """Sets `policy` on every layer of `model`, built or not.

    Variables keep their dtype (mixed policies store variables in float32).
    With a mixed policy the output layers stay float32, as the Keras
    mixed-precision guide advises (a float16 softmax, or a float16 logit over
    65504, breaks the loss). Quantized layers keep their policy, and so do
    layers with an integer policy (`Hashing` and `HashedCrossing` output
    int64 bins: a float policy would make them float).

    Ids in a float input (keras.io text models feed them as a float32
    `Input`) reach the layers that read them as indices
    (`precision_ids.INDEX_LAYERS`)
    exactly as given, as without a policy, where the model's graph shows the
    way: the layers of a functional or Sequential graph that would cast
    them on the way, and a layer there whose only input they are
    (`precision_ids.index_input_layers`), pass their inputs on uncast
    (`hooks.keep_input_dtypes`); their dtype policy, the autocasting of
    their variables, and the layers they call, are unchanged. Every other
    layer casts as in plain Keras (a subclassed model's float features must
    meet its embeddings in the compute dtype). Ids that such a layer casts
    would reach the index layer changed (bfloat16 holds integers exactly
    only up to 256, float16 up to 2048): with a mixed policy, each index
    layer, and each nested model whose float32 Input carries ids, refuses
    them with a `ValueError` (`precision_ids`, a `wrappers.patch` of its `call`)
    when they arrive as float16/bfloat16 or, when traced (`fit`, `evaluate`,
    `predict`: at the first trace, before any update), as float32 cast back
    from one. Int ids, and float32 ids that never went through a half dtype,
    pass untouched. The next `apply_policy` takes the checks off (a float32
    policy puts none back).

    Returns:
        The names of the layers kept in float32.
    """
    layers = hooks.flatten_layers(model, include_self=True)
    for layer in layers:
        hooks.keep_input_dtypes(layer, keep=False)  # an earlier compile's
        precision_ids.remove_id_check(layer)
    mixed = policy.startswith("mixed")
    kept = output_layers(model) if mixed else []
    for layer in layers:
        policy_of_layer = layer.dtype_policy
        if policy_of_layer.quantization_mode is not None or not (
            keras.backend.is_float_dtype(policy_of_layer.compute_dtype)
        ):
            continue
        layer.dtype_policy = "float32" if layer in kept else policy
    uncast, entries = precision_ids.trace_ids(model)
    for layer in uncast:
        hooks.keep_input_dtypes(layer)
    if mixed:
        precision_ids.install_id_checks(model, policy, entries)
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

