"""GradBoostModel and boost(): compile kwargs -> plan -> train_step."""

import inspect
import warnings

import keras
import tensorflow as tf

from keras_gradboost import blocks
from keras_gradboost import guard
from keras_gradboost import hooks
from keras_gradboost import jit_measure
from keras_gradboost import precision as precision_lib
from keras_gradboost import recompute_check
from keras_gradboost.accumulate import GradientAccumulator
from keras_gradboost.accumulate import sample_count
from keras_gradboost.locate import as_local_batch
from keras_gradboost.config import GradBoostConfig
from keras_gradboost.config import jit_compile_setting
from keras_gradboost.state import StepFacts


class _Runtime:
    """Per-model gradboost state. A plain object, so Keras and tf.Module do not
    track its variables as model weights or save them in checkpoints."""

    def __init__(self):
        self.config = GradBoostConfig()
        self.policy = None
        self.float32_layers = []
        self.scaler = None
        self.facts = None
        self.accumulator = None
        # Which trainable variables get a gradient (set at trace time).
        self.grad_mask = None
        self.flush_function = None
        self.in_fit = False
        self.auto_scale_loss = False
        # (skipped_steps, checked_steps) at the last epoch end.
        self.last_health = (0, 0)
        self.recompute = None  # blocks.RecomputeSetup
        self.recompute_check_pending = False
        self.check_wrapper = None  # the train function that runs the check
        self.jit_requested = "auto"  # compile(jit_compile=...) as given
        self.jit_measurement = None  # jit_measure.JitMeasurement
        # Why XLA is off although jit_compile=True or "measure" asked for it.
        self.xla_blocked = None


@keras.saving.register_keras_serializable(package="keras_gradboost")
class GradBoostModel(keras.Model):
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

    # ------------------------------------------------------------------ compile

    def compile(
        self,
        *args,
        accumulate_steps=1,
        precision=None,
        loss_scale="auto",
        recompute=None,
        recompute_check=False,
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
                then `jit_measure.TIMED_CALLS` timed calls of each), and the
                variant with the lower median is kept from then on (see
                `jit_measurement`; a one-line report is printed). A step XLA
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
                `"auto"` or `None`. Sets the dtype policy of every layer of the
                (possibly already built) model; variables stay float32 and,
                with a mixed policy, the output layers compute in float32.
                `"auto"` picks mixed_float16 on a GPU and, on a CPU,
                mixed_bfloat16 when the CPU has bfloat16 instructions and XLA
                is off, else float32.
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
                nested layers included; `"auto"`: every block (a layer that
                holds layers; a stack of them is split into its members), or,
                for a functional model without such layers, about sqrt(n)
                segments of its layer graph cut where one tensor carries
                everything; `{"budget_mb": N}`: the fewest of the "auto"
                candidates (best saving per extra compute first) whose
                estimated activation memory fits N MiB at the training batch
                size (add `"batch_size": B` when batches have no fixed size).
                See `recompute_plan()`. Defaults to `None`.
            recompute_check: if True, the first training batch is run once
                without recompute and once with each block recomputed, and a
                `RecomputeCheckError` names a block that changes a gradient.
                Defaults to `False`.

        Raises:
            TypeError: if a gradboost argument or `jit_compile` has the wrong
                type.
            ValueError: if a gradboost argument or `jit_compile` has a bad
                value, or conflicts
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
        )
        keras_kwargs = _bind_compile_args(args, kwargs)
        jit_requested = jit_compile_setting(keras_kwargs.get("jit_compile", "auto"))
        xla_blocked = None
        if jit_requested is True or jit_requested == "measure":
            blockers = hooks.jit_blockers(self)
            if keras_kwargs.get("run_eagerly"):
                blockers = ["run_eagerly=True"]
            if blockers:
                xla_blocked = "; ".join(blockers)
                warnings.warn(
                    f"jit_compile={jit_requested!r}, but XLA is off: "
                    f"{xla_blocked}. The model trains without XLA.",
                    stacklevel=2,
                )
            # Keras gets False for "measure" (both variants are made in
            # make_train_function) and when XLA is blocked (its own warning
            # names no cause).
            if blockers or jit_requested == "measure":
                keras_kwargs["jit_compile"] = False
        optimizer = keras.optimizers.get(keras_kwargs.get("optimizer", "rmsprop"))
        keras_kwargs["optimizer"] = optimizer
        auto_scale_loss = bool(keras_kwargs.pop("auto_scale_loss", False))
        on_gpu = precision_lib.gpu_available()
        cpu_bf16 = precision_lib.cpu_has_native_bfloat16()
        # Keras resolves jit_compile="auto" to False on a CPU-only machine, and
        # the precision rule depends on jit only on a CPU.
        jit = keras_kwargs.get("jit_compile", "auto")
        # "measure" is resolved as no XLA here: the rule is decided at compile.
        jit = False if jit == "auto" or keras_kwargs.get("run_eagerly") else bool(jit)
        policy = precision_lib.resolve_precision(config.precision, jit, on_gpu, cpu_bf16)
        model_policy = policy or self.dtype_policy.name
        float16 = policy == "mixed_float16" or (
            policy is None and precision_lib.computes_in_float16(self)
        )
        scale = _loss_scale_setting(config.loss_scale, float16)
        keras_scales = auto_scale_loss and model_policy == "mixed_float16"
        # Every check runs before anything is changed.
        _check_conflicts(config, optimizer, scale, auto_scale_loss, keras_scales)
        _check_strategy(self.distribute_strategy, config, scale)
        setup = None
        if config.recompute is not None:
            setup = blocks.RecomputeSetup(self, config.recompute)

        rt = self._gradboost
        if rt.accumulator is not None:
            self.flush_accumulated_gradients()  # nothing pending is lost
        rt.float32_layers = []
        if policy is not None:
            rt.float32_layers = precision_lib.apply_policy(self, policy)
        super().compile(**keras_kwargs, auto_scale_loss=scale is None and auto_scale_loss)
        actual = precision_lib.resolve_precision(
            config.precision, bool(self.jit_compile), on_gpu, cpu_bf16
        )
        if actual != policy:  # Keras turned jit_compile off (unsupported layer)
            policy = actual
            rt.float32_layers = precision_lib.apply_policy(self, policy)
        message = precision_lib.float16_cpu_warning(policy, bool(self.jit_compile), on_gpu)
        if message:
            warnings.warn(message, stacklevel=2)

        rt.config = config
        rt.jit_requested = jit_requested
        rt.xla_blocked = xla_blocked
        rt.jit_measurement = None
        if jit_requested == "measure" and xla_blocked:
            rt.jit_measurement = jit_measure.JitMeasurement(
                jit_compile=False, reason=f"XLA is off: {xla_blocked}"
            )
        rt.auto_scale_loss = auto_scale_loss
        rt.policy = policy
        rt.accumulator = None
        rt.flush_function = None
        rt.last_health = (0, 0)
        rt.recompute = setup
        rt.recompute_check_pending = config.recompute_check
        if setup is not None:
            setup.apply()
        with self.distribute_strategy.scope():
            rt.facts = StepFacts()
            rt.scaler = None
            if scale is not None:
                rt.scaler = precision_lib.LossScaler(*scale)
        if config.accumulate_steps > 1:
            _warn_inexact_accumulation(self, config, keras_kwargs.get("loss"))

    def get_compile_config(self):
        config = super().get_compile_config()
        if config:
            requested = self._gradboost.jit_requested
            if requested is True or requested == "measure":
                config["jit_compile"] = requested  # Keras keeps what it ran
            config["gradboost"] = {
                **self._gradboost.config.to_dict(),
                "auto_scale_loss": self._gradboost.auto_scale_loss,
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
    def step_facts(self):
        """`StepFacts` of the training step: finiteness, skips, None grads."""
        return self._gradboost.facts

    @property
    def jit_measurement(self):
        """What `compile(jit_compile="measure")` chose, and why.

        A `jit_measure.JitMeasurement` (`jit_compile`, `xla_ms`,
        `no_xla_ms`, `timed_calls`, `reason`) once decided; None before, and
        for any other `jit_compile`.
        """
        return self._gradboost.jit_measurement

    @property
    def xla_blocked_reason(self):
        """Why XLA is off although `jit_compile=True` or `"measure"` asked for
        it (a layer with `supports_jit=False`, an op without an XLA kernel,
        ...), or None."""
        return self._gradboost.xla_blocked

    @property
    def dtype_policy_applied(self):
        """The dtype policy `compile(precision=...)` set, or None."""
        return self._gradboost.policy

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
        """
        setup = self._gradboost.recompute
        if setup is None:
            return blocks.RecomputePlan(setting=None)
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
            A function that puts back the previous watch and gradient-check
            setting; it does nothing once called, or when another watch was
            attached since.

        Raises:
            RuntimeError: if the model is not compiled.
        """
        facts = self.step_facts
        if facts is None:
            raise RuntimeError("Call `compile()` before attaching a watch.")
        previous = (facts.checks_gradients, facts.watch)
        facts.checks_gradients = True
        facts.watch = watch
        attached = [True]

        def undo():
            if attached[0] and facts.watch is watch:
                facts.checks_gradients, facts.watch = previous
            attached[0] = False

        return undo

    # ------------------------------------------------------------- train step

    def make_train_function(self, force=False):
        # fit/train_on_batch call this after building the model when a
        # distribution strategy is set: create the accumulators here, in the
        # strategy's scope. Without a strategy Keras builds the model while
        # tracing the step, and train_step creates them (see _accumulator).
        if self.trainable_variables and self._needs_new_accumulator():
            with self.distribute_strategy.scope():
                self._new_accumulator()
            force = True
        rt = self._gradboost
        if self._measuring_jit() and (force or self.train_function is None):
            self.train_function = self._make_measuring_function()
        else:
            super().make_train_function(force=force)
        base = hooks.base_train_function(self)
        if isinstance(base, jit_measure.MeasuringTrainFunction) and base.result:
            # Left in place by a callback's undo: keep only the choice.
            hooks.replace_base_train_function(
                self, base.functions[base.result.jit_compile]
            )
        if rt.recompute_check_pending and self.train_function is not rt.check_wrapper:
            _, undo = hooks.hold_batches(
                self, before_call=lambda b: self._check(b, undo)
            )
            rt.check_wrapper = self.train_function
        return self.train_function

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
        return jit_measure.MeasuringTrainFunction(self, functions, self._jit_decided)

    def _jit_decided(self, measurement, function):
        rt = self._gradboost
        rt.jit_measurement = measurement
        if not measurement.jit_compile and measurement.xla_ms is None:
            rt.xla_blocked = measurement.reason
        if bool(self.jit_compile) != measurement.jit_compile:
            self.jit_compile = measurement.jit_compile
            # Made again, when needed, with the chosen setting.
            self.test_function = None
            self.predict_function = None
        measuring = hooks.base_train_function(self)
        if isinstance(measuring, jit_measure.MeasuringTrainFunction):
            hooks.replace_base_train_function(self, function)
        hooks.print_msg(measurement.message())

    def _check(self, batches, undo):
        rt = self._gradboost
        undo()
        if rt.recompute_check_pending:
            rt.recompute_check_pending = False
            batch = as_local_batch(batches[0], self.distribute_strategy)
            if rt.recompute.pending:
                x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
                rt.recompute.resolve_budget(self, x)
            recompute_check.check(self, rt.recompute, batch)

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
        rt.flush_function = None

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
        accumulating = rt.config.accumulate_steps > 1
        n = sample_count(x)
        # Accumulators sum n_j * (the replica's mean gradient) over
        # micro-batches. Keras' loss is that mean over `replicas`, so the
        # weight is n * replicas; it goes on the scalar loss (free), or on the
        # gradients together with the loss-scale division (one pass).
        weight = n * replicas if accumulating else 1.0

        self._prepare_forward(x)
        with tf.GradientTape() as tape:
            y_pred = self._training_forward(x)
            loss = hooks.compute_loss(
                self, x, y, y_pred, sample_weight, training=True
            )
            batch_loss = loss * replicas if replicas > 1 else loss
            hooks.loss_tracker(self).update_state(batch_loss, sample_weight=n)
            if self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)
            if rt.scaler is not None:
                loss = loss * tf.cast(rt.scaler.scale, loss.dtype)
            elif accumulating:
                loss = loss * tf.cast(weight, loss.dtype)

        variables = self.trainable_weights
        if not variables:
            warnings.warn("The model does not have any trainable weights.")
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

        grads = tape.gradient(loss, variables)
        rt.facts.none_gradient_variables = tuple(
            v.path for v, g in zip(variables, grads) if g is None
        )
        if rt.scaler is not None:
            factor = weight / rt.scaler.scale
            grads = [None if g is None else g * tf.cast(factor, g.dtype) for g in grads]

        check = rt.scaler is not None or rt.facts.checks_gradients
        rt.facts.checks_gradients = check
        rt.grad_mask = [g is not None for g in grads]
        if accumulating:
            self._accumulator().grad_mask = rt.grad_mask
        if not check:
            rt.facts.last_step_finite.assign(tf.math.is_finite(batch_loss))
        if check or accumulating:
            bad = loss_bad = None
            if check:
                loss_bad = guard.nonfinite_indicator(batch_loss, [])
                bad = tf.maximum(loss_bad, guard.nonfinite_indicator(None, grads))
            present = [g for g in grads if g is not None]
            tf.distribute.get_replica_context().merge_call(
                self._decide, args=(present, n, bad, loss_bad)
            )
        else:
            # Exactly Keras' own step.
            self.optimizer.apply_gradients(zip(grads, variables))

        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if rt.scaler is not None:
            logs = dict(logs)
            logs["loss_scale"] = rt.scaler.scale.read_value()
            logs["skipped_steps"] = rt.facts.skipped_steps.read_value()
        return logs

    def _prepare_forward(self, x):
        """Settles what the recompute forward needs from the first batch
        (the budget's choice, the input spec); outside any tape."""
        setup = self._gradboost.recompute
        if setup is not None and setup.pending:
            setup.resolve_budget(self, x)
        elif setup is not None and setup.input_spec is None:
            setup.observe(x)

    def _training_forward(self, x):
        """The forward pass of the training step (through the recompute
        blocks, if any). Call `_prepare_forward(x)` first."""
        setup = self._gradboost.recompute
        if setup is not None:
            return setup.forward(self, x)
        if hooks.call_has_training_arg(self):
            return self(x, training=True)
        return self(x)

    def _decide(self, strategy, present_grads, n, bad, loss_bad):
        """The cross-replica part of a step: one decision for all replicas.

        Decisions (is the step finite, is an update due) are made here from
        every replica's values, and each replica then applies the same
        decision to its own replica-local state. The `tf.cond`s run in
        cross-replica context, where their branches may call the optimizer
        (whose all-reduce uses `merge_call`).
        """
        rt = self._gradboost
        each = strategy.extended.call_for_each_replica
        variables = self.trainable_weights

        def with_nones(present):
            return guard.with_nones(present, rt.grad_mask)

        finite = None
        if bad is not None:
            finite = tf.equal(guard.sum_over_replicas(strategy, bad), 0.0)
            loss_finite = tf.equal(guard.sum_over_replicas(strategy, loss_bad), 0.0)
            # The update goes in when the step is finite and a NaNWatcher
            # (if any) has not halted updates.
            finite = guard.local_value(
                each(self._record_finiteness, args=(finite, loss_finite)), strategy
            )

        def when_finite(fn, *args):
            def run():
                fn(*args)  # returns nothing: tf.cond's branches must match

            if finite is None:
                run()
            else:
                tf.cond(finite, run, lambda: None)

        if rt.config.accumulate_steps == 1:
            when_finite(
                each,
                lambda g: self.optimizer.apply_gradients(
                    zip(with_nones(g), variables)
                ),
                (present_grads,),
            )
            return

        acc = rt.accumulator
        when_finite(each, lambda g, n: acc.add(with_nones(g), n), (present_grads, n))
        due = guard.local_value(each(acc.tick), strategy)
        tf.cond(
            due, lambda: self._apply_accumulated(strategy, variables), lambda: None
        )

    def _record_finiteness(self, finite, loss_finite):
        rt = self._gradboost
        genuine = tf.logical_not(finite)
        if rt.scaler is not None and rt.scaler.dynamic:
            # An overflow of the scaled backward pass is the dynamic scale's
            # normal search; only an unscaled non-finite loss, or an overflow
            # at the floor scale, is a real non-finite step.
            genuine = tf.logical_and(
                genuine,
                tf.logical_or(
                    tf.logical_not(loss_finite),
                    rt.scaler.scale <= precision_lib.SCALE_FLOOR,
                ),
            )
        rt.facts.nonfinite_steps.assign_add(tf.cast(genuine, tf.int64))
        if rt.scaler is not None:
            rt.scaler.update(finite)
        rt.facts.last_step_finite.assign(finite)
        rt.facts.skipped_steps.assign_add(tf.cast(tf.logical_not(finite), tf.int64))
        rt.facts.checked_steps.assign_add(1)
        if rt.facts.watch is None:
            return finite
        return rt.facts.watch.record(genuine, finite)

    def _apply_accumulated(self, strategy, variables):
        """Cross-replica: one update from the accumulated gradients, if any
        finite micro-batch was added, then reset the accumulators."""
        acc = self._gradboost.accumulator
        each = strategy.extended.call_for_each_replica
        total = guard.sum_over_replicas(strategy, each(acc.count.read_value))

        def apply_mean(total):
            grads = acc.mean_gradients(total)
            self.optimizer.apply_gradients(zip(grads, variables))

        def apply():
            each(apply_mean, args=(total,))

        tf.cond(total > 0, apply, lambda: None)
        each(acc.reset)

    def flush_accumulated_gradients(self):
        """Applies micro-batches accumulated since the last update, if any.

        `fit` calls it at the end of every epoch (before validation), so a
        remainder is never dropped nor carried into the next epoch. Call it
        yourself after a loop of `train_on_batch`.
        """
        rt = self._gradboost
        if rt.accumulator is None:
            return
        if rt.flush_function is None:
            variables = self.trainable_variables
            strategy = self.distribute_strategy
            acc = rt.accumulator

            def flush():
                with strategy.scope():
                    pending = strategy.extended.call_for_each_replica(
                        lambda: acc.micro_step.read_value() > 0
                    )
                    tf.cond(
                        guard.local_value(pending, strategy),
                        lambda: self._apply_accumulated(strategy, variables),
                        lambda: None,
                    )

            rt.flush_function = tf.function(flush, autograph=False)
        rt.flush_function()

    # --------------------------------------------------------------- fit hooks

    def fit(self, *args, **kwargs):
        try:
            return self._fit(*args, **kwargs)
        except tf.errors.InvalidArgumentError as error:
            found = jit_measure.unsupported_op(error, self) if self.jit_compile else None
            if found is None:
                raise
            self._gradboost.xla_blocked = found
            raise jit_measure.unsupported_op_error(found) from error

    def _fit(self, *args, **kwargs):
        rt = self._gradboost
        setup = rt.recompute
        if setup is not None and setup.pending and setup.batch_hint is None:
            setup.batch_hint = _batch_size_hint(_bind_fit_args(args, kwargs))
        if rt.config.accumulate_steps == 1 and rt.scaler is None:
            return super().fit(*args, **kwargs)
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
    each epoch; `fit` puts it first so ModelCheckpoint & co. see the update."""

    def __init__(self, model):
        super().__init__()
        self._target = model

    def on_train_begin(self, logs=None):
        # Micro-batches left by an interrupted fit() are applied, not mixed
        # into this run's first update.
        self._target.flush_accumulated_gradients()

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
    model (subclassed, or a Sequential without a known input) is wrapped: the
    new model calls it, and so shares its layers and weights.

    Args:
        model: a `keras.Model`. A `GradBoostModel` is returned as it is.

    Returns:
        A `GradBoostModel`, not yet compiled.

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
    if hooks.is_functional(model) or isinstance(model, keras.Sequential):
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            inputs = None
        if inputs:
            return GradBoostModel(inputs, outputs, name=model.name)
    return _BoostedModel(model, name=model.name)


# ------------------------------------------------------------------- helpers

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


def _bind_fit_args(args, kwargs):
    bound = _FIT_SIGNATURE.bind(None, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self")
    return arguments


def _batch_size_hint(fit_args):
    """The batch size `fit` will draw, when it can be told in advance."""
    x = fit_args.get("x")
    if isinstance(x, tf.data.Dataset):
        size = tf.nest.flatten(x.element_spec)[0].shape[0]
        if size is None:  # batches of no fixed size: look at the first
            first = next(iter(x.take(1)))
            size = tf.nest.flatten(first)[0].shape[0]
        return size
    arrays = [a for a in tf.nest.flatten(x) if hasattr(a, "shape")]
    if arrays and x is not None:
        batch = fit_args.get("batch_size") or 32
        return min(batch, int(arrays[0].shape[0]))
    return None


def _loss_scale_setting(loss_scale, float16):
    """`(dynamic, initial scale)` for the LossScaler, or None for no scaling."""
    if loss_scale == "dynamic" or (loss_scale == "auto" and float16):
        return (True, precision_lib.INITIAL_SCALE)
    if isinstance(loss_scale, float):
        return (False, loss_scale)
    return None


def _check_conflicts(config, optimizer, scale, auto_scale_loss, keras_scales):
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


_UNSUPPORTED_STRATEGIES = (
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.experimental.ParameterServerStrategy,
    tf.distribute.TPUStrategy,
)


def _check_strategy(strategy, config, scale):
    """Accumulation and loss scaling decide on local replicas' values: right
    in one process (one device, MirroredStrategy), not yet across workers."""
    if config.accumulate_steps == 1 and scale is None:
        return
    if isinstance(strategy, _UNSUPPORTED_STRATEGIES):
        raise ValueError(
            f"accumulate_steps={config.accumulate_steps} and loss_scale="
            f"{config.loss_scale!r} are not supported yet under "
            f"{type(strategy).__name__}. Supported: one device and "
            "MirroredStrategy. Use accumulate_steps=1 and loss_scale=None "
            "with this strategy."
        )


def _warn_inexact_accumulation(model, config, loss):
    """Warns about what makes k micro-batches differ from one large batch."""
    steps = config.accumulate_steps
    bn = [
        l.name
        for l in hooks.flatten_layers(model)
        if isinstance(l, keras.layers.BatchNormalization)
    ]
    if bn:
        shown = ", ".join(bn[:4]) + (f" and {len(bn) - 4} more" if len(bn) > 4 else "")
        warnings.warn(
            f"accumulate_steps={steps}: the BatchNormalization layers "
            f"({shown}) normalise each micro-batch with its own statistics, "
            "not those of the whole accumulated batch, so the result differs "
            "from one large-batch step. Use LayerNormalization or "
            "GroupNormalization for an exact equivalent.",
            stacklevel=3,
        )
    losses = tf.nest.flatten(loss) if loss is not None else []
    odd = sorted(
        {
            l.reduction
            for l in losses
            if isinstance(l, keras.losses.Loss)
            and l.reduction not in ("sum_over_batch_size", "mean")
        }
    )
    if odd:
        warnings.warn(
            f"accumulate_steps={steps}: a loss with reduction={odd[0]!r}. "
            "Accumulation weights each micro-batch by its sample count, which "
            'is exact for reduction="sum_over_batch_size" (the default) only.',
            stacklevel=3,
        )
