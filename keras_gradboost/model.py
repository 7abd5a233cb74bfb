"""GradBoostModel and boost(): compile kwargs -> plan -> train_step."""

import contextlib
import inspect
import numbers
import threading
import warnings

import keras
import tensorflow as tf

from keras_gradboost import accumulate_check
from keras_gradboost import checkpoint
from keras_gradboost import guard
from keras_gradboost import hooks
from keras_gradboost import jit_measure
from keras_gradboost import measure_schedule
from keras_gradboost import precision as precision_lib
from keras_gradboost import precision_measure
from keras_gradboost import depthwise as depthwise_lib
from keras_gradboost import kernel_choice
from keras_gradboost import pointwise as pointwise_lib
from keras_gradboost import recompute as recompute_lib
from keras_gradboost import window_dropout
from keras_gradboost import wrappers
from keras_gradboost.accumulate import GradientAccumulator
from keras_gradboost.accumulate import activity_losses_are_means
from keras_gradboost.accumulate import listed
from keras_gradboost.accumulate import mean_activity_loss
from keras_gradboost.accumulate import overwrites_with_gradient
from keras_gradboost.accumulate import reduces_like_keras
from keras_gradboost.accumulate import repeats_change_update
from keras_gradboost.accumulate import loss_normaliser
from keras_gradboost.accumulate import sample_count
from keras_gradboost.locate import as_local_batch
from keras_gradboost.config import GradBoostConfig
from keras_gradboost.plan import TrainPlan
from keras_gradboost.state import StepFacts
from keras_gradboost.step import CrossReplicaStep
from keras_gradboost.step import flush_window


def _resumed(measurer, record, what):
    """Puts a saved record's measuring progress into `measurer`; warns where
    it cannot (another schedule). Returns no ignored entries."""
    problem = measurer.resume(record["progress"])
    if problem is not None:
        warnings.warn(
            f"The loaded weights hold {what}, but {problem}: this model "
            "measures again from the start (its first steps are not the "
            "ones the saved run would have taken: not an exact resume).",
            stacklevel=5,
        )
    return []


def _without_record(measurer, decided, option, chosen):
    """A load of weights saved before `option` had measured (no record):
    the schedule starts again, as a new model's would; a decision this
    model measured (`decided`, `chosen`) is kept, with a warning. Returns
    no ignored entries."""
    if decided is None:
        if measurer is not None and measurer.started:
            measurer.restart()
    elif decided.measured:
        warnings.warn(
            f"The loaded weights were saved before {option} had measured, but "
            f"this model has decided ({chosen}) and keeps it: its next steps are "
            "not the ones the saved run would have taken (not an exact resume). "
            "Load into a newly compiled model to measure as saved.",
            stacklevel=5,
        )
    return []


def _device_kind():
    """"GPU" or "CPU": what a saved jit_compile="measure" record was made on."""
    return "GPU" if precision_lib.gpu_available() else "CPU"


class _Runtime:
    """Per-model gradboost state: the `TrainPlan` of the last `compile()`,
    and the runtime state the plan does not fix. A plain object, so Keras
    and tf.Module do not track its variables as model weights or save them
    in checkpoints."""

    def __init__(self):
        self.plan = None
        # Training state loaded before `compile()`, put back by it.
        self.loaded_state = None
        self.start(None)

    def start(self, plan):
        """Fresh runtime state for `plan` (at every `compile()`)."""
        self.plan = plan
        self.float32_layers = []
        self.scaler = None  # precision.LossScaler
        self.facts = None  # state.StepFacts
        self.accumulator = None  # accumulate.GradientAccumulator
        self.window_draws = None  # window_dropout.WindowDraws, made with it
        self.warned_own_step_draws = False
        # Which trainable variables get a gradient (set at trace time).
        self.grad_mask = None
        self.flush_function = None
        self.flush_steps = 0  # the windows the flush function applies
        self.in_fit = False
        # (skipped_steps, checked_steps) at the last epoch end.
        self.last_health = (0, 0)
        self.warned_uneven = False  # see `_check_even_split`
        self.split_check = None  # its tf.function
        self.recompute_check_pending = bool(plan and plan.config.recompute_check)
        self.accumulate_check_pending = bool(plan and plan.config.accumulate_check)
        self.accumulate_check_deferred = False  # a window was not finite
        self.window_batches = []  # the first window's batches, for the check
        self.check_undo = None  # removes the first-step checks' wrapper
        self.checked_chunk = None  # the batches the checks saw last
        # attach_watch(): the attached watches, each in its own list, and the
        # gradient-check setting before the first.
        self.watches = []
        self.checks_before_watch = False
        self.jit_measurement = None  # jit_measure.JitMeasurement
        self.precision_measurement = None  # precision_measure.PrecisionMeasurement
        # precision="auto"'s (or "measure"'s) schedule and timings, shared by every
        # measuring function of this compile (a NaNWatcher's guarded one
        # too), saved with the weights while undecided.
        self.precision_measurer = None  # precision_measure.Measurer
        # jit_compile="measure"'s schedule and timings, the same way.
        self.jit_measurer = None  # jit_measure.Measurer
        # The dtype policy the layers hold now (precision="auto" switches
        # it while it measures, then keeps the winner's).
        self.layers_policy = plan.policy if plan else None
        # Calls of the update traced so far (a class's own train_step must
        # make one when the plan needs it).
        self.updates_traced = 0
        self.in_update = 0  # GradBoostModel's updates under way (trace time)
        # minimize() with other optimizers: (accumulator, scaler) per
        # (optimizer, variables), and their steps for the epoch-end flush.
        self.other_states = {}
        # The model's float state at the start of its own train_step, for
        # minimize(): a dropped update puts it back.
        self.own_step_state = guard.StateTap()
        # Tracing a class's own train_step that goes through minimize() or
        # super().train_step: it closes the NaNWatcher's step once, after
        # all its updates (trace time; per thread, as MirroredStrategy traces
        # each replica in its own).
        self.own_step_trace = threading.local()
        self.other_steps = []
        # Whether the model's own window is in use: the built-in step or
        # minimize() with the model's optimizer and weights accumulate into
        # it; a window loaded from a checkpoint waits in it.
        self.main_window_used = False
        self.loaded_window = False
        # Which XLA setting the pending window's micro-batches ran under
        # (jit_compile="measure" keeps it; saved with the window).
        self.jit_window = jit_measure.WindowSetting()
        self.warned_inexact_mask = False
        self.warned_sparse_repeats = False
        self.warned_layer_losses = False
        # Why XLA is off although jit_compile=True or "measure" asked for
        # it: the plan's reason, or one found while training.
        self.xla_blocked = plan.xla_blocked if plan else None
        # Ids of the layers that run another kernel than Keras' own
        # (`compile(depthwise="native")`, `compile(pointwise="matmul")`).
        self.kernel_ids = frozenset()

    @property
    def config(self):
        return self.plan.config if self.plan else GradBoostConfig()

    @property
    def recompute(self):
        """The plan's `RecomputeSetup`, or None."""
        return self.plan.recompute if self.plan else None

    @property
    def jit_requested(self):
        return self.plan.jit_requested if self.plan else "auto"


@keras.saving.register_keras_serializable(package="keras_gradboost")
class GradBoostModel(hooks.MultiWorkerTrainer, keras.Model):
    """A `keras.Model` whose training step adds gradient accumulation, mixed
    precision and loss scaling, each switched on through `compile()`.

    Use it like `keras.Model`: as a base class for a subclassed model, or as a
    functional model `GradBoostModel(inputs, outputs)`. `boost(model)` turns an
    existing model into one. Compiled without gradboost arguments it trains
    exactly like a plain `keras.Model`.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_gradboost

    inputs = keras.Input((20,))
    x = keras.layers.Dense(32, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    model = keras_gradboost.GradBoostModel(inputs, outputs)
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        accumulate_steps=4,
        precision="auto",
    )
    x_train = np.random.rand(512, 20).astype("float32")
    y_train = np.random.randint(0, 10, size=(512,))
    model.fit(x_train, y_train, batch_size=64)  # updates on 256 samples
    ```
    """

    def __new__(cls, *args, **kwargs):
        functional = hooks.functional_model_class()
        if hooks.functional_init_arguments(args, kwargs) and not issubclass(
            cls, functional
        ):
            # Instantiate a functional twin of `cls` instead of letting Keras
            # rewrite the bases of `cls` (and of GradBoostModel) in place.
            return keras.Model.__new__(_functional_twin(cls), *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gradboost = _Runtime()

    def __call__(self, *args, **kwargs):
        with self._chosen_kernels():
            return super().__call__(*args, **kwargs)

    def _chosen_kernels(self):
        """The context in which the layers `compile(depthwise="native")` and
        `compile(pointwise="matmul")` chose run their other kernel: every
        call of the model, and the recompute's own forwards (segments,
        estimates, checks)."""
        runtime = getattr(self, "_gradboost", None)  # None while Keras builds it
        return kernel_choice.running(runtime.kernel_ids if runtime else frozenset())

    # ------------------------------------------------------------------ compile

    def compile(
        self,
        *args,
        accumulate_steps=1,
        precision=None,
        loss_scale="auto",
        recompute=None,
        recompute_check=False,
        accumulate_check=False,
        depthwise=None,
        pointwise=None,
        **kwargs,
    ):
        """Configures the model for training, with the gradboost options.

        Takes every argument of `keras.Model.compile` (`optimizer`, `loss`,
        `metrics`, `jit_compile`, `steps_per_execution`, ...), plus:

        Args:
            jit_compile: Keras' `"auto"`, True or False, or `"measure"`: the
                first training calls of `fit` run alternately with and
                without XLA (each one a real step on the real batches: the
                first call of each traces and compiles and is not timed,
                then `jit_measure.TIMED_CALLS` timed calls of each; with
                `accumulate_steps` each timing is whole accumulation windows,
                so a window and its Dropout masks are one variant's), and the
                variant with the lower median is kept from then on (see
                `jit_measurement`; a one-line report is printed; saved with
                the weights, or the measuring progress before it). A step XLA
                cannot compile (an op without an XLA kernel) makes it choose
                no XLA. When a layer has `supports_jit=False` (or TensorFlow
                op determinism is on), True and `"measure"` turn XLA off
                with a warning naming the layer. Defaults to `"auto"`.
            accumulate_steps: int >= 1. Gradients of this many micro-batches
                (the batches `fit` draws) make one optimizer update, exactly
                equal to one step on their concatenation: each micro-batch is
                weighted by its sample count. Micro-batches left at the end of
                an epoch are applied as one smaller update. `optimizer.
                iterations` counts updates. Defaults to `1`.
            precision: `"float32"`, `"mixed_float16"`, `"mixed_bfloat16"`,
                `"auto"`, `"measure"` or `None`. Sets the dtype policy of
                every layer of the (possibly already built) model; variables
                stay float32 and, with a mixed policy, the output layers
                compute in float32.
                Ids in a float input reach `Embedding` and the other layers
                that read indices (`precision_ids.INDEX_LAYERS`) as given where a
                functional or Sequential graph shows the way (the layers on
                it, and a layer there whose only input they are, do not cast
                them); a subclassed model casts its float inputs as in plain
                Keras, and float ids so cast are refused with a `ValueError`
                (feed int ids). See `precision.apply_policy`.
                `"auto"` times the first training calls of `fit` in
                float32 and in the device's mixed policy (mixed_bfloat16 on a
                CPU, mixed_float16 on a GPU), alternately, each call a real
                step on the real batches (`precision_measure`: the first call
                of each traces and is not timed, then
                `precision_measure.TIMED_CALLS` timed calls of each; with
                accumulation, a timing holds whole windows), and keeps the
                one with the lower median, for training and for `evaluate`
                and `predict` (see `precision_measurement`; a one-line report
                is printed). Before, the layers hold the static rule's pick:
                mixed_float16 on a GPU and, on a CPU, mixed_bfloat16 when the
                CPU has bfloat16 instructions and XLA is off, else float32
                (while measuring, the candidate of the last call).
                With a float16 candidate, `loss_scale="auto"` scales the loss
                of both candidates (exact in float32: the scale is a power
                of two) and keeps scaling if float32 wins. It keeps the
                static pick, with a warning, under `run_eagerly=True`, under
                MultiWorkerMirroredStrategy, ParameterServerStrategy and
                TPUStrategy (each worker would choose alone) and with
                `jit_compile="measure"` (one measurement at a time).
                `"measure"` is `"auto"` that must measure: with
                `jit_compile="measure"` it raises a `ValueError`. The
                decision is saved with the weights (`save_weights`,
                `model.save`, `BackupAndRestore`): a model compiled with
                `"auto"` that loads it trains on in it without measuring
                (`precision_measurement.restored`); one saved while still
                measuring goes on with the same schedule. Saved among other
                candidates (another device), it is not adopted: a warning,
                and the model measures again.
                `None` leaves the model as built. Defaults to `None`.
            loss_scale: `"auto"` (dynamic loss scaling iff some layer computes
                in float16), `"dynamic"`, a float > 0 (a fixed scale) or `None`
                (off). A step whose gradients are not finite is not applied
                to the trainable weights (with accumulation: that micro-batch
                is not added), and a dynamic scale is halved. (Its forward
                pass still updated BatchNormalization statistics and metrics.)
                Defaults to `"auto"`.
            recompute: activation recompute (gradient checkpointing): chosen
                blocks keep only their inputs from the forward pass and run
                their forward again during the backward pass, with the same
                Dropout masks and BatchNormalization statistics (moving
                statistics are updated once). `None` (off); a list of layer
                names or glob patterns (`["encoder_*", "res_block_3"]`),
                nested layers included; `"auto"`: at the first training
                batch, the plan cheapest to recompute whose estimated
                training peak (activations and the gradients alive with
                them) is at most 8% of the activation memory above
                the lowest, among two kinds, every block (a layer that holds layers; a
                stack of them is split into its members), and segmentations
                of a functional model's layer graph cut where one tensor
                carries everything (about 2..n segments, sqrt(n) among
                them; likewise the graph of a functional model or
                `Sequential` called as a layer, such as a keras.applications
                base being fine-tuned, whose calls then run as a chain of
                its segments), when it
                saves at least 10% (else nothing is
                recomputed, with a warning; with batches of no fixed size,
                the blocks, else about sqrt(n) segments); `{"budget_mb": N}`:
                among the plans of both kinds, the cheapest to recompute
                whose estimated training peak (activations and the gradients
                alive with them, `recompute_plan().peak_bytes`) fits N MiB
                at the training batch size (add `"batch_size": B` when
                batches have no fixed size; a fit whose measured
                allocator peak is over N warns); `{"policy": "selective"}` (with `"blocks"`: `"auto"`
                or a list of patterns; "auto" takes the kind of plan whose
                blocks hold the most kernel layers): inside the blocks the
                outputs of the kernel layers (Dense, EinsumDense,
                convolutions; before their activation) are kept and only
                the rest is recomputed, so the backward runs no matmul
                again (`{"policy": "full", "blocks": b}` is `b`).
                See `recompute_plan()`. Defaults to `None`.
            recompute_check: if True, the first training batch is run once
                without recompute and once with each block recomputed (and
                each block holding chosen blocks, with them recomputed inside
                its replay), and a `RecomputeCheckError` names a block that
                changes a gradient. Defaults to `False`.
            accumulate_check: if True, before the first accumulation window's
                update, its accumulated gradient is compared with the
                gradient of one step on its micro-batches concatenated (no
                variable changes); an `AccumulationCheckError` names what it
                can identify as the cause (BatchNormalization layers, a loss
                that normalises per batch, a layer with state) and the
                variables that differ most. Needs `accumulate_steps > 1`.
                Defaults to `False`.
            depthwise: `None`, `"keras"`, `"chunked"` or `"native"`. Keras runs a
                grouped `Conv2D` as an XLA-compiled function; on a CPU,
                XLA's filter gradient goes through a dense `(kh, kw, C, C)`
                filter (ConvNeXtTiny's last stage: a 220 MiB temporary).
                Where a layer's groups equal its input channels (ConvNeXt's
                depthwise convolutions), in every forward of this model
                (training, `predict`, `evaluate`; the model given to
                `boost()` keeps Keras' way): `"chunked"` runs Keras' own
                grouped convolution on slices of at most 96 channels, whose
                dense filters are (C / 96)^2 times smaller; its values and
                gradients are Keras' bit for bit, checked on this machine at
                each layer's first trace (a layer whose check differs runs as
                Keras runs it, with a warning; so does every layer in a step
                XLA compiles as a whole). `"native"` runs TensorFlow's
                depthwise kernel (ConvNeXtTiny, 64x64, batch 16: 0.22x the
                step time, 0.56x the training peak); values equal Keras' to
                float rounding (another summation order), not bit for bit.
                Layers an option cannot serve (channels_first; "chunked": a
                depth multiplier, 96 channels or fewer; "native": unequal
                strides, a stride with a dilation) run as Keras runs them;
                with none to serve, a warning. `None` runs Keras' way, but
                with `recompute` on, on a CPU and without XLA (in any
                precision: under a mixed policy each slice's part of the
                float32 kernel is cast inside Keras' XLA function, where
                Keras casts the whole), it
                runs `"chunked"` (bit for bit, so recompute stays exact;
                ConvNeXtTiny "auto": 0.11x the training memory of no
                recompute instead of 0.56x); `"keras"` keeps Keras' way
                always. See `train_plan.depthwise_setting` and
                `train_plan.depthwise_layers`. Defaults to `None`.
            pointwise: `None` or `"matmul"`. `"matmul"` runs each `Conv2D`
                with a 1x1 kernel (one group, no dilation, channels_last)
                as a matrix product, in every forward of this model. Where
                oneDNN is off (TensorFlow's default on CPUs without
                AVX-512), TensorFlow's convolution backward copies the
                input of each into two working buffers (up to ~30 MiB
                each), which recompute cannot remove; a matmul's backward
                needs none (MobileNetV2 at 64x64, batch 16, on an AVX2 CPU:
                `recompute="auto"` at 0.42x of no recompute's memory instead
                of 0.68x, and 0.80x the step time without recompute).
                Values equal Keras' to float rounding, not bit for bit. A
                class with its own `convolution_op` keeps it. With no such
                layer, a warning. See `train_plan.pointwise_layers` and
                `pointwise`. Defaults to `None`.

        Raises:
            TypeError: if a gradboost argument or `jit_compile` has the wrong
                type.
            ValueError: if a gradboost argument or `jit_compile` has a bad
                value, `precision="measure"` comes with
                `jit_compile="measure"`, or an argument conflicts
                with the optimizer (its own `gradient_accumulation_steps`, or a
                `LossScaleOptimizer` together with gradboost loss scaling or
                accumulation) or with `auto_scale_loss=True`.
        """
        config = GradBoostConfig(
            accumulate_steps=accumulate_steps,
            precision=precision,
            loss_scale=loss_scale,
            recompute=recompute,
            recompute_check=recompute_check,
            accumulate_check=accumulate_check,
            depthwise=depthwise,
            pointwise=pointwise,
        )
        plan = TrainPlan.build(config, self, _bind_compile_args(args, kwargs))
        if config.accumulate_steps > 1:
            activity_losses_are_means()  # found eagerly, before any trace
        self._apply_plan(plan)
        for message in self._gradboost.plan.warnings:
            warnings.warn(message, stacklevel=2)

    def _apply_plan(self, plan):
        """Applies a `TrainPlan`: the dtype policy, Keras' compile, a fresh
        runtime state (loss scaler, step facts), the recompute marks."""
        rt = self._gradboost
        if rt.accumulator is not None:
            self.flush_accumulated_gradients()  # nothing pending is lost
        float32_layers = []
        if plan.policy is not None:
            float32_layers = precision_lib.apply_policy(self, plan.policy)
        super().compile(**plan.keras_kwargs)
        if bool(self.jit_compile) != plan.jit_compile:
            # Keras turned XLA off (or on) where the plan did not expect it.
            replanned = plan.with_jit(self.jit_compile, model=self)
            if replanned.policy != plan.policy:
                float32_layers = precision_lib.apply_policy(self, replanned.policy)
            plan = replanned
        rt.start(plan)
        rt.float32_layers = float32_layers
        if plan.jit_requested == "measure" and plan.xla_blocked:
            rt.jit_measurement = jit_measure.JitMeasurement(
                jit_compile=False, reason=f"XLA is off: {plan.xla_blocked}"
            )
        if plan.precision_blocked:
            rt.precision_measurement = precision_measure.PrecisionMeasurement(
                policy=plan.policy,
                mixed_policy=plan.precision_candidates[1],
                reason=f"not measured ({plan.precision_blocked}): the static "
                "rule's pick",
            )
        if plan.recompute is not None:
            plan.recompute.apply()
        rt.kernel_ids = depthwise_lib.apply(
            plan.depthwise_layers, plan.depthwise_setting, owner=self,
            chosen_by=plan.depthwise_chosen_by,
        ) | pointwise_lib.apply(
            plan.pointwise_layers
        )
        with self.distribute_strategy.scope():
            rt.facts = StepFacts()
            if plan.loss_scale is not None:
                rt.scaler = precision_lib.LossScaler(*plan.loss_scale)
        if rt.loaded_state is not None:  # loaded before this compile()
            state, rt.loaded_state = rt.loaded_state, None
            checkpoint.restore(self, state)

    @property
    def _gradboost_training_state(self):
        """The object through which Keras' saving keeps the loss scale, the
        skip counters and a pending accumulation window (see
        `keras_gradboost.checkpoint`)."""
        return checkpoint.TrainingState(self)

    def get_compile_config(self):
        config = super().get_compile_config()
        if config:
            requested = self._gradboost.jit_requested
            if requested is True or requested == "measure":
                config["jit_compile"] = requested  # Keras keeps what it ran
            plan = self._gradboost.plan
            config["gradboost"] = {
                **self._gradboost.config.to_dict(),
                "auto_scale_loss": plan.auto_scale_loss if plan else False,
            }
        return config

    def compile_from_config(self, config):
        config = dict(config)
        gradboost = config.pop("gradboost", {})
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config, **gradboost)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    @property
    def gradboost_config(self):
        """The validated `GradBoostConfig` from the last `compile()`."""
        return self._gradboost.config

    @property
    def train_plan(self):
        """The `TrainPlan` of the last `compile()`: what it decided for jit,
        precision, loss scaling and recompute, and why; None before."""
        return self._gradboost.plan

    @property
    def step_facts(self):
        """`StepFacts` of the training step: finiteness, skips, None grads.

        Raises:
            RuntimeError: before `compile()`, which makes them.
        """
        if self._gradboost.facts is None:
            raise RuntimeError(
                "`step_facts` are made by `compile()`: call `model.compile(...)` "
                "before reading them."
            )
        return self._gradboost.facts

    @property
    def jit_measurement(self):
        """What `compile(jit_compile="measure")` chose, and why.

        A `jit_measure.JitMeasurement` (`jit_compile`, `xla_ms`,
        `no_xla_ms`, `timed_calls`, `reason`, and `restored`: loaded with
        the weights, measured by the run that saved them) once decided; None
        before, and for any other `jit_compile`.
        """
        return self._gradboost.jit_measurement

    @property
    def precision_measurement(self):
        """What `compile(precision="auto")` (or `"measure"`) chose, and why.

        A `precision_measure.PrecisionMeasurement` (`policy`,
        `mixed_policy`, `float32_ms`, `mixed_ms`, `timed_calls`,
        `calls_per_timing`, `reason`, `restored`) once decided, or loaded
        with the weights (`restored` is True: the saving run's medians), or
        at `compile()` when it cannot measure (`measured` is False: the
        static rule's pick); None before, and for any other `precision`.
        """
        return self._gradboost.precision_measurement

    @property
    def xla_blocked_reason(self):
        """Why XLA is off although `jit_compile=True` or `"measure"` asked for
        it (a layer with `supports_jit=False`, an op without an XLA kernel,
        ...), or None."""
        return self._gradboost.xla_blocked

    @property
    def dtype_policy_applied(self):
        """The dtype policy `compile(precision=...)` set on the layers, or
        None: for `precision="auto"`, the winner once measured (before,
        the candidate the layers hold now)."""
        return self._gradboost.layers_policy

    def recompute_plan(self, batch_size=None):
        """What `compile(recompute=...)` recomputes, with memory estimates.

        The estimates come from the traced training graph: for each block,
        the activations made inside it that the backward pass keeps without
        recompute, and its inputs (kept with recompute).

        Args:
            batch_size: the batch size to estimate for. Defaults to the
                training batch size, once known (the budget's `batch_size`,
                or the first training batch).

        Returns:
            A `RecomputePlan` (`print()` it for a table); without a known
            batch size and input shape, it lists the blocks only.

        Raises:
            TypeError, ValueError: if `batch_size` is not None or an int >= 1.
        """
        _check_batch_size(batch_size)
        setup = self._gradboost.recompute
        if setup is None:
            return recompute_lib.RecomputePlan(setting=None)
        with self._chosen_kernels():
            return setup.report(self, batch_size)

    @property
    def float32_layers(self):
        """Names of the output layers `compile(precision=...)` kept float32."""
        return list(self._gradboost.float32_layers)

    # ------------------------------------------------- hooks for callbacks

    def training_forward(self, x):
        """The forward pass the training step runs, as a probe.

        Runs `x` through the model with `training=True` and through the
        recompute blocks that `compile(recompute=...)` chose, exactly as
        `train_step` does; the first call settles what the recompute forward
        needs from a batch (a budget's choice of blocks, the input spec),
        as the first traced step would. It computes no gradient and applies
        no update: callbacks use it to time or trace the step's forward
        (`StepTimeMonitor`'s split). Call it inside your own
        `tf.GradientTape` to differentiate it.

        Args:
            x: the inputs of one training batch (tensors).

        Returns:
            The model's outputs.
        """
        self._prepare_forward(x)
        return self._training_forward(x)

    def attach_watch(self, watch):
        """Makes the training step check its gradients and record each
        checked step in `watch`, until the returned undo is called.

        With the watch attached, the step checks gradients for non-finite
        values (as it does with loss scaling), drops the update of a
        non-finite step, and records each checked step in `watch` (whose
        halt flag drops later updates too). `NaNWatcher` attaches its watch
        for the duration of `fit`. Attach before the train function is
        traced (the step reads both at trace time).

        Args:
            watch: a `keras_gradboost.guard.WatchState`.

        Returns:
            A function that takes this watch away again (a second call does
            nothing). Attachments stack: undone in any order, the watch
            attached last and still attached is the one recorded in, and
            undoing the last one puts back the gradient-check setting from
            before the first.

        Raises:
            RuntimeError: if the model is not compiled.
        """
        facts = self.step_facts  # raises before compile()
        rt = self._gradboost
        if not rt.watches:
            rt.checks_before_watch = facts.checks_gradients
        entry = [watch]  # this attachment (a watch may be attached twice)
        rt.watches.append(entry)
        facts.checks_gradients, facts.watch = True, watch

        def undo():
            # Attachments stack: undone in any order, each takes only itself
            # away; the last one undone puts back the setting before them.
            if not any(e is entry for e in rt.watches):
                return
            rt.watches[:] = [e for e in rt.watches if e is not entry]
            if rt.watches:
                facts.watch = rt.watches[-1][0]
            else:
                facts.checks_gradients, facts.watch = rt.checks_before_watch, None

        return undo

    # ------------------------------------------------------------- train step

    def make_train_function(self, force=False):
        # fit/train_on_batch call this after building the model when a
        # distribution strategy is set: create the accumulators here, in the
        # strategy's scope. Without a strategy Keras builds the model while
        # tracing the step, and train_step creates them (see _accumulator).
        if self.trainable_variables and self._needs_new_accumulator():
            self._ensure_accumulator()
            force = True
        rt = self._gradboost
        if "train_step" in own_steps(self) and _OWN_STEP not in vars(self):
            # Kept on the model (object.__setattr__: Keras does not track it).
            object.__setattr__(
                self, _OWN_STEP, wrappers.patch(self, "train_step", self._own_step)
            )
        if self._measuring_jit() and (force or self.train_function is None):
            self.train_function = self._make_measuring_function()
        elif self._measuring_precision() and (force or self.train_function is None):
            self.train_function = self._make_precision_measuring_function()
        else:
            super().make_train_function(force=force)
        base = wrappers.base_train_function(self)
        decided = rt.jit_measurement
        if isinstance(base, jit_measure.MeasuringTrainFunction) and decided:
            # Decided by itself, or by another measuring function (a
            # NaNWatcher's guarded one): keep only the choice.
            self._keep_choice(base, base.functions[decided.jit_compile])
        decided = rt.precision_measurement
        if isinstance(base, precision_measure.MeasuringTrainFunction) and decided:
            self._keep_choice(base, base.functions[decided.policy])
        checks_pending = rt.recompute_check_pending or rt.accumulate_check_pending
        if checks_pending and not self._check_wrapped():
            _, undo = wrappers.hold_batches(self, before_call=self._check)
            rt.check_undo = undo
        return self.train_function

    def _check_wrapped(self):
        """Whether the first-step checks' wrapper is in the train function's
        stack already (under other callbacks' wrappers, maybe): a second one
        would see each batch twice."""
        return any(
            getattr(p.around, "before_call", None) == self._check
            for p in wrappers.patches(self, "train_function")
        )

    def _own_step(self, train_step, data):
        """Traces the class's own `train_step`; refuses, before any update
        is traced, a step that applies gradients itself while the plan needs
        GradBoostModel's update (accumulation, loss scaling): an optimizer
        the model holds applied outside that update (raised at the call; with
        `run_eagerly=True` the step's earlier updates have run by then), or
        no update through it at all."""
        with self._own_forward(data):
            return self._own_update(train_step, data)

    @contextlib.contextmanager
    def _own_forward(self, data):
        """Around the class's own `train_step`: the layers it calls run the
        kernels `depthwise`/`pointwise` chose, and the recompute blocks it
        calls recompute (it may call them directly, e.g. a VAE's
        `self.encoder(x)`, where no call of the model runs)."""
        rt = self._gradboost
        setup = rt.recompute
        # Its forward's losses, when accumulating (`minimize()` accumulates
        # too), are looked at as the built-in step's are.
        around = setup.around_own_step(self, data) if setup else contextlib.nullcontext()
        with self._chosen_kernels(), around, self._watching_layer_losses() as added:
            yield
        if rt.config.accumulate_steps > 1:
            # What its `count` weighs by (samples, a mask's entries) is its own.
            self._warn_layer_losses(added, by_samples=False)

    def _own_update(self, train_step, data):
        """`train_step(data)`, refused where it bypasses the update the
        plan needs (see `_own_step`)."""
        rt = self._gradboost
        needs = []
        if rt.config.accumulate_steps > 1:
            needs.append(f"accumulate_steps={rt.config.accumulate_steps}")
        if rt.scaler is not None:
            needs.append(f"loss_scale={rt.config.loss_scale!r} (on for this model)")
        if not needs:
            return train_step(data)
        if self._checks_steps():
            rt.own_step_state.put(self)
        before = rt.updates_traced
        optimizers = [self.optimizer] if self.optimizer is not None else []
        undos = [
            wrappers.patch(o, "apply", _refusing_apply(self, o, needs))
            for o in optimizers + _other_optimizers(self)
        ]
        rt.own_step_trace.active = True
        try:
            logs = train_step(data)
            if rt.facts.watch is not None:
                rt.facts.watch.advance()  # after every update it recorded
            logs = rt.own_step_state.settle(self, logs)
        finally:
            rt.own_step_trace.active = False
            rt.own_step_state.take()  # this trace's tensors: not for the next
            for undo in reversed(undos):
                undo()
        if rt.updates_traced == before:
            raise ValueError(
                f"{type(self).__name__}.train_step, the model's own training "
                "step, did not go through GradBoostModel's update, so "
                f"{' and '.join(needs)} would be silently ignored. Let its "
                "update go through GradBoostModel: call "
                "`super().train_step(data)`, or `self.minimize(tape, loss, "
                "variables, optimizer)` for each update; or compile without "
                "these options (accumulate_steps=1, loss_scale=None)."
            )
        return logs

    def _measuring_jit(self):
        rt = self._gradboost
        return (
            rt.jit_requested == "measure"
            and rt.jit_measurement is None
            and not self.run_eagerly
        )

    def _make_measuring_function(self):
        """Keras' train function with XLA and without, behind one function
        that runs them as `jit_measure` says until it decides."""
        functions = {}
        for jit in (True, False):
            self.jit_compile = jit  # Keras reads it when it makes the function
            super().make_train_function(force=True)
            functions[jit] = self.train_function
        return jit_measure.MeasuringTrainFunction(
            self, functions, self._jit_decided, measurer=self._jit_measurer(),
            window_closed=self._window_closed,
            window=self._gradboost.jit_window, on_mixed_window=self._warn_xla_failed_on_window,
        )

    def _jit_measurer(self):
        """`jit_compile="measure"`'s schedule, shared by every measuring
        function of this compile and saved with the weights while
        undecided."""
        rt = self._gradboost
        if rt.jit_measurer is None:
            rt.jit_measurer = jit_measure.Measurer(
                calls_per_timing=measure_schedule.calls_per_timing(
                    rt.config.accumulate_steps, self.steps_per_execution
                )
            )
        return rt.jit_measurer

    def _jit_state(self):
        """What the weights file keeps of `jit_compile="measure"` (see
        `jit_measure.saved_state`), or None."""
        rt = self._gradboost
        if rt.jit_requested != "measure":
            return None
        return jit_measure.saved_state(rt.jit_measurement, rt.jit_measurer, _device_kind())

    def _restore_jit(self, record):
        """Adopts a saved `jit_compile="measure"` record: a decision is kept
        without measuring; progress is gone on from, call for call, so the
        calls after a resume run under the settings the saved run's would
        have; no record (saved before any measuring) starts the schedule
        again, as a new model would. Warns, naming both, where it cannot be
        (another device kind or schedule, a decision made since, XLA off
        here); returns what this model cannot take at all (compiled with
        another jit_compile), for the caller's warning."""
        rt = self._gradboost
        if rt.jit_requested != "measure":
            if record is None:
                return []
            decision = record.get("decision")
            if decision is not None and decision["jit_compile"] == bool(self.jit_compile):
                return []  # compiled with the setting it chose
            what = jit_measure.describe(record)
            return [f"{what} (this model is compiled with jit_compile={rt.jit_requested!r})"]
        decided = rt.jit_measurement
        blocked = decided is not None and not decided.measured
        if record is None:
            chosen = decided and ("XLA" if decided.jit_compile else "no XLA")
            return _without_record(rt.jit_measurer, decided, 'jit_compile="measure"', chosen)
        what = jit_measure.describe(record)
        if blocked:
            if record.get("decision", {}).get("jit_compile") is False:
                return []  # no XLA, as here
            warnings.warn(
                f"The loaded weights hold {what}, but XLA is off here "
                f"({rt.xla_blocked}): not adopted, this model trains without XLA "
                "(not an exact resume).",
                stacklevel=4,
            )
            return []
        device = _device_kind()
        if record["device"] != device:
            warnings.warn(
                f"The loaded weights hold {what} made on a {record['device']}; this "
                f"model trains on a {device}: not adopted, it measures again. "
                "Compile with the chosen jit_compile to train on as saved.",
                stacklevel=4,
            )
            return []
        if decided is not None:
            kept = "a loaded decision" if decided.restored else "its own decision"
            if "decision" in record and record["decision"]["jit_compile"] == decided.jit_compile:
                return []
            warnings.warn(
                f"The loaded weights hold {what}, but this model has {kept} "
                f"({'XLA' if decided.jit_compile else 'no XLA'}) already and keeps "
                "it: its next steps are not the ones the saved run would have taken "
                "(not an exact resume). Load into a newly compiled model to go on "
                "as saved.",
                stacklevel=4,
            )
            return []
        if "decision" in record:
            measurement = jit_measure.restored_measurement(record["decision"])
            if rt.jit_measurer is not None:  # a measuring function left anywhere runs the choice
                rt.jit_measurer.result = measurement
            self._jit_decided(measurement, None)
            return []
        return _resumed(self._jit_measurer(), record, what)

    def _pending_window_jit(self):
        """Whether the pending window's micro-batches ran under XLA, saved
        with them (`checkpoint`); None where no window is pending, or where
        that is not known."""
        rt = self._gradboost
        if rt.jit_window.mixed or self._window_closed():
            return None
        if self._measuring_jit():
            return rt.jit_window.jit
        return bool(self.jit_compile)

    def _loaded_window(self, saved, pending):
        """At a load: `pending` micro-batches of a window that ran under XLA
        (`saved` True), without (False), or either (None: a file saved
        before this was saved). `jit_compile="measure"` runs the rest under
        `saved`; where it cannot, and where this model's fixed setting is
        the other, a warning where Dropout draws."""
        rt = self._gradboost
        measuring = self._measuring_jit()
        if measuring:  # else the rest runs under this model's setting
            measurer = rt.jit_measurer  # with loaded progress, its unit goes on
            rt.jit_window.loaded(
                saved, pending, held=measurer is not None and measurer.in_unit(saved)
            )
        if not pending or rt.window_draws is None:
            return
        if measuring:
            if saved is None:
                self._warn_mixed_window(
                    "under XLA or without, which the file does not say (saved by an "
                    "earlier version), and the rest of the window runs under the "
                    "setting the measuring is at",
                    "Compile with jit_compile=True or False, as the saved run "
                    "trained, to resume such a window exactly.",
                )
            return
        if saved is None or saved == bool(self.jit_compile):
            return
        remedy = (
            f"XLA is off here ({rt.xla_blocked}): this model cannot resume such "
            "a window exactly."
            if saved and rt.xla_blocked
            else f'Compile with jit_compile={saved} (or "measure", which '
            "finishes a loaded window under its setting) to resume it exactly."
        )
        self._warn_mixed_window(
            f"{'under' if saved else 'without'} XLA, and this model runs the rest "
            f"of the window {'without' if saved else 'under'} XLA (jit_compile="
            f"{bool(self.jit_compile)})",
            remedy,
        )

    def _warn_xla_failed_on_window(self):
        """Warns where a window begun under XLA goes on without, XLA failing
        to compile the step here (a loaded window, or a retrace)."""
        if self._gradboost.window_draws is not None:
            self._warn_mixed_window(
                "under XLA, and XLA cannot compile the step here: the rest of the "
                "window runs without",
                "A run without XLA (jit_compile=False) keeps its windows exact.",
            )

    def _warn_mixed_window(self, how, remedy):
        """Warns that the pending window's micro-batches drew their Dropout
        masks under two settings: `how`, and what to do (`remedy`)."""
        rt = self._gradboost
        pending = checkpoint.pending_micro_batches(self)
        warnings.warn(
            f"The {pending} micro-batch(es) of the pending accumulation window drew "
            f"their Dropout masks ({listed(rt.window_draws.layer_names, 4)}) {how}: the "
            "window is not one large-batch step where the two differ "
            "(TensorFlow's random numbers under XLA are not its numbers without). "
            + remedy,
            stacklevel=2,
        )

    def _window_closed(self):
        """Whether no micro-batch of an accumulation window is pending: the
        model's own, or one `minimize()` keeps for another optimizer (read
        on the host; the measuring functions read it around their calls)."""
        if checkpoint.pending_micro_batches(self):
            return False
        strategy = self.distribute_strategy
        return not any(
            acc is not None and acc.pending(strategy)
            for acc, _ in self._gradboost.other_states.values()
        )

    def _keep_choice(self, measuring, function):
        """Puts the chosen `function` in the place of the `measuring` one, so
        whoever put that in (a callback) takes the choice away with it."""
        if not wrappers.swap_base(self, "train_function", measuring, function):
            wrappers.replace_base_train_function(self, function)

    def _jit_decided(self, measurement, function):
        rt = self._gradboost
        rt.jit_measurement = measurement
        if not measurement.measured:  # XLA off, or failing to compile
            rt.xla_blocked = measurement.reason
        if bool(self.jit_compile) != measurement.jit_compile:
            self.jit_compile = measurement.jit_compile
            # Made again, when needed, with the chosen setting.
            self.test_function = None
            self.predict_function = None
        measuring = wrappers.base_train_function(self)
        if isinstance(measuring, jit_measure.MeasuringTrainFunction):
            self._keep_choice(measuring, function or measuring.functions[measurement.jit_compile])
        hooks.print_msg(measurement.message())

    def _measuring_precision(self):
        rt = self._gradboost
        return (
            precision_lib.measures(rt.config.precision)
            and rt.precision_measurement is None
            and not self.run_eagerly
        )

    def _make_precision_measuring_function(self):
        """Keras' train function for each `precision="auto"` candidate
        (traced at its first call, under the policy the measuring function
        sets then), behind one function that runs them as
        `precision_measure` says until it decides."""
        rt = self._gradboost
        functions = {}
        for policy in rt.plan.precision_candidates:
            super().make_train_function(force=True)
            functions[policy] = self.train_function
        return precision_measure.MeasuringTrainFunction(
            self, functions, self._set_layers_policy, self._precision_decided,
            measurer=self._precision_measurer(), window_closed=self._window_closed,
        )

    def _precision_measurer(self):
        """The `precision_measure.Measurer` of this compile (made at the
        first need: a measuring function, or a load of saved progress)."""
        rt = self._gradboost
        if rt.precision_measurer is None:
            rt.precision_measurer = precision_measure.Measurer(
                rt.plan.precision_candidates,
                calls_per_timing=measure_schedule.calls_per_timing(
                    rt.config.accumulate_steps, self.steps_per_execution
                ),
            )
        return rt.precision_measurer

    def _set_layers_policy(self, policy):
        """Sets `policy` on the layers (as `compile(precision=policy)` does),
        unless they hold it already."""
        rt = self._gradboost
        if rt.layers_policy != policy:
            rt.float32_layers = precision_lib.apply_policy(self, policy)
            rt.layers_policy = policy

    def _precision_decided(self, measurement, function=None):
        """Keeps `measurement`'s policy: on the layers, and its candidate
        `function` (by default the measuring function's own) as the train
        function. Also for a decision loaded with the weights."""
        rt = self._gradboost
        rt.precision_measurement = measurement
        self._set_layers_policy(measurement.policy)
        # Made again, when needed, under the chosen policy (one made while
        # measuring traced under the policy of that moment).
        self.test_function = None
        self.predict_function = None
        measuring = wrappers.base_train_function(self)
        if isinstance(measuring, precision_measure.MeasuringTrainFunction):
            self._keep_choice(measuring, function or measuring.functions[measurement.policy])
        hooks.print_msg(measurement.message(rt.config.precision))

    def _precision_state(self):
        """What the weights file keeps of `precision="auto"` (see
        `precision_measure.saved_state`), or None."""
        rt = self._gradboost
        if not precision_lib.measures(rt.config.precision):
            return None
        return precision_measure.saved_state(
            rt.plan.precision_candidates, rt.precision_measurement, rt.precision_measurer
        )

    def _restore_precision(self, record):
        """Adopts a saved `precision="auto"` record (see
        `precision_measure.saved_state`): a decision is kept without
        measuring; progress is gone on from, call for call. Warns, naming
        both, where it cannot be (other candidates or schedule, a decision
        made since); returns what this model cannot take at all (compiled
        with another precision), for the caller's warning."""
        rt = self._gradboost
        if record is None:
            if not precision_lib.measures(rt.config.precision):
                return []
            decided = rt.precision_measurement
            return _without_record(
                rt.precision_measurer, decided, 'precision="auto"', decided and decided.policy
            )
        what = precision_measure.describe(record)
        if not precision_lib.measures(rt.config.precision):
            decision = record.get("decision")
            if decision is not None and decision["policy"] == rt.plan.policy:
                return []  # compiled with the policy it chose
            return [f"{what} (this model is compiled with precision={rt.config.precision!r})"]
        candidates, own = tuple(record["candidates"]), rt.plan.precision_candidates
        if candidates != own:
            warnings.warn(
                f"The loaded weights hold {what} among {candidates}, but this "
                f"model's candidates are {own} (another device): not adopted, "
                "this model measures again. Compile with the chosen precision "
                "to train on as saved.",
                stacklevel=4,
            )
            return []
        if "decision" in record:
            self._precision_decided(precision_measure.restored_measurement(record["decision"]))
            return []
        decided = rt.precision_measurement
        if decided is not None:
            if decided.restored or not decided.measured:
                kept = "the static rule's pick" if not decided.measured else "a loaded decision"
            else:
                kept = "its own decision"
            warnings.warn(
                f"The loaded weights hold {what}, but this model has "
                f"{kept} ({decided.policy}) already and keeps it: its next "
                "steps are not the ones the saved run would have taken (not an "
                "exact resume). Load into a newly compiled model to go on "
                "measuring as saved.",
                stacklevel=4,
            )
            return []
        return _resumed(self._precision_measurer(), record, what)

    def _check(self, batches):
        """Runs the first-step checks before the call of `batches` (the
        recompute check on the first batch; the accumulation check once the
        first window is complete, before its update)."""
        rt = self._gradboost
        if not (rt.recompute_check_pending or rt.accumulate_check_pending):
            return  # a wrapper left inside a function made meanwhile
        # A NaNWatcher's train function, made while the checks were pending,
        # holds a wrapper of its own under this one: each chunk is seen once.
        last = rt.checked_chunk
        if last is not None and len(last) == len(batches) and all(
            a is b for a, b in zip(last, batches)
        ):
            return
        rt.checked_chunk = list(batches)
        local = [as_local_batch(b, self.distribute_strategy) for b in batches]
        if rt.recompute_check_pending:
            rt.recompute_check_pending = False
            with self._chosen_kernels():
                rt.recompute.check(self, local[0])
        if rt.accumulate_check_pending:
            self._accumulate_check(local)
        if not (rt.recompute_check_pending or rt.accumulate_check_pending):
            rt.checked_chunk = None
            rt.check_undo()

    def _accumulate_check(self, local_batches):
        rt = self._gradboost
        steps = rt.config.accumulate_steps
        acc = rt.accumulator
        if not rt.window_batches and acc is not None and int(acc.micro_step.numpy()):
            rt.accumulate_check_pending = False
            warnings.warn(
                "accumulate_check=True: the first fit started in the middle of "
                "an accumulation window (loaded, or left by an earlier fit), "
                "so there was no whole window to check; nothing was checked.",
                stacklevel=2,
            )
            return
        rt.window_batches.extend(local_batches)
        if len(rt.window_batches) >= steps:
            window, rt.window_batches = rt.window_batches[:steps], rt.window_batches[steps:]
            rt.accumulate_check_pending = False
            if not accumulate_check.check(self, window):
                rt.accumulate_check_pending = True  # the next window, then
                if not rt.accumulate_check_deferred:
                    rt.accumulate_check_deferred = True
                    warnings.warn(
                        "accumulate_check=True: the first accumulation window "
                        "holds a non-finite micro-batch, so it says nothing "
                        "about the accumulation; the next window without one "
                        "is checked instead.",
                        stacklevel=2,
                    )

    def _needs_new_accumulator(self):
        rt = self._gradboost
        return rt.config.accumulate_steps > 1 and (
            rt.accumulator is None
            or not rt.accumulator.matches(self.trainable_variables)
        )

    def _new_accumulator(self):
        rt = self._gradboost
        rt.accumulator = GradientAccumulator(
            self.trainable_variables, rt.config.accumulate_steps
        )
        rt.window_draws = window_dropout.WindowDraws.for_model(self)
        rt.flush_function = None

    def _ensure_accumulator(self):
        """The accumulator, made now (in the strategy's scope) if needed."""
        if self._needs_new_accumulator():
            with self.distribute_strategy.scope():
                self._new_accumulator()
        return self._gradboost.accumulator

    def _accumulator(self):
        """The accumulator, created at trace time if the model was built by
        this very trace (no strategy: Keras builds lazily)."""
        if self._needs_new_accumulator():
            if tf.distribute.has_strategy():
                raise RuntimeError(
                    "The trainable variables changed after the train function "
                    "was made; call `compile()` again after changing them."
                )
            with tf.init_scope():
                self._new_accumulator()
        return self._gradboost.accumulator

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        rt = self._gradboost
        if rt.facts is None:  # a model trained before `compile()` finished
            raise RuntimeError("Call `compile()` before training the model.")
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        n = sample_count(x)
        if replicas > 1:  # (read at the epoch's end: `_check_even_split`)
            rt.facts.rows_seen.assign_add(tf.cast(n, tf.int64))
        # Put back if the step is dropped as non-finite (before the forward
        # pass writes BatchNormalization's moving statistics).
        state = guard.StepState.take(self) if self._checks_steps() else None

        self._prepare_forward(x)
        accumulating = rt.config.accumulate_steps > 1
        with self._window_draws(x, n):
            with tf.GradientTape() as tape:
                with self._watching_layer_losses() as added:
                    y_pred = self._training_forward(x)
                loss = hooks.compute_loss(
                    self, x, y, y_pred, sample_weight, training=True
                )
                batch_loss = loss * replicas if replicas > 1 else loss
                hooks.loss_tracker(self).update_state(batch_loss, sample_weight=n)
                # Accumulators sum count_j * (the replica's loss gradient) over
                # micro-batches, count_j being what Keras divided the loss by (the
                # samples, or a mask's valid entries). Keras' loss is also divided
                # by `replicas`, so the weight is count * replicas; it goes on the
                # scalar loss (free), or on the gradients together with the
                # loss-scale division (one pass).
                count = self._window_count(y_pred, n)
                if accumulating:  # weighted by a mask's entries, a mean over samples is not exact
                    self._warn_layer_losses(added, by_samples=count is n)
                weight = count * replicas if accumulating else 1.0
                loss = self._loss_to_differentiate(loss, weight)

            variables = self.trainable_weights
            if not variables:
                warnings.warn("The model does not have any trainable weights.")
                return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

            grads = tape.gradient(loss, variables)  # a replay draws as the forward did
            rt.facts.none_gradient_variables = tuple(
                v.path for v, g in zip(variables, grads) if g is None
            )
            if rt.config.accumulate_steps > 1:
                self._warn_sparse_repeats(grads, variables, self.optimizer)
            if self._weights_gradients():
                factor = weight if rt.scaler is None else weight / rt.scaler.scale
                # A value, not a gradient: Keras neither unscales nor weights it.
                grads = [
                    g if g is None or overwrites_with_gradient(v) else g * tf.cast(factor, g.dtype)
                    for g, v in zip(grads, variables)
                ]
            dropped = self._update(grads, batch_loss, count, state)

        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        logs = guard.settle(self, state, dropped, logs)
        if rt.scaler is not None:
            logs = dict(logs)
            logs["loss_scale"] = rt.scaler.scale.read_value()
            logs["skipped_steps"] = rt.facts.skipped_steps.read_value()
        return logs

    @contextlib.contextmanager
    def _window_draws(self, x, n):
        """Around a micro-batch's forward and backward pass (of `n`
        samples): its Dropout masks are its rows of the window's
        (`window_dropout`), on one replica; the accumulator counts its rows
        when it adds the micro-batch."""
        rt = self._gradboost
        draws = rt.window_draws if rt.config.accumulate_steps > 1 else None
        if draws is None or tf.distribute.get_strategy().num_replicas_in_sync > 1:
            yield
            return
        acc = self._accumulator()
        samples = tf.cast(n, tf.int64)
        first = next(t for t in tf.nest.flatten(x) if t is not None)  # as `sample_count`
        static = first.shape[0] if first.shape.rank else None
        window_start = tf.equal(acc.micro_step.read_value(), 0)
        acc.next_rows = samples
        try:
            with draws.drawing(window_start, acc.rows.read_value(), samples, static):
                yield
        finally:
            acc.next_rows = None

    def _window_count(self, y_pred, n):
        """The micro-batch's weight in its accumulation window: `n` samples,
        or the valid entries of a masked prediction (see
        `accumulate.loss_normaliser`); warns when neither is exact."""
        rt = self._gradboost
        if rt.config.accumulate_steps == 1:
            return n
        count, exact = loss_normaliser(y_pred, n)
        if count is n:
            if not exact:
                self._warn_inexact_mask(
                    "the loss sums several outputs and one of them is masked; "
                    "Keras divides each output's loss by its own valid entries, "
                    "which one weight per micro-batch cannot undo"
                )
            return n
        unknown = _losses_that_may_ignore_the_mask(self)
        if unknown:
            # Only Keras' own Loss.__call__ divides by the valid entries.
            self._warn_inexact_mask(
                f"the prediction is masked, but {unknown} may not divide the "
                "loss by the mask's valid entries as Keras' losses do; the "
                "micro-batches are weighted by their samples"
            )
            return n
        return count

    def _warn_sparse_repeats(self, grads, variables, optimizer):
        """Warns (once) when an accumulation window cannot give Keras'
        large-batch update: a sparse gradient (an Embedding's) and an
        optimizer whose update depends on how its rows repeat
        (`accumulate.repeats_change_update`)."""
        rt = self._gradboost
        sparse = [v.path for v, g in zip(variables, grads) if isinstance(g, tf.IndexedSlices)]
        reason = repeats_change_update(optimizer) if sparse else None
        if reason is None or rt.warned_sparse_repeats:
            return
        rt.warned_sparse_repeats = True
        names = listed(sparse, 3)
        warnings.warn(
            f"accumulate_steps={rt.config.accumulate_steps}: the gradient of "
            f"{names} is sparse (a slice per token, a row repeated where its "
            f"token repeats) and {reason}. An accumulation window keeps each "
            "row's sum, not its repeats, so the update differs from one "
            "large-batch step (it is the update of the summed gradient, as "
            "for a dense one). With SGD (momentum and weight decay allowed, "
            "no clipping) the two are equal; accumulate_check compares "
            "gradients, which are equal, not updates.",
            stacklevel=3,
        )

    def _warn_unexact_draws(self):
        """Warns when, this epoch, Dropout draws turned out (at run time) to
        be on a tensor whose first axis is not the micro-batch's samples:
        they drew masks of their own (`window_dropout`)."""
        rt = self._gradboost
        if rt.window_draws is None or rt.config.accumulate_steps == 1:
            return
        count = rt.window_draws.unexact_draws(self.distribute_strategy)
        if count:
            warnings.warn(
                f"accumulate_steps={rt.config.accumulate_steps}: {count} Dropout "
                "draws this epoch were on a tensor whose first axis is not the "
                "micro-batch's samples (known at run time only: the batch has no "
                "fixed size), so each drew a mask of its own for its micro-batch, "
                "not its rows of the large batch's: the weights differ from one "
                f"large-batch step with the same seed by that randomness. Dropout "
                f"layers: {listed(rt.window_draws.layer_names, 4)}.",
                stacklevel=2,
            )

    def _warn_own_step_draws(self, accumulator):
        """Warns (once) when a train_step of the model's own accumulates
        through `minimize()` (with any optimizer): its forward pass ran
        outside GradBoostModel's step, so its Dropout layers drew masks of
        their own in each micro-batch, not their rows of the large batch's
        (`window_dropout`)."""
        rt = self._gradboost
        draws = rt.window_draws
        if (
            accumulator is None or draws is None
            or window_dropout.drawing_now() or rt.warned_own_step_draws
        ):
            return
        rt.warned_own_step_draws = True
        warnings.warn(
            f"accumulate_steps={rt.config.accumulate_steps}: this model's own "
            f"train_step runs the forward pass, so its Dropout layers "
            f"({listed(draws.layer_names, 4)}) draw masks of their own in each micro-batch "
            "(every sample gets a draw of its own, as in a large batch, but not "
            "the one a large-batch step would draw). GradBoostModel's train_step "
            "(super().train_step(data)) draws each micro-batch's rows of the "
            "large batch's masks.",
            stacklevel=3,
        )

    def _watching_layer_losses(self):
        """When accumulating, a context yielding the `(layer, loss)` the
        layers add in it (`_warn_layer_losses`); else one yielding none."""
        if self._gradboost.config.accumulate_steps > 1:
            return hooks.collecting_losses(keep=True)
        return contextlib.nullcontext([])

    def _warn_layer_losses(self, added, by_samples=True):
        """Warns (once) when layers add losses of their own (`add_loss`;
        `added`: `(layer, loss)` of the forward) that a window's weighted
        average of micro-batches may not give as the large batch does (a
        mean over samples does, when the micro-batches are weighted by
        their samples, `by_samples`, not by a mask's valid entries)."""
        rt = self._gradboost
        own = {
            id(layer): layer.name
            for layer, _ in added
            if not (by_samples and mean_activity_loss(layer))
        }
        if not own or rt.warned_layer_losses:
            return
        rt.warned_layer_losses = True
        shown = listed(list(own.values()), 3)
        sums = "" if activity_losses_are_means() else (
            "; nor is an activity regularizer's here: this Keras adds its sum over "
            "the batch, which the average divides by the micro-batches"
        )
        warnings.warn(
            f"accumulate_steps={rt.config.accumulate_steps}: {shown} add losses "
            "of their own (`add_loss`). A window averages each micro-batch's "
            f"loss, weighted by its {'samples' if by_samples else 'valid mask entries'}, "
            "which equals one large-batch step only for a mean over samples of "
            "per-sample terms weighted by samples (a mixture of experts' "
            "load-balancing loss over the batch's tokens is not one"
            f"{sums}). accumulate_check=True compares the two on this model.",
            stacklevel=3,
        )

    def _warn_inexact_mask(self, reason):
        rt = self._gradboost
        if not rt.warned_inexact_mask:
            rt.warned_inexact_mask = True
            warnings.warn(
                f"accumulate_steps={rt.config.accumulate_steps}: {reason}, so "
                "the update may differ from one large-batch step (check it "
                "with accumulate_check=True).",
                stacklevel=3,
            )

    def _loss_to_differentiate(self, loss, weight):
        """The loss scaled as the backward pass needs it: the optimizer's own
        scaling, then the loss scale, or else the accumulation weight (unless
        the gradients take it: `_weights_gradients`)."""
        rt = self._gradboost
        if self.optimizer is not None:
            loss = self.optimizer.scale_loss(loss)
        if rt.scaler is not None:
            return loss * tf.cast(rt.scaler.scale, loss.dtype)
        if rt.config.accumulate_steps > 1 and not self._weights_gradients():
            return loss * tf.cast(weight, loss.dtype)
        return loss

    def _weights_gradients(self):
        """Whether the gradients, not the scalar loss, take the accumulation
        weight: with a loss scale (the gradients are divided by it anyway),
        and when a variable takes its "gradient" as its new value
        (`overwrite_with_gradient`: a float8 layer's output-gradient amax
        must see the unweighted loss, as Keras' accumulation gives it)."""
        rt = self._gradboost
        return rt.scaler is not None or (
            rt.config.accumulate_steps > 1
            and any(overwrites_with_gradient(v) for v in self.trainable_weights)
        )

    def _checks_steps(self, watches=True):
        """Whether the update checks each step's finiteness (a loss scale,
        `step_facts.checks_gradients`, or a NaNWatcher's watch; without
        `watches`, as before the first watch attached); False before
        compile()."""
        rt = self._gradboost
        if rt.scaler is not None:
            return True
        if rt.facts is None:
            return False
        if rt.watches and not watches:
            return bool(rt.checks_before_watch)
        return bool(rt.facts.checks_gradients)

    def _update(self, grads, batch_loss, n, state=None):
        """Checks, records and applies (or accumulates) one micro-batch's
        gradients; exactly Keras' own update when nothing is checked or
        accumulated. `state`: the `guard.StepState` a dropped step puts
        back. Returns whether the update was dropped (see
        `CrossReplicaStep.__call__`)."""
        rt = self._gradboost
        rt.in_update += 1
        try:
            return self._checked_update(grads, batch_loss, n, state)
        finally:
            rt.in_update -= 1

    def _checked_update(self, grads, batch_loss, n, state):
        rt = self._gradboost
        rt.updates_traced += 1
        accumulating = rt.config.accumulate_steps > 1
        check = self._checks_steps()
        rt.facts.checks_gradients = check
        rt.grad_mask = [g is not None for g in grads]
        if accumulating:
            self._accumulator().grad_mask = rt.grad_mask
            rt.main_window_used = True
        if not check:
            rt.facts.last_step_finite.assign(tf.math.is_finite(batch_loss))
        if not (check or accumulating):
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            return None
        bad = loss_bad = None
        if check:
            loss_bad = guard.nonfinite_indicator(batch_loss, [])
            bad = tf.maximum(loss_bad, guard.nonfinite_indicator(None, grads))
        present = [g for g in grads if g is not None]
        return self._cross_replica_step()(
            present, n=n, bad=bad, loss_bad=loss_bad, state=state
        )

    def _cross_replica_step(self):
        """The `step.CrossReplicaStep` of this model's update: its facts,
        loss scale, watch (if a NaNWatcher attached one) and accumulator."""
        rt = self._gradboost
        variables = self.trainable_weights
        return CrossReplicaStep(
            lambda grads: self.optimizer.apply_gradients(zip(grads, variables)),
            rt.grad_mask or (),
            facts=rt.facts,
            scaler=rt.scaler,
            watch=rt.facts.watch,
            accumulator=rt.accumulator if rt.config.accumulate_steps > 1 else None,
            closes_step=not _tracing_own_step(rt),
            optimizer=self.optimizer,
        )

    def minimize(self, tape, loss, variables=None, optimizer=None, count=None):
        """GradBoostModel's update, for a `train_step` of your own.

        Takes the tape that recorded `loss`, and does what the built-in step
        does after the forward pass: the loss scale (through the tape's
        output gradient: no scaled loss needed inside the tape), the
        gradients, the finiteness check (a non-finite step is dropped and
        recorded in `step_facts`), and the update, or its accumulation into
        a window of `accumulate_steps` micro-batches. Each optimizer has its
        own window and loss scale, so a GAN's two updates are each exact.

        Args:
            tape: the `tf.GradientTape` that recorded `loss`.
            loss: the scalar loss, as `compute_loss` returns it (divided by
                the number of replicas under a distribution strategy).
            variables: the variables to update. Defaults to
                `trainable_weights`.
            optimizer: the optimizer that updates them. Defaults to
                `self.optimizer`.
            count: this micro-batch's weight in its window: what the loss
                was divided by (its samples, or a mask's valid entries).
                Needed with `accumulate_steps > 1`. Defaults to `None`.

        Raises:
            RuntimeError: before `compile()`.
            ValueError: for an optimizer other than `self.optimizer` under a
                distribution strategy with accumulation or loss scaling (its
                state cannot be made inside the replicas' step).

        Example:

        ```python
        import keras
        import numpy as np
        import tensorflow as tf
        import keras_gradboost as kgb

        class TwoOptimizers(kgb.GradBoostModel):
            def __init__(self):
                super().__init__()
                self.a = keras.layers.Dense(1)
                self.b = keras.layers.Dense(1)
                self.b_optimizer = keras.optimizers.SGD(0.1)

            def call(self, x):
                return self.a(x) + self.b(x)

            def train_step(self, data):
                x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
                with tf.GradientTape() as tape:
                    loss = keras.ops.mean((self.a(x) - y) ** 2)
                count = tf.shape(x)[0]  # what the mean divides by
                self.minimize(tape, loss, self.a.trainable_weights, count=count)
                with tf.GradientTape() as tape:
                    loss = keras.ops.mean((self.b(x) - y) ** 2)
                self.minimize(tape, loss, self.b.trainable_weights,
                              self.b_optimizer, count=count)
                return {"loss": loss}

        model = TwoOptimizers()
        model(np.zeros((1, 3), "float32"))
        model.compile(optimizer=keras.optimizers.SGD(0.1), accumulate_steps=2)
        model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"),
                  batch_size=2, verbose=0)
        ```
        """
        rt = self._gradboost
        if rt.facts is None:
            raise RuntimeError("Call `compile()` before training the model.")
        optimizer = self.optimizer if optimizer is None else optimizer
        variables = list(self.trainable_weights if variables is None else variables)
        accumulator, scaler = self._optimizer_state(optimizer, variables)
        rt.updates_traced += 1
        rt.in_update += 1
        try:
            self._minimize(tape, loss, variables, optimizer, count, accumulator, scaler)
        finally:
            rt.in_update -= 1

    def _minimize(self, tape, loss, variables, optimizer, count, accumulator, scaler):
        rt = self._gradboost
        if accumulator is not None and count is None:
            raise ValueError(
                "minimize() with accumulate_steps="
                f"{rt.config.accumulate_steps} needs `count`: what the loss was "
                "divided by for this micro-batch (its samples, e.g. "
                "`tf.shape(x)[0]`, or a mask's valid entries), so that a "
                "smaller last batch weighs what it weighs in the large batch."
            )
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        count = tf.constant(1.0) if count is None else tf.cast(count, tf.float32)
        weight = count * replicas if accumulator is not None else tf.constant(1.0)
        seed = weight if scaler is None else scaler.scale
        grads = tape.gradient(loss, variables, output_gradients=tf.cast(seed, loss.dtype))
        if accumulator is not None:
            self._warn_sparse_repeats(grads, variables, optimizer)
            self._warn_own_step_draws(accumulator)
        if scaler is not None:
            factor = weight / scaler.scale
            grads = [None if g is None else g * tf.cast(factor, g.dtype) for g in grads]
        check = scaler is not None or rt.facts.checks_gradients
        if not (check or accumulator is not None):
            optimizer.apply_gradients(zip(grads, variables))
            return
        mask = [g is not None for g in grads]
        if accumulator is not None:
            accumulator.grad_mask = mask
        bad = loss_bad = None
        if check:
            loss_bad = guard.nonfinite_indicator(loss, [])
            bad = tf.maximum(loss_bad, guard.nonfinite_indicator(None, grads))
        step = CrossReplicaStep(
            lambda g: optimizer.apply_gradients(zip(g, variables)), mask,
            facts=rt.facts, scaler=scaler, watch=rt.facts.watch, accumulator=accumulator,
            closes_step=not _tracing_own_step(rt), optimizer=optimizer,
        )
        # A dropped update puts back the state from the step's start (the
        # moving statistics its forward passes wrote).
        state = rt.own_step_state.peek() if check else None
        dropped = step([g for g in grads if g is not None], n=count, bad=bad,
                       loss_bad=loss_bad, state=state)
        rt.own_step_state.dropped(dropped)  # its metrics go back at the step's end

    def _optimizer_state(self, optimizer, variables):
        """`(accumulator or None, loss scaler or None)` for `minimize()`:
        the model's own for its optimizer and trainable weights; made once
        per (optimizer, variables) otherwise."""
        rt = self._gradboost
        accumulating = rt.config.accumulate_steps > 1
        own = optimizer is self.optimizer and [id(v) for v in variables] == [
            id(v) for v in self.trainable_weights
        ]
        if own:
            rt.main_window_used = rt.main_window_used or accumulating
            return (self._accumulator() if accumulating else None), rt.scaler
        key = (id(optimizer), tuple(id(v) for v in variables))
        if key not in rt.other_states:
            if not (accumulating or rt.plan.loss_scale):
                rt.other_states[key] = (None, None)
            elif tf.distribute.has_strategy():
                raise ValueError(
                    "minimize() with an optimizer other than the model's own "
                    f"({type(optimizer).__name__}) needs its own accumulation "
                    "window and loss scale, which cannot be made inside the "
                    "replicas' step of a distribution strategy. Use one "
                    "device, or accumulate_steps=1 and loss_scale=None."
                )
            else:
                with tf.init_scope():
                    accumulator = None
                    if accumulating:
                        accumulator = GradientAccumulator(variables, rt.config.accumulate_steps)
                    scaler = None
                    if rt.plan.loss_scale is not None:
                        scaler = precision_lib.LossScaler(*rt.plan.loss_scale)
                rt.other_states[key] = (accumulator, scaler)
                rt.other_steps.append(
                    lambda: CrossReplicaStep(
                        lambda g: optimizer.apply_gradients(zip(g, variables)),
                        accumulator.grad_mask if accumulator else (),
                        facts=rt.facts, scaler=scaler, accumulator=accumulator,
                        optimizer=optimizer,
                    )
                )
        return rt.other_states[key]

    def _prepare_forward(self, x):
        """Settles what the recompute forward needs from the first batch
        (the budget's choice, the input spec); outside any tape."""
        setup = self._gradboost.recompute
        if setup is not None:
            with self._chosen_kernels():
                setup.prepare(self, x)

    def _training_forward(self, x):
        """The forward pass of the training step (through the recompute
        blocks, if any). Call `_prepare_forward(x)` first."""
        setup = self._gradboost.recompute
        if setup is not None:
            with self._chosen_kernels():
                return setup.forward(self, x)
        if hooks.call_has_training_arg(self):
            return self(x, training=True)
        return self(x)

    def flush_accumulated_gradients(self):
        """Applies micro-batches accumulated since the last update, if any.

        `fit` calls it at the end of every epoch (before validation), so a
        remainder is never dropped nor carried into the next epoch. Call it
        yourself after a loop of `train_on_batch`.
        """
        rt = self._gradboost
        others = [make() for make in rt.other_steps]
        steps = [step for step in others if step.accumulator is not None]
        if rt.accumulator is not None and (rt.main_window_used or rt.loaded_window):
            steps.insert(0, self._cross_replica_step())
        if not steps:
            return
        strategy = self.distribute_strategy
        # A window closed on the epoch's last batch leaves nothing to flush,
        # nor a flush function to trace (the optimizer's update once more:
        # seconds on a large model). Every worker counts the same
        # micro-batches, so all of them decide alike. (Inside a user's
        # tf.function the traced flush decides.)
        if tf.executing_eagerly() and not any(s.accumulator.pending(strategy) for s in steps):
            return
        if rt.flush_function is None or rt.flush_steps != len(steps):
            rt.flush_steps = len(steps)

            def flush():
                with strategy.scope():
                    for step in steps:
                        flush_window(strategy, step)

            rt.flush_function = tf.function(flush, autograph=False)
        rt.flush_function()

    # --------------------------------------------------------------- fit hooks

    def _build_optimizer(self):
        """Makes the optimizer's variables (Adam's moments) before the first
        trace, as Keras does only under a distribution strategy. Made inside
        the traced train function, each is lifted out of the graph one at a
        time: a boosted ResNet50's first `fit` with Adam (64x64, 2 steps) took
        32.6 s, and 16.7 s with them made first (AMD EPYC, 2 cores). A model whose layers are
        not all built yet (a subclassed model before its first call) is left
        to Keras, which builds the optimizer in the trace."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or optimizer.built:
            return
        if not all(layer.built for layer in hooks.flatten_layers(self)):
            return
        with self.distribute_strategy.scope():
            optimizer.build(self.trainable_variables)

    def fit(self, *args, **kwargs):
        setup = self._gradboost.recompute
        if setup is not None:  # the allocator peak, read once after the fit
            setup.start_measuring(self)
        try:
            history = self._fit(*args, **kwargs)
            if setup is not None:
                setup.stop_measuring(self)
            return history
        except tf.errors.InvalidArgumentError as error:
            found = jit_measure.unsupported_op(error, self) if self.jit_compile else None
            if found is None:
                raise
            self._gradboost.xla_blocked = found
            raise jit_measure.unsupported_op_error(found) from error

    def _fit(self, *args, **kwargs):
        rt = self._gradboost
        self._build_optimizer()
        replicas = self.distribute_strategy.num_replicas_in_sync
        if rt.recompute is not None:  # the batch size to choose at
            # (It may read a generator's first batch and replace `x` by one
            # that yields it again.)
            kwargs, args = _bind_fit_args(args, kwargs), ()
            rt.recompute.before_fit(kwargs, replicas=replicas)
            rt.recompute.note_fit(self, kwargs.get("callbacks"))
        plan = self.train_plan  # None before compile (Keras says so)
        if plan is not None and plan.depthwise_setting == "chunked" and plan.depthwise_layers:
            kwargs, args = _bind_fit_args(args, kwargs), ()
            depthwise_lib.set_check_batches(
                plan.depthwise_layers, _fit_batch_sizes(kwargs, replicas)
            )
        if rt.config.accumulate_steps == 1 and rt.scaler is None and replicas == 1:
            return super().fit(*args, **kwargs)  # (nothing to do at an epoch's end)
        bound = _bind_fit_args(args, kwargs)
        callbacks = bound.get("callbacks")
        epoch_end = _EpochEnd(self)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.callbacks.insert(0, epoch_end)
            epoch_end.set_model(self)
        else:
            bound["callbacks"] = [epoch_end] + list(callbacks or [])
        rt.in_fit = True
        try:
            return super().fit(**bound)
        finally:
            rt.in_fit = False
            if isinstance(callbacks, keras.callbacks.CallbackList):
                callbacks.callbacks.remove(epoch_end)

    def evaluate(self, *args, **kwargs):
        # fit() validates after the epoch's last batch and before on_epoch_end:
        # apply the epoch's remainder first, so validation sees it. (An
        # evaluate() from a callback mid-epoch must not split a window.)
        if self._gradboost.in_fit and hooks.is_fit_validation(kwargs):
            self.flush_accumulated_gradients()
        return super().evaluate(*args, **kwargs)

    def _epoch_end(self):
        rt = self._gradboost
        self.flush_accumulated_gradients()
        # A measured unit with its calls ends here, its window flushed (an
        # epoch shorter than a window closes none in its calls).
        measuring = wrappers.base_train_function(self)
        if isinstance(measuring, measure_schedule.EndsUnits):
            measuring.end_unit_if_due()
        self._check_even_split()
        self._warn_unexact_draws()
        if rt.scaler is None:
            return
        skipped = int(rt.facts.skipped_steps.numpy())
        steps = int(rt.facts.checked_steps.numpy())
        prev_skipped, prev_steps = rt.last_health
        rt.last_health = (skipped, steps)
        message = precision_lib.health_warning(
            float(rt.scaler.scale.numpy()),
            skipped - prev_skipped,
            steps - prev_steps,
            dynamic=rt.scaler.dynamic,
        )
        if message:
            warnings.warn(message, stacklevel=2)


    def _check_even_split(self):
        """Warns when, without accumulation, a global batch of the epoch
        split unevenly between the replicas: its update is Keras' mean of
        the replicas' mean gradients, not the step on the whole batch.

        Every replica counts the samples it trained on; TensorFlow gives a
        short global batch's extra rows to the first replicas, so the counts
        differ from the first uneven split on. One max and one min over the
        replicas per epoch (a collective under several workers, run by
        every worker at its epoch's end, the same point); once warned, not
        checked again."""
        rt = self._gradboost
        strategy = self.distribute_strategy
        if (
            strategy.num_replicas_in_sync == 1
            or rt.config.accumulate_steps != 1
            or rt.warned_uneven
        ):
            return
        if rt.split_check is None:
            rows = rt.facts.rows_seen
            add = tf.distribute.ReduceOp.SUM  # (a strategy reduces by SUM or MEAN only)

            def first_replicas():
                first = tf.distribute.get_replica_context().replica_id_in_sync_group == 0
                return tf.where(first, rows.read_value(), tf.zeros_like(rows))

            def fewer(first):
                return tf.cast(rows.read_value() != first, tf.int64)

            def replicas_with_fewer():
                first = strategy.reduce(add, strategy.run(first_replicas), axis=None)
                return strategy.reduce(add, strategy.run(fewer, args=(first,)), axis=None)

            rt.split_check = tf.function(replicas_with_fewer, autograph=False)
        others = rt.split_check()
        if int(others) == 0:
            return
        rt.warned_uneven = True  # once per compile()
        warnings.warn(
            "A global batch of this epoch split unevenly between the "
            f"{strategy.num_replicas_in_sync} replicas ({int(others)} of them "
            "have trained on fewer samples than the first): with accumulate_steps=1 its "
            "update is Keras' mean of the replicas' mean gradients, not the step "
            "on the whole batch (the README measures 0.045 of an update off for "
            "5 + 4 rows). Make the dataset size a multiple of the global batch "
            "size, batch with drop_remainder=True, or compile with "
            "accumulate_steps >= 2 (weighted by samples: exact).",
            stacklevel=2,
        )


@keras.saving.register_keras_serializable(package="keras_gradboost")
class FunctionalGradBoostModel(GradBoostModel, hooks.functional_model_class()):
    """What `GradBoostModel(inputs, outputs)` returns: a functional model with
    GradBoostModel's training step. Not meant to be instantiated by name."""


_FUNCTIONAL_TWINS = {}


def _functional_twin(cls):
    """`cls` with Keras' Functional mixed in (made once per class)."""
    if cls is GradBoostModel:
        return FunctionalGradBoostModel
    if cls not in _FUNCTIONAL_TWINS:
        _FUNCTIONAL_TWINS[cls] = type(
            cls.__name__,
            (cls, hooks.functional_model_class()),
            {"__module__": cls.__module__, "__doc__": cls.__doc__},
        )
    return _FUNCTIONAL_TWINS[cls]


class _EpochEnd(keras.callbacks.Callback):
    """Flushes accumulated gradients and checks loss-scale health at the end of
    each epoch; `fit` puts it first so ModelCheckpoint & co. see the update.

    Micro-batches pending when a `fit` starts (left by an interrupted `fit`,
    a loop of `train_on_batch`, or loaded mid-window) stay in the window and
    count towards its first update, as if training had never stopped."""

    def __init__(self, model):
        super().__init__()
        self._target = model

    def on_epoch_end(self, epoch, logs=None):
        self._target._epoch_end()


class _BoostedModel(GradBoostModel):
    """`boost()` of a model that is not a graph of layers: calls it."""

    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        self.model = model

    def call(self, inputs, training=None, **kwargs):
        return self.model(inputs, training=training, **kwargs)

    def get_config(self):
        return {
            "model": keras.saving.serialize_keras_object(self.model),
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"))
        return cls(model, **config)


_BoostedModel = keras.saving.register_keras_serializable(
    package="keras_gradboost", name="BoostedModel"
)(_BoostedModel)


def boost(model):
    """Turns a built Keras model into a `GradBoostModel` sharing its weights.

    A functional or Sequential model becomes a `GradBoostModel` over the same
    layer graph (same layers, same weights, same `model.layers`). Any other
    model (subclassed, a functional or Sequential class that overrides
    `call`, which may run something else than its graph, or a Sequential
    without a known input) is wrapped: the new model calls it, and so shares
    its layers and weights.

    A model whose class has its own `train_step`, `test_step`,
    `predict_step` or `compute_loss` (Keras' "customizing fit()" pattern:
    GANs, VAEs, distillation) keeps them: it is boosted in place (the same
    object is returned, its class now also a `GradBoostModel`, next after
    its own class, so `super().train_step(data)` reaches GradBoostModel's).
    Precision, recompute and jit act on its layers as on any model: the
    recompute blocks recompute where its `train_step` calls them (a plan of
    graph segments needs `super().train_step(data)`, and is refused
    without it).
    `accumulate_steps` and loss scaling live in GradBoostModel's update: a
    `train_step` that calls `super().train_step(data)` gets them; one that
    applies its gradients itself is refused with a `ValueError` naming it
    when its first step is traced, before any update. `NaNWatcher` guards
    its optimizer, as on a plain Keras model.

    Args:
        model: a `keras.Model`. A `GradBoostModel` is returned as it is.

    Returns:
        A `GradBoostModel`, not yet compiled (the model itself, boosted in
        place, when its class has its own steps).

    Raises:
        TypeError: if `model` is not a `keras.Model`.

    Example:

    ```python
    import keras
    import keras_gradboost

    # Any built model: e.g. keras.applications.MobileNetV3Small(weights=None).
    base = keras.Sequential([
        keras.Input((20,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model = keras_gradboost.boost(base)
    model.compile(optimizer="adam", loss="categorical_crossentropy",
                  accumulate_steps=4)
    ```
    """
    if isinstance(model, GradBoostModel):
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Invalid value for argument `model`. Received: "
            f"model={model!r} of type {type(model).__name__}. Expected a "
            "keras.Model (functional, Sequential or subclassed)."
        )
    if own_steps(model):
        return _boost_in_place(model)
    # Only where its `call` runs its graph: a class that overrides `call`
    # may run something else, which the wrapper keeps.
    if hooks.layer_graph(model) is not None:
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            inputs = None
        if inputs:
            return GradBoostModel(inputs, outputs, name=model.name)
    return _BoostedModel(model, name=model.name)


# ------------------------------------------------------------------- helpers

# The wrapper that checks a class's own train_step (see `_own_step`).
_OWN_STEP = "_keras_gradboost_own_step"

STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss")


def _tracing_own_step(rt):
    return getattr(rt.own_step_trace, "active", False)


def own_steps(model):
    """The step methods (`STEP_METHODS`) that `model`'s class defines itself,
    instead of taking Keras' (or GradBoostModel's) own."""
    cls = type(model)
    defaults = GradBoostModel if isinstance(model, GradBoostModel) else keras.Model
    names = []
    for name in STEP_METHODS:
        found = getattr(cls, name, None)
        if found is not getattr(defaults, name) and found is not getattr(keras.Model, name):
            names.append(name)
    return tuple(names)


def _other_optimizers(model):
    """The optimizers other than `model.optimizer` held in `model`'s
    attributes (directly, or in a list, tuple or dict there): a GAN's
    `self.d_optimizer`. One held elsewhere (a closure) is not seen."""
    found = []
    for value in vars(model).values():
        if isinstance(value, dict):
            items = list(value.values())
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            items = [value]
        for item in items:
            if (
                isinstance(item, keras.optimizers.Optimizer)
                and item is not model.optimizer
                and all(item is not f for f in found)
            ):
                found.append(item)
    return found


def _refusing_apply(model, optimizer, needs):
    """A wrapper of `optimizer.apply` that refuses a call from outside
    GradBoostModel's update (`_update`, `minimize()`), before it applies."""

    def apply(below, *args, **kwargs):
        if model._gradboost.in_update == 0:
            which = (
                "the model's optimizer"
                if optimizer is model.optimizer
                else f"another optimizer ({type(optimizer).__name__})"
            )
            raise ValueError(
                f"{type(model).__name__}.train_step applies {which} itself, "
                f"outside GradBoostModel's update, so {' and '.join(needs)} "
                "would be silently ignored for its variables. Let each update "
                "go through GradBoostModel: `super().train_step(data)`, or "
                "`self.minimize(tape, loss, variables, optimizer, count=...)`; "
                "or compile without these options (accumulate_steps=1, "
                "loss_scale=None)."
            )
        return below(*args, **kwargs)

    return apply


_BOOSTED_CLASSES = {}


def _losses_that_may_ignore_the_mask(model):
    """What in `model`'s loss does not go through Keras' own
    `Loss.__call__` with a reduction that divides by the valid entries (its
    own `compute_loss`, a Loss with its own `__call__` or another
    reduction), named; "" when every loss does."""
    if "compute_loss" in own_steps(model):
        return f"{type(model).__name__}.compute_loss"
    for loss in tf.nest.flatten(model.loss) if model.loss is not None else []:
        if isinstance(loss, keras.losses.Loss) and not reduces_like_keras(loss):
            return f"the loss {loss.name!r} ({type(loss).__name__})"
    return ""


def _boost_in_place(model):
    """Makes `model` (whose class has its own steps) a GradBoostModel in
    place: its class becomes `type(model)` with GradBoostModel next in the
    method order, so the model's own steps win, and their `super()` calls
    reach GradBoostModel before keras.Model."""
    cls = type(model)
    if cls not in _BOOSTED_CLASSES:
        boosted = type(
            cls.__name__,
            (cls, GradBoostModel),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
             "__doc__": cls.__doc__},
        )
        registered = keras.saving.get_registered_name(cls)
        if registered != cls.__name__:
            # Saved under the class's own registered name, and loaded as the
            # boosted class (with its gradboost compile options): a saved
            # model of this class comes back as it was saved.
            package, _, name = registered.rpartition(">")
            keras.saving.register_keras_serializable(package, name)(boosted)
        _BOOSTED_CLASSES[cls] = boosted
    model.__class__ = _BOOSTED_CLASSES[cls]
    model._gradboost = _Runtime()
    return model

_COMPILE_SIGNATURE = inspect.signature(keras.Model.compile)
_FIT_SIGNATURE = inspect.signature(keras.Model.fit)


def _bind_compile_args(args, kwargs):
    """Keras compile's positional and keyword arguments as one dict."""
    try:
        bound = _COMPILE_SIGNATURE.bind(None, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"GradBoostModel.compile(): {e}") from None
    arguments = dict(bound.arguments)
    arguments.pop("self")
    return arguments


def _fit_batch_sizes(fit_args, replicas):
    """The batch sizes `fit` will trace no fixed size for, each replica's
    shares (a replica may get one sample fewer): the first batch's and,
    for arrays, the last partial one's (after `validation_split`). Other
    sizes, such as a dataset's last partial batch, run Keras' way."""
    batch = recompute_lib.batch_size_hint(fit_args)
    sizes = [batch]
    x = fit_args.get("x")
    arrays = [a for a in tf.nest.flatten(x) if hasattr(a, "shape")]
    if batch and arrays and not isinstance(x, tf.data.Dataset):
        samples = int(arrays[0].shape[0])
        split = fit_args.get("validation_split") or 0.0
        if split:
            samples = int(samples * (1.0 - split))  # as Keras splits
        sizes.append(samples % batch)
    shares = set()
    for size in (size for size in sizes if size):
        shares.update({-(-size // replicas), size // replicas})
    return sorted(share for share in shares if share)


def _bind_fit_args(args, kwargs):
    bound = _FIT_SIGNATURE.bind(None, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self")
    return arguments


def _check_batch_size(batch_size):
    if batch_size is None:
        return
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
        raise TypeError(
            "Invalid type for argument `batch_size`. Received: "
            f"batch_size={batch_size!r} of type {type(batch_size).__name__}. "
            "Expected an int >= 1 or None (the training batch size)."
        )
    if batch_size < 1:
        raise ValueError(
            "Invalid value for argument `batch_size`. Received: "
            f"batch_size={batch_size!r}. Expected an int >= 1 or None (the "
            "training batch size)."
        )
