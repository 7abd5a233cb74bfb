"""What `GradBoostModel.compile()` decides, before it changes anything.

`TrainPlan.build` turns the validated `GradBoostConfig`, Keras' own compile
arguments, the model and the device into one frozen plan, in one explicit
order, each decision reading only the ones before it:

1. jit: the XLA setting Keras will run with (`"measure"` is decided later,
   by timing; a layer with `supports_jit=False` or `run_eagerly` blocks XLA);
2. precision: the dtype policy (its `"auto"` rule depends on the device and,
   on a CPU, on jit; `"measure"` starts from that rule's pick and is decided
   later, by timing, among `precision_candidates`, unless something blocks
   measuring);
3. loss scale: whether the model computes in float16, and so the scaling;
4. recompute: the blocks chosen for recompute (the per-model setup);
5. every conflict and strategy check, and the warnings to give.

Building a plan changes nothing: a bad combination raises before the model
is touched, and a plan can be tested without calling `compile()`.
`GradBoostModel.compile()` is then config -> plan -> apply.
"""

import dataclasses
import types

import keras
import tensorflow as tf

from keras_gradboost import depthwise
from keras_gradboost import pointwise
from keras_gradboost import hooks
from keras_gradboost import precision as precision_lib
from keras_gradboost import window_dropout
from keras_gradboost.accumulate import EXACT_REDUCTIONS
from keras_gradboost.accumulate import held_generators
from keras_gradboost.accumulate import listed
from keras_gradboost.accumulate import random_layers
from keras_gradboost.config import GradBoostConfig
from keras_gradboost.config import jit_compile_setting
from keras_gradboost.recompute.setup import RecomputeSetup


@dataclasses.dataclass(frozen=True)
class Devices:
    """The device facts the plan depends on.

    Attributes:
        on_gpu: whether TensorFlow sees a GPU.
        cpu_bf16: whether the CPU has native bfloat16 instructions.
    """

    on_gpu: bool
    cpu_bf16: bool

    @classmethod
    def detect(cls):
        return cls(precision_lib.gpu_available(), precision_lib.cpu_has_native_bfloat16())


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What `compile()` decided, in the order it decided it.

    Attributes:
        config: the validated `GradBoostConfig`.
        keras_kwargs: the arguments handed to `keras.Model.compile` (a
            read-only mapping; the optimizer is an instance).
        jit_requested: `compile(jit_compile=...)` as given: `"auto"`, True,
            False or `"measure"`.
        jit_compile: whether the train step is XLA-compiled as Keras will
            run it (False for `"measure"` until it is measured).
        xla_blocked: why XLA is off although `jit_requested` asked for it,
            or None.
        policy: the dtype policy `precision` sets on every layer, or None
            to leave the model as built. For `precision="auto"` and
            `"measure"`, the static rule's pick: what the layers hold until
            the measurement decides (`GradBoostModel.dtype_policy_applied`
            says what they hold now).
        precision_candidates: the policies `precision="auto"` or
            `"measure"` times (float32 and the device's mixed policy); `()`
            otherwise.
        precision_blocked: why `precision="auto"` or `"measure"` cannot
            measure (and keeps `policy`, the static rule's pick), or None.
        float16: whether the model will compute in float16.
        loss_scale: `(dynamic, initial_scale)` for gradboost loss scaling,
            or None (off).
        auto_scale_loss: `compile(auto_scale_loss=...)` as given.
        recompute: the per-model recompute setup (blocks chosen, not yet
            applied), or None.
        depthwise_setting: how `depthwise_layers` run: `"native"`,
            `"chunked"`, or None (as Keras runs them). `depthwise=None` with
            recompute on is `"chunked"` where it serves (`_decide_depthwise`).
        depthwise_layers: the grouped `Conv2D` layers that
            `"native"` runs on TensorFlow's depthwise kernel, or
            `"chunked"` on slices of their channels
            (`depthwise.candidates`); `()` otherwise.
        pointwise_layers: the 1x1 `Conv2D` layers that `pointwise="matmul"`
            runs as matrix products (`pointwise.candidates`); `()`
            otherwise.
        warnings: the messages `compile()` gives once the plan is applied
            (soft problems: XLA blocked, float16 on a CPU, accumulation that
            cannot equal the large batch).
    """

    config: GradBoostConfig
    keras_kwargs: types.MappingProxyType
    jit_requested: object = "auto"
    jit_compile: bool = False
    xla_blocked: object = None
    policy: object = None
    precision_candidates: tuple = ()
    precision_blocked: object = None
    float16: bool = False
    loss_scale: object = None
    auto_scale_loss: bool = False
    recompute: object = None
    depthwise_setting: object = None
    depthwise_layers: tuple = ()
    pointwise_layers: tuple = ()
    warnings: tuple = ()

    @property
    def depthwise_chosen_by(self):
        """What chose `depthwise_setting` where `compile(depthwise=...)` did
        not (`recompute=...`), for the warnings; None otherwise."""
        if self.config.depthwise is not None or self.depthwise_setting is None:
            return None
        return f"recompute={self.config.recompute!r}"

    @classmethod
    def build(cls, config, model, keras_kwargs, devices=None):
        """Decides everything `compile()` will apply, changing nothing.

        Args:
            config: a `GradBoostConfig`.
            model: the model being compiled.
            keras_kwargs: `keras.Model.compile`'s arguments as a dict (the
                gradboost ones taken out).
            devices: `Devices`; detected when None. Defaults to `None`.

        Returns:
            A `TrainPlan`.

        Raises:
            TypeError, ValueError: for a bad `jit_compile`, and for
                conflicting arguments (named, with the fix).
        """
        devices = devices or Devices.detect()
        kwargs = dict(keras_kwargs)
        requested, jit, xla_blocked = _decide_jit(model, kwargs)
        notes = []
        if xla_blocked:
            notes.append(
                f"jit_compile={requested!r}, but XLA is off: {xla_blocked}. "
                "The model trains without XLA."
            )
        optimizer = keras.optimizers.get(kwargs.get("optimizer", "rmsprop"))
        kwargs["optimizer"] = optimizer
        auto_scale_loss = bool(kwargs.pop("auto_scale_loss", False))

        policy = precision_lib.resolve_precision(
            config.precision, jit, devices.on_gpu, devices.cpu_bf16
        )
        candidates, precision_blocked = (), None
        if precision_lib.measures(config.precision):
            if config.precision == "measure":
                check_measure_conflicts(requested)
            candidates = precision_lib.measure_candidates(devices.on_gpu)
            precision_blocked = precision_measure_blocker(model, kwargs, requested)
            if precision_blocked:
                notes.append(
                    f'precision="{config.precision}", but it cannot measure: '
                    f"{precision_blocked}. The model trains in {policy}, the "
                    "static rule's pick (mixed_float16 on a GPU; on a CPU "
                    "mixed_bfloat16 with bfloat16 instructions and XLA off, "
                    "else float32)."
                )
        message = precision_lib.float16_cpu_warning(policy, jit, devices.on_gpu)
        if message:
            notes.append(message)
        # A measured float16 candidate needs the loss scale from the start
        # (both candidates share it: one train step, one scaler).
        measured = candidates if not precision_blocked else ()
        float16 = "mixed_float16" in (policy, *measured) or (
            policy is None and precision_lib.computes_in_float16(model)
        )

        scale = loss_scale_setting(config.loss_scale, float16)
        keras_scales = auto_scale_loss and (policy or model.dtype_policy.name) == (
            "mixed_float16"
        )
        check_conflicts(config, optimizer, scale, auto_scale_loss, keras_scales)
        check_strategy(model.distribute_strategy, config, scale)
        kwargs["auto_scale_loss"] = scale is None and auto_scale_loss

        recompute = None
        if config.recompute is not None:
            recompute = RecomputeSetup(model, config.recompute)
        if config.accumulate_steps > 1:
            check_accumulate_check(model, config)
            notes.extend(inexact_accumulation_warnings(model, config, kwargs.get("loss")))
        depthwise_setting, depthwise_layers = _decide_depthwise(
            config, model, recomputes=recompute is not None, jit_requested=requested,
            jit=jit, xla_blocked=xla_blocked, on_gpu=devices.on_gpu, notes=notes,
        )
        pointwise_layers = ()
        if config.pointwise == "matmul":
            pointwise_layers = _chosen_layers(
                pointwise.candidates(model), 'pointwise="matmul"', model, notes,
                "no Conv2D with a 1x1 kernel, one group, no dilation, "
                "channels_last data and Keras' own convolution_op.",
            )
        return cls(
            config=config,
            keras_kwargs=types.MappingProxyType(kwargs),
            jit_requested=requested,
            jit_compile=jit,
            xla_blocked=xla_blocked,
            policy=policy,
            precision_candidates=candidates,
            precision_blocked=precision_blocked,
            float16=float16,
            loss_scale=scale,
            auto_scale_loss=auto_scale_loss,
            recompute=recompute,
            depthwise_setting=depthwise_setting,
            depthwise_layers=depthwise_layers,
            pointwise_layers=pointwise_layers,
            warnings=tuple(notes),
        )

    def with_jit(self, jit_compile, devices=None, model=None):
        """The plan for the jit setting Keras ended up with. Keras may turn
        XLA off where the plan's prediction of it did not (the precision
        rule and the float16 warning depend on jit on a CPU), or on: then
        recompute's `"chunked"` (`depthwise_setting` with `depthwise=None`)
        is dropped, and `model`'s note says what is left."""
        devices = devices or Devices.detect()
        jit = bool(jit_compile)
        policy = precision_lib.resolve_precision(
            self.config.precision, jit, devices.on_gpu, devices.cpu_bf16
        )
        old = precision_lib.float16_cpu_warning(self.policy, self.jit_compile, devices.on_gpu)
        new = precision_lib.float16_cpu_warning(policy, jit, devices.on_gpu)
        notes = [n for n in self.warnings if n != old] + ([new] if new else [])
        depthwise_choice = {}
        if jit and self.config.depthwise is None and self.depthwise_layers:
            # Recompute's "chunked" holds without XLA only (`_decide_depthwise`).
            depthwise_choice = dict(depthwise_setting=None, depthwise_layers=())
            if model is not None:
                notes += depthwise_notes(self.config.recompute, model, self.depthwise_layers)
        return dataclasses.replace(
            self, jit_compile=jit, policy=policy, warnings=tuple(notes), **depthwise_choice
        )


def _decide_jit(model, kwargs):
    """`(requested, jit, xla_blocked)`; sets `kwargs["jit_compile"]` to what
    Keras is given: False for `"measure"` (both variants are made when the
    train function is) and when XLA is blocked (Keras' own warning names no
    cause)."""
    requested = jit_compile_setting(kwargs.get("jit_compile", "auto"))
    run_eagerly = bool(kwargs.get("run_eagerly"))
    xla_blocked = None
    if requested is True or requested == "measure":
        blockers = ["run_eagerly=True"] if run_eagerly else hooks.jit_blockers(model)
        blockers += strategy_jit_blockers(model.distribute_strategy)
        if blockers:
            xla_blocked = "; ".join(blockers)
        if blockers or requested == "measure":
            kwargs["jit_compile"] = False
    given = kwargs.get("jit_compile", "auto")
    if given == "auto" or run_eagerly:
        # Keras resolves "auto" to False on a CPU-only machine and under a
        # distribution strategy; on a GPU it does not change the precision
        # rule (which depends on jit only on a CPU).
        jit = False
    else:
        jit = bool(given)
    return requested, jit, xla_blocked


def check_measure_conflicts(jit_requested):
    """Raises for `precision="measure"` together with
    `jit_compile="measure"`: each would time its candidates under a setting
    the other has not decided yet."""
    if jit_requested == "measure":
        raise ValueError(
            'Conflicting arguments: jit_compile="measure" and '
            'precision="measure". Each times its candidates with the other '
            "setting fixed, so only one can be measured at a time. Set only "
            'one: e.g. measure jit_compile with a fixed precision, then '
            'compile with the jit_compile it chose (jit_measurement) and '
            'precision="measure".'
        )


def precision_measure_blocker(model, kwargs, jit_requested=None):
    """Why `precision="auto"` or `"measure"` cannot time its candidates, or
    None: `run_eagerly=True` (eager steps say nothing about the compiled
    step's speed), strategies other than one process's (MultiWorker,
    parameter servers, TPUs: each worker would time its own steps, and
    might choose another policy than the others), and `jit_compile=
    "measure"` (`check_measure_conflicts` refuses it with `"measure"`)."""
    if kwargs.get("run_eagerly"):
        return "run_eagerly=True (eager steps say nothing about the speed of the compiled step)"
    if jit_requested == "measure":
        return (
            'jit_compile="measure" times XLA in the same first calls, and each '
            "measurement needs the other setting fixed"
        )
    strategy = model.distribute_strategy
    multi_process = (
        tf.distribute.MultiWorkerMirroredStrategy,
        tf.distribute.experimental.ParameterServerStrategy,
        tf.distribute.TPUStrategy,
    )
    if isinstance(strategy, multi_process):
        return (
            f"under {strategy_name(strategy)} each worker would time its own "
            "steps and might choose another policy than the others"
        )
    return None


def strategy_jit_blockers(strategy):
    """Why XLA cannot run a step of `strategy`, as short reasons: several
    replicas on the CPUs of one process (logical CPU devices), whose XLA
    step TensorFlow compiles for the first CPU and then fails on the other
    replicas' variables ("Trying to access resource ... located in device
    CPU:1 from device CPU:0"; plain Keras fails the same); and
    MultiWorkerMirroredStrategy on CPUs, whose cross-worker all-reduce XLA
    cannot compile on a CPU (an `UnimplementedError` at the first step)."""
    if strategy.num_replicas_in_sync < 2:
        return []
    try:
        devices = list(strategy.extended.worker_devices)
    except (AttributeError, RuntimeError):  # a strategy without the notion
        return []
    on_cpus = all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and on_cpus:
        return [
            f"{strategy_name(strategy)} over {strategy.num_replicas_in_sync} "
            "CPU replicas (TensorFlow's XLA has no collectives on CPU devices: "
            '"Collectives are not yet implemented for CPU devices when '
            'compiling with XLA")'
        ]
    if len(devices) > 1 and on_cpus:
        return [
            f"{strategy_name(strategy)} over {len(devices)} CPU devices of one "
            "process (TensorFlow's XLA step reads every replica's variables on "
            "the first CPU)"
        ]
    return []


def loss_scale_setting(loss_scale, float16):
    """`(dynamic, initial scale)` for the LossScaler, or None for no scaling."""
    if loss_scale == "dynamic" or (loss_scale == "auto" and float16):
        return (True, precision_lib.INITIAL_SCALE)
    if isinstance(loss_scale, float):
        return (False, loss_scale)
    return None


def check_conflicts(config, optimizer, scale, auto_scale_loss, keras_scales):
    """Raises a ValueError naming both sides of a conflict between the
    gradboost arguments and the optimizer or `auto_scale_loss`."""
    if auto_scale_loss and scale is not None:
        raise ValueError(
            "Conflicting arguments: auto_scale_loss=True (Keras wraps the "
            "optimizer in a LossScaleOptimizer) and "
            f"loss_scale={config.loss_scale!r} (gradboost loss scaling, on for "
            "this model). Set only one: pass loss_scale=None to use Keras' "
            "loss scaling, or drop auto_scale_loss."
        )
    is_lso = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if is_lso and scale is not None:
        raise ValueError(
            "Conflicting arguments: the optimizer is a LossScaleOptimizer "
            f"and loss_scale={config.loss_scale!r} (gradboost loss scaling, on "
            "for this model). Set only one: pass the inner optimizer, or "
            "loss_scale=None."
        )
    if config.accumulate_steps == 1:
        return
    own = getattr(optimizer, "gradient_accumulation_steps", None)
    if own:
        raise ValueError(
            "Conflicting arguments: accumulate_steps="
            f"{config.accumulate_steps} and the optimizer's own "
            f"gradient_accumulation_steps={own}. Set only one: keep "
            "accumulate_steps (exact for uneven batches and distribution) and "
            "create the optimizer without gradient_accumulation_steps."
        )
    if is_lso or keras_scales:
        raise ValueError(
            "Conflicting arguments: accumulate_steps="
            f"{config.accumulate_steps} and a LossScaleOptimizer"
            + (" (from auto_scale_loss=True)" if keras_scales else "")
            + '. Set only one kind of loss scaling: pass the inner optimizer '
            'and loss_scale="dynamic" (gradboost scaling works with '
            "accumulation)."
        )


# Strategies GradBoostModel's accumulation and loss scaling refuse: the public
# name (MultiWorkerMirroredStrategy's class is the internal
# CollectiveAllReduceStrategy), and why.
_REFUSED_STRATEGIES = (
    (
        tf.distribute.experimental.ParameterServerStrategy,
        "ParameterServerStrategy",
        "its workers step asynchronously on variables held by parameter "
        "servers, so there is no one step over all replicas in which an "
        "accumulation window or a finiteness decision could be exact",
    ),
    (
        tf.distribute.TPUStrategy,
        "TPUStrategy",
        "the cross-replica step (replica-local accumulators, merge_call "
        "inside the TPU loop) has not been proven on TPU replicas",
    ),
)


def strategy_name(strategy):
    """The public name of `strategy`'s kind (MultiWorkerMirroredStrategy
    for its internal class CollectiveAllReduceStrategy)."""
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "MultiWorkerMirroredStrategy"
    for kind, name, _ in _REFUSED_STRATEGIES:
        if isinstance(strategy, kind):
            return name
    return type(strategy).__name__


def check_strategy(strategy, config, scale):
    """Accumulation and loss scaling decide over every replica's values:
    proven exact on one device, under MirroredStrategy and under
    MultiWorkerMirroredStrategy; refused, naming the strategy and the
    reason, under ParameterServerStrategy and TPUStrategy. The first-step
    checks (`accumulate_check`, `recompute_check`) are refused under
    MultiWorkerMirroredStrategy."""
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        checks = [
            f"{name}=True"
            for name in ("accumulate_check", "recompute_check")
            if getattr(config, name)
        ]
        if checks:
            off = " and ".join(c.replace("True", "False") for c in checks)
            raise ValueError(
                f"{' and '.join(checks)} cannot be used under "
                f"{strategy_name(strategy)}: the check replays this worker's "
                "first batches eagerly, outside the step all workers run "
                "together (it fails in Keras' loss there). Run the check on "
                "one machine with the same model and data, and train across "
                f"workers with {off}."
            )
    if config.accumulate_steps == 1 and scale is None:
        return
    for kind, name, reason in _REFUSED_STRATEGIES:
        if isinstance(strategy, kind):
            features = []
            if config.accumulate_steps > 1:
                features.append(f"accumulate_steps={config.accumulate_steps}")
            if scale is not None:
                features.append(f"loss_scale={config.loss_scale!r} (on for this model)")
            raise ValueError(
                f"{' and '.join(features)} cannot be used under {name}: "
                f"{reason}. Supported: one device, MirroredStrategy and "
                "MultiWorkerMirroredStrategy. Use accumulate_steps=1 and "
                f"loss_scale=None with {name}."
            )


def _stateful_rnns(model):
    """The names of `model`'s RNN layers with `stateful=True`."""
    return [
        l.name
        for l in hooks.flatten_layers(model)
        if isinstance(l, keras.layers.RNN) and l.stateful
    ]


def check_accumulate_check(model, config):
    """Raises a ValueError when `accumulate_check=True` cannot compare a
    window with one large batch: a stateful RNN takes batches of its one
    fixed size, and carries state from one micro-batch to the next."""
    stateful = _stateful_rnns(model)
    if config.accumulate_check and stateful:
        raise ValueError(
            "Invalid argument: accumulate_check=True compares an accumulation "
            "window with one batch of its micro-batches concatenated, which "
            f"the stateful RNN layers ({listed(stateful, 3)}) cannot run: "
            "stateful=True fixes their batch size, and each micro-batch starts "
            "from the state the one before it left. Drop accumulate_check."
        )


def _drawn_as_large_batch(model, layer, exact_ids):
    """Whether `layer`'s random draws in a window are the large batch's
    (`window_dropout`): each generator it holds is among `exact_ids` (of
    `window_dropout.exact_generators`), on one replica. (A train_step of
    the model's own that does not call GradBoostModel's is warned about
    when traced.)"""
    held = held_generators(layer)
    return (
        bool(held) and all(id(g) in exact_ids for g in held)
        and model.distribute_strategy.num_replicas_in_sync == 1
    )


def inexact_accumulation_warnings(model, config, loss):
    """What makes k micro-batches differ from one large batch, as warnings."""
    steps = config.accumulate_steps
    notes = []
    exact_ids = {id(g) for g in window_dropout.exact_generators(model)[0]}
    drawn = [(l.name, _drawn_as_large_batch(model, l, exact_ids)) for l in random_layers(model)]
    stateful = _stateful_rnns(model)
    if stateful:
        notes.append(
            f"accumulate_steps={steps}: the stateful RNN layers "
            f"({listed(stateful, 3)}) carry their state from one micro-batch to "
            "the next, so a window is not one large-batch step: the update averages "
            f"the gradients of {steps} consecutive batches, each from the state "
            "the batch before it left (a large batch's samples would share one "
            "starting state, and stateful=True fixes the batch size)."
        )
    # A frozen BatchNormalization (trainable=False, as in a frozen
    # keras.applications base) runs in inference mode: its moving statistics.
    bn = [
        l.name
        for l in hooks.flatten_layers(model)
        if isinstance(l, keras.layers.BatchNormalization) and l.trainable
    ]
    if bn:
        shown = ", ".join(bn[:4]) + (f" and {len(bn) - 4} more" if len(bn) > 4 else "")
        notes.append(
            f"accumulate_steps={steps}: the BatchNormalization layers "
            f"({shown}) normalise each micro-batch with its own statistics, "
            "not those of the whole accumulated batch, so the result differs "
            "from one large-batch step. Use LayerNormalization or "
            "GroupNormalization for an exact equivalent."
        )
    drawing = [name for name, large in drawn if not large]
    if drawing:
        # Each name once: keras-hub names every block's layers alike.
        names = list(dict.fromkeys(drawing))
        count = f"; {len(drawing)} layers" if len(names) < len(drawing) else ""
        notes.append(
            f"accumulate_steps={steps}: the layers that draw random numbers "
            f"({listed(names, 4)}{count}, e.g. Dropout masks) draw them for each "
            "micro-batch: every sample gets a draw of its own, as in a large "
            "batch, but not the one a large-batch step would draw, so the "
            "weights differ from one large-batch step with the same seed by "
            "that randomness (not in expectation). accumulate_check=True "
            "compares the two with these draws turned off."
        )
    losses = tf.nest.flatten(loss) if loss is not None else []
    odd = sorted(
        {
            l.reduction
            for l in losses
            if isinstance(l, keras.losses.Loss)
            and l.reduction not in EXACT_REDUCTIONS
        }
    )
    if odd:
        notes.append(
            f"accumulate_steps={steps}: a loss with reduction={odd[0]!r}. "
            "Accumulation weights each micro-batch by its sample count, which "
            'is exact for reduction="sum_over_batch_size" (the default) only.'
        )
    return notes


def _decide_depthwise(config, model, *, recomputes, jit_requested, jit, xla_blocked,
                      on_gpu, notes):
    """`(setting, layers)`: how the model's depthwise convolutions written
    as grouped `Conv2D`s run (`TrainPlan.depthwise_setting`,
    `depthwise_layers`), with the notes to give.

    `depthwise=None` with recompute on runs `"chunked"` where it serves:
    on a CPU, without XLA (auto-clustering and `jit_compile="measure"`'s
    XLA candidate included: the slices are checked outside the step, which
    cannot vouch for what XLA makes of them), in any precision (checked in
    the dtype each layer computes in at its trace), so that the layers it
    chooses run in slices bit for bit as Keras runs them (ConvNeXtTiny
    "auto": 0.11x the training memory instead of 0.56x).
    Its values are Keras' own, so recompute stays exact; `"keras"` keeps
    Keras' way."""
    if config.depthwise == "native":
        return "native", _chosen_layers(
            depthwise.candidates(model), 'depthwise="native"', model, notes,
            "no Conv2D whose groups equal its input channels (channels_last, "
            "equal strides, no stride with a dilation, Keras' own "
            "convolution_op). DepthwiseConv2D layers already run "
            "TensorFlow's depthwise kernel.",
        )
    if config.depthwise == "chunked":
        return "chunked", _chosen_layers(
            depthwise.candidates(model, "chunked"), 'depthwise="chunked"', model,
            notes,
            "no Conv2D whose groups equal its input channels and filters, "
            f"with over {depthwise.CHUNK_CHANNELS} channels (channels_last, "
            "Keras' own convolution_op).",
        )
    if config.depthwise is not None or not recomputes or on_gpu:
        return None, ()
    chunkable = depthwise.candidates(model, "chunked")
    serves = (
        not jit
        and (jit_requested != "measure" or xla_blocked)
        and not depthwise.xla_clusters()
    )
    if serves and chunkable:
        return "chunked", tuple(chunkable)
    # The note names "chunked" for the layers it would slice without XLA.
    notes.extend(depthwise_notes(config.recompute, model, chunkable))
    return None, ()


def depthwise_notes(recompute, model, chunkable):
    """The note that recompute cannot remove the XLA temporaries of the
    model's depthwise convolutions Keras runs as grouped ones (a depth
    multiplier of 1: `depthwise.xla_backward_temporaries`), naming
    "chunked" where `chunkable` layers could run in slices but the step
    does not serve; `[]` without such layers."""
    left = [layer for layer in depthwise.candidates(model) if layer.filters == layer.groups]
    left += [layer for layer in chunkable if layer not in left]
    if not left:
        return []
    chunked = (
        'depthwise="chunked" would run those of over '
        f"{depthwise.CHUNK_CHANNELS} channels on slices of their channels, "
        "bit for bit Keras' values, but without XLA only; "
    ) if chunkable else ""
    return [
        f"recompute={recompute!r} cannot remove the largest "
        f"temporaries of {len(left)} depthwise Conv2D layer(s) "
        f"(e.g. {left[0].name!r}): Keras runs them as XLA-compiled "
        "grouped convolutions, whose gradient on a CPU goes through a "
        f"dense (kh, kw, C, C) filter. {chunked}compile(depthwise="
        "\"native\") runs TensorFlow's depthwise kernel, equal to "
        "float rounding (ConvNeXtTiny: 0.56x the training memory, "
        "0.22x the step time)."
    ]


def _chosen_layers(layers, setting, model, notes, none_found):
    """`layers` as a tuple; with none, a note that `setting` changes
    nothing, since `model` has `none_found`."""
    if not layers:
        notes.append(f"{setting} changes nothing: model {model.name!r} has {none_found}")
    return tuple(layers)
