"""NaNWatcher: catch the first non-finite step, name the layer that produced
it, and keep the weights safe."""

import dataclasses
import os

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import cluster
from keras_gradboost import guard
from keras_gradboost import hooks
from keras_gradboost import wrappers
from keras_gradboost.callbacks import args
from keras_gradboost.callbacks.backup import hold_backups
from keras_gradboost.callbacks.backup import resumed_at
from keras_gradboost.callbacks.base import CallbackBase
from keras_gradboost.locate import as_local_batch
from keras_gradboost.locate import locate_nonfinite
from keras_gradboost.precision import computes_in_float16
from keras_gradboost.state import every_copy

ACTIONS = ("stop", "skip", "restore", "warn")
# The model attribute holding its guarded train function: `(key, function,
# WatchState)`, made once per compiled model and watcher setting.
_GUARDED = "_keras_gradboost_guarded_train_function"

ADVICE = (
    "What usually helps: lower the learning rate (by 10-100x); train once in "
    'float32 (precision="float32") to rule out float16 overflow; guard '
    "log/sqrt/division against 0 in the loss and custom layers (e.g. "
    "log(x + eps), sqrt(max(x, eps))); prefer numerically stable ops "
    "(kgb.ops.safe_log, kgb.ops.safe_sqrt, kgb.ops.safe_norm, "
    "kgb.ops.safe_divide, kgb.ops.logsumexp, kgb.ops.log1pexp, "
    "keras.ops.log1p, losses with from_logits=True)."
)


class NonFiniteError(RuntimeError):
    """Raised by `NaNWatcher` to end training on a non-finite step.

    Raising (rather than setting `model.stop_training`) skips the
    end-of-training hooks of other callbacks, so `BackupAndRestore` keeps its
    backup. The weights are those before the bad step.

    Attributes:
        event: the `NaNEvent` that ended training.
    """

    def __init__(self, message, event):
        super().__init__(message)
        self.event = event


@dataclasses.dataclass
class NaNEvent:
    """One non-finite training step.

    Attributes:
        epoch: 0-based epoch.
        step: 0-based index of the batch within its epoch, as Keras numbers
            batches.
        phase: "forward", "loss" or "backward" (None when not located).
        layer: name of the layer that produced the first non-finite value.
        variables: paths of variables with non-finite gradients.
        float32_finite: for a float16 model, whether the step is finite when
            replayed in float32 (True: float16 overflow); None otherwise.
        action_taken: "stopped", "skipped", "restored" or "warned".
        detail: what the replay saw, in one sentence.
        advice: the `kgb.ops` the layer at fault could use, from the ops
            its call runs ("" when none applies).
        dump_path: the `.npz` with the offending batch, if `dump_dir` was set.
    """

    epoch: int
    step: int
    phase: object = None
    layer: object = None
    variables: tuple = ()
    float32_finite: object = None
    action_taken: str = ""
    detail: str = ""
    advice: str = ""
    dump_path: object = None

    def report(self):
        where = f"epoch {self.epoch}, step {self.step}"
        lines = [f"NaNWatcher: non-finite training step at {where}."]
        if self.phase:
            lines.append(
                f"  phase: {self.phase}; layer: {self.layer or '-'}; {self.detail}."
            )
        elif self.detail:
            lines.append(f"  {self.detail}.")
        if self.variables:
            shown = ", ".join(self.variables[:6])
            more = len(self.variables) - 6
            lines.append(
                f"  variables with non-finite gradients: {shown}"
                + (f" and {more} more" if more > 0 else "")
            )
        if self.float32_finite is True:
            lines.append(
                "  replayed in float32 the step is finite: float16 overflow. "
                'Use loss scaling (loss_scale="dynamic") or mixed_bfloat16.'
            )
        elif self.float32_finite is False:
            lines.append(
                "  replayed in float32 the step is still non-finite: not a "
                "float16 problem."
            )
        if self.advice:
            lines.append(f"  advice: {self.advice}.")
        if self.dump_path:
            lines.append(f"  batch saved to {self.dump_path}")
        lines.append(f"  action: {self.action_taken}. {ADVICE}")
        return "\n".join(lines)


@dataclasses.dataclass
class NaNReport:
    """What a `NaNWatcher` saw in the last `fit`.

    Attributes:
        action: the watcher's `action` argument.
        events: the `NaNEvent`s, one per train call with non-finite steps.
        nonfinite_steps: non-finite training steps read so far in the fit
            (the count `logs["nonfinite_steps"]` shows).
        actions: `{action taken: events}`, e.g. `{"skipped": 2}`.
    """

    action: str = "stop"
    events: list = dataclasses.field(default_factory=list)
    nonfinite_steps: int = 0
    actions: dict = dataclasses.field(default_factory=dict)

    def summary(self):
        if not self.events and not self.nonfinite_steps:
            return f"NaNWatcher (action={self.action!r}): no non-finite step."
        lines = [
            f"NaNWatcher (action={self.action!r}): {self.nonfinite_steps} "
            f"non-finite steps, {len(self.events)} events."
        ]
        if self.actions:
            lines.append(
                "  actions: "
                + ", ".join(f"{name} {n}" for name, n in self.actions.items())
            )
        lines += [event.report() for event in self.events]
        return "\n".join(lines)


class NaNWatcher(CallbackBase):
    """Stops, skips or rolls back a non-finite training step, and says where
    it came from.

    The check runs inside the compiled train step (with `jit_compile` too): a
    step whose gradients (or loss) are not finite is never applied to the
    weights, and the step records its index in-graph. The callback adds no
    host sync of its own on good steps: it reads the count of non-finite
    steps that the train function already returned, one call late (when
    that value is long computed), and at the epoch's end. Only when a step
    went bad does it read more, and replay that batch eagerly to find the
    layer that produced the first non-finite value.

    Reading late loses nothing where it matters: with `"stop"` and
    `"restore"`, the non-finite step halts training in-graph (every later
    step's update is dropped too) until the callback has acted, so the
    weights it stops with or rolls back from are those before the bad step,
    also when the bad step is followed by good ones in the same
    `steps_per_execution` chunk or the next. With `"skip"` and `"warn"` only
    the bad steps are dropped; the good steps after them are applied, and
    the replay uses the weights of up to one chunk later. The event names
    the exact bad step; with `steps_per_execution > 1` there is one event
    per chunk with bad steps, naming the first. With a dynamic loss scale
    (GradBoostModel), the scale's own overflows are not events.

    With `accumulate_steps` (GradBoostModel), a bad micro-batch that halts
    training (`"stop"`, `"restore"`, or `max_skips` in a row) discards the
    accumulation window it falls in: the window's good micro-batches are
    dropped, never applied, wherever the bad one sits, so no update is
    applied at or after it. After a `"restore"` a fresh window starts.

    `logs["nonfinite_steps"]` (bad steps in this `fit`) shows in the progress
    bar and History.

    Cost: the checks themselves are one sum per gradient (an exact check
    runs only when a sum is not finite). The larger cost on a multi-core CPU
    is the guarantee itself: no update may start before the last gradient
    (the first layer's) is checked, whereas Keras alone updates the last
    layers while the first layer's backward pass still runs. With
    `tf.config.threading.set_inter_op_parallelism_threads(1)` (no ops side
    by side) that wait costs nothing. The measured figures, with those of
    `tf.debugging.enable_check_numerics()` for comparison, are in
    `benchmarks/RESULTS.md`.

    Works with any compiled Keras model: with a `GradBoostModel` the skip is
    part of its train step; with a plain model the optimizer's `apply`
    (which `apply_gradients` calls, as may a custom train step) is wrapped
    for the duration of `fit` (a model whose
    optimizer is a `LossScaleOptimizer` already skips non-finite steps, and
    is refused: use `GradBoostModel` with `loss_scale=`).

    Args:
        action: what to do after a non-finite step, whose update is skipped
            in every case: `"stop"` raises `NonFiniteError` (other callbacks'
            end-of-training hooks do not run, so `BackupAndRestore` keeps its
            backup); `"skip"` goes on, and stops after `max_skips`
            consecutive bad steps; `"restore"` rolls weights and optimizer
            state back to their copy from the start of the epoch (one host
            copy per epoch), multiplies the learning rate by `lr_factor` and
            goes on; `"warn"` only reports. Defaults to `"stop"`.
        locate: replay the bad batch to name the layer and phase. Defaults to
            `True`.
        dump_dir: a directory to save the bad batch to (`.npz`), or `None`.
            Under several workers each saves its own part of the batch,
            `..._worker<i>.npz`. Defaults to `None`.
        max_skips: consecutive bad steps tolerated by `"skip"` and
            `"restore"` (counted in-graph, step by step, also within a
            `steps_per_execution` chunk). Defaults to `10`.
        lr_factor: learning-rate factor of `"restore"`. Defaults to `0.5`.
        verbose: print each event's report. Defaults to `1`.

    Raises:
        ValueError: for a bad argument value.
        TypeError: for an argument of the wrong type.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_gradboost

    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.rand(64, 4).astype("float32")
    y = np.random.rand(64, 1).astype("float32")
    x[10] = np.nan  # one bad example: its step is skipped
    watcher = keras_gradboost.callbacks.NaNWatcher(action="skip")
    model.fit(x, y, batch_size=16, callbacks=[watcher])
    print(watcher.summary())
    watcher.report().nonfinite_steps  # 1
    ```
    """

    # No batch-end hook: everything runs in the train call (hold_batches),
    # so Keras keeps dispatching batches asynchronously.
    async_safe = True

    def __init__(
        self,
        action="stop",
        locate=True,
        dump_dir=None,
        max_skips=10,
        lr_factor=0.5,
        verbose=1,
    ):
        super().__init__()
        self.action = args.check_choice("action", action, ACTIONS)
        self.locate = args.check_bool("locate", locate)
        self.dump_dir = args.check_directory("dump_dir", dump_dir)
        self.max_skips = args.check_int("max_skips", max_skips, minimum=1)
        args.check_number("lr_factor", lr_factor, above=0, below=1)
        self.lr_factor = lr_factor
        self.verbose = args.check_verbose(verbose)
        # (model/optimizer/function/steps_per_execution key, guarded train
        # function, WatchState)
        self._reset()

    # ------------------------------------------------------------ set-up

    def _reset(self):
        self.events = []
        self._epoch = 0
        self._seen = 0  # bad steps handled

    def _install(self):
        model = self.model
        from keras_gradboost.model import GradBoostModel
        from keras_gradboost.model import own_steps

        # fit() made the train function before this hook: make one with the
        # checks in (traced once, and kept for later fits of the same compiled
        # model), and give fit() its own function back afterwards.
        # Other callbacks' hold_batches wrappers may be on top already: the
        # guarded function goes under them.
        # A GradBoostModel whose class has its own train_step may apply its
        # gradients itself: guard its optimizer, as for a plain model. Not
        # when it accumulates or scales the loss: then every update must go
        # through GradBoostModel's (`_own_step` refuses any other), whose
        # watch checks each micro-batch, where the guard would see only the
        # window's mean.
        gradboost = isinstance(model, GradBoostModel) and (
            "train_step" not in own_steps(model)
            or model.gradboost_config.accumulate_steps > 1
            or model.train_plan.loss_scale is not None
        )
        self._refuse(model, gradboost)
        # A backup taken between a bad step and its late read would hold a
        # halted step nobody acted on: held back until the watcher acts.
        self._on_teardown(hold_backups(model, self._unread_bad_step))
        key = (
            model.optimizer,
            wrappers.base_train_function(model),
            model.steps_per_execution,
            self.action in ("stop", "restore"),
            None if self.action == "warn" else self.max_skips,
        )
        cached = vars(model).get(_GUARDED)
        fresh = cached is None or any(a is not b and a != b for a, b in zip(cached[0], key))
        watch = self._new_watch(model) if fresh else cached[2]
        if gradboost:
            self._on_teardown(model.attach_watch(watch))
        else:
            # The guard sees only gradients: the tap shows it the loss too.
            # The state tap lets a dropped step put back the moving
            # statistics its forward pass wrote.
            losses, states = guard.LossTap(), guard.StateTap()
            self._on_teardown(losses.tap(model))
            self._on_teardown(states.tap(model))
            self._on_teardown(
                guard.guard_optimizer(
                    model.optimizer, watch=watch, losses=losses, states=states
                )
            )
        if fresh:
            guarded = wrappers.make_train_function_with_logs(
                model,
                lambda: {
                    "nonfinite_steps": tf.cast(watch.count.read_value(), tf.float32)
                },
            )
            cached = (key, guarded, watch)
            # Kept on the model (not on this callback), so a new NaNWatcher
            # in every fit() reuses the traced function; object.__setattr__
            # keeps Keras from tracking it.
            object.__setattr__(model, _GUARDED, cached)
        self._on_teardown(wrappers.replace_base_train_function(model, cached[1]))
        # fit() calls make_train_function() first: if a fit() ended in an
        # exception (no on_train_end), the next fit() undoes the watcher here.
        self._on_teardown(
            wrappers.patch(
                model,
                "make_train_function",
                lambda make, force=False: self._teardown() or make(force=force),
            )
        )
        self._watch = watch
        watch.reset()  # one host round trip per fit
        self._done = 0  # steps run in this fit (as the in-graph watch.step)
        self._epoch_first = 0  # index of the epoch's first step
        self._batches = {}  # step index -> batch, for the last few calls
        self._pending = None  # the last call's (count tensor, first, end step)
        self._hold(self._before_call, self._after_call)
        if self.action == "restore":
            self._snapshot()

    def _refuse(self, model, gradboost):
        """Raises for a model the watcher cannot guard as asked."""
        lr = model.optimizer.get_config().get("learning_rate")
        if self.action == "restore" and not isinstance(lr, (int, float)):
            # A schedule's config is a dict naming its class.
            kind = lr.get("class_name") if isinstance(lr, dict) else None
            raise ValueError(
                'NaNWatcher(action="restore") lowers a constant learning '
                f"rate; this optimizer's is a schedule ({kind or type(lr).__name__}). "
                'Use action="skip" or "stop" with a schedule.'
            )
        if not gradboost and isinstance(
            model.optimizer, keras.optimizers.LossScaleOptimizer
        ):
            raise ValueError(
                "NaNWatcher cannot guard a LossScaleOptimizer (it already "
                "skips non-finite steps, without saying where they came "
                "from). Use keras_gradboost.GradBoostModel with "
                'loss_scale="dynamic" instead.'
            )

    def _new_watch(self, model):
        with model.distribute_strategy.scope():
            return guard.WatchState(
                # Bad steps of the chunk read late and of the one after.
                ring=2 * model.steps_per_execution + 2,
                halt_every=self.action in ("stop", "restore"),
                max_in_row=None if self.action == "warn" else self.max_skips,
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._check_pending()
        self._epoch = epoch
        self._epoch_first = self._done
        if self.action == "restore":
            self._snapshot()

    def on_epoch_end(self, epoch, logs=None):
        # Usually done after the epoch's last call already (see _after_call);
        # this covers epochs of unknown length and early stops.
        self._check_pending()

    # ------------------------------------------------------------- events

    def _before_call(self, batches):
        if getattr(self, "_snapshot_pending", False):
            self._build_then_snapshot(batches[0])
        # References to batches that exist anyway; kept for 3 calls, long
        # enough for a late read.
        keep = 3 * self.model.steps_per_execution
        for i, batch in enumerate(batches):
            self._batches[self._done + i] = batch
        for step in [s for s in self._batches if s < self._done - keep]:
            del self._batches[step]
        self._call_first = self._done
        self._done += len(batches)

    def _after_call(self, batches, logs):
        previous = self._pending
        self._pending = (logs["nonfinite_steps"], self._call_first, self._done)
        if previous is not None:
            # The previous call's value: computed by now (on an accelerator,
            # the read waits at most for that call, never for this one).
            self._check(previous)
        steps = (self.params or {}).get("steps")
        if steps and self._done - self._epoch_first >= steps:
            self._check_pending()  # the epoch's last call: Keras syncs next

    def _resumed_batches(self):
        """The batches of this epoch a fit() resumed from a backup skipped
        past this watcher (its steps count from there); 0 for others."""
        resumed = resumed_at(self.model)
        return resumed[1] if resumed is not None and resumed[0] == self._epoch else 0

    def _unread_bad_step(self):
        """Whether the last call, not yet read, had a bad step (a host read
        of its count: only when a backup is due)."""
        if self._pending is None:
            return False
        return int(round(float(np.asarray(self._pending[0])))) != self._seen

    def _check_pending(self):
        pending, self._pending = self._pending, None
        if pending is not None:
            self._check(pending)

    def _check(self, pending):
        """Acts on the bad steps of one call (`pending`), if it had any."""
        count_tensor, _, _ = pending
        count = int(round(float(np.asarray(count_tensor))))
        if count == self._seen:
            return
        # Bad steps number self._seen .. count - 1 happened in that call. The
        # watch recorded each one's step index and run length in a ring.
        watch = self._watch
        ring = watch.ring
        bad_steps = np.asarray(watch.bad_steps.numpy())
        bad_runs = np.asarray(watch.bad_runs.numpy())
        slots = [c % ring for c in range(self._seen, count)]
        first = int(bad_steps[slots[0]])
        in_row = int(bad_runs[slots].max())
        self._seen = count
        event = self._event(first)
        self.events.append(event)
        stop = self.action == "stop" or (
            self.action in ("skip", "restore") and in_row >= self.max_skips
        )
        if stop:
            event.action_taken = "stopped"
        elif self.action == "restore":
            self._restore()
            # Go on, unless a later step went bad too (its own check comes).
            if int(watch.count.numpy()) == count:
                watch.halted.assign(False)
            event.action_taken = "restored"
            resumed = self._resumed_batches()
            if resumed:
                event.detail = (event.detail + "; " if event.detail else "") + (
                    f"restored to the weights at batch {resumed} "
                    "of this epoch, where the fit() resumed from a backup (the "
                    "epoch's start is not held)"
                )
        else:
            event.action_taken = "skipped" if self.action == "skip" else "warned"
        message = event.report()
        if self.verbose:
            print(message, flush=True)
        if stop:
            self._teardown()
            raise NonFiniteError(message, event)

    def _event(self, step):
        """The event of the bad step with in-fit index `step`, located if
        asked."""
        event = NaNEvent(
            epoch=self._epoch, step=step - self._epoch_first + self._resumed_batches()
        )
        if not self.locate:
            event.detail = "not located (locate=False)"
            return event
        data = self._batches.get(step)
        if data is None:
            event.detail = "not located (the batch is no longer held)"
            return event
        finding = locate_nonfinite(self.model, data)
        if self.dump_dir:
            event.dump_path = _dump(self.dump_dir, data, event, self.model)
        if finding.phase is None:
            event.detail = "the replay of the batch was finite (a random layer?)"
            return event
        event.phase, event.layer = finding.phase, finding.layer
        event.variables, event.detail = finding.variables, finding.detail
        event.advice = finding.advice
        if computes_in_float16(self.model):
            with _float32_policies(self.model):
                event.float32_finite = locate_nonfinite(self.model, data).phase is None
        return event

    # ----------------------------------------------------------- results

    def report(self):
        """What the watcher saw in the last `fit`, as a `NaNReport`."""
        actions = {}
        for event in self.events:
            if event.action_taken:
                actions[event.action_taken] = actions.get(event.action_taken, 0) + 1
        return NaNReport(
            action=self.action,
            events=list(self.events),
            nonfinite_steps=self._seen,
            actions=actions,
        )

    # ----------------------------------------------------------- restore

    def _snapshot(self):
        model = self.model
        self._snapshot_pending = not model.trainable_variables
        if self._snapshot_pending:
            # Built by the first trace of its step (no strategy): taken by
            # `_before_call`, which builds it first.
            return
        if not model.optimizer.built:
            # Before the first update the optimizer holds only its step
            # counter and learning rate: build its slots now, so the first
            # epoch's snapshot holds them too (a roll-back must reset them).
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
        # Each replica's copy (BatchNormalization statistics differ).
        self._weights = every_copy(model.weights, model.distribute_strategy)
        # The learning rate is not state to roll back: restore lowers it.
        self._optimizer_state = [
            (v, v.numpy()) for v in model.optimizer.variables if v.name != "learning_rate"
        ]

    def _build_then_snapshot(self, batch):
        """`"restore"` on a model not built before `fit` (a subclassed model,
        a Sequential without an Input): build it with one inference forward
        on the first batch (no weight, statistic or optimizer change), then
        take the epoch's snapshot before its first update."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(
            as_local_batch(batch, self.model.distribute_strategy)
        )
        states = {id(v) for v in hooks.untracked_state(self.model)}
        self.model(x, training=False)
        # A stateful RNN this call built wrote its states: back to their start.
        for v in hooks.untracked_state(self.model):
            if id(v) not in states:
                v.assign(tf.zeros_like(v.value))
        self._snapshot()

    def _restore(self):
        model = self.model
        for copy, value in self._weights:
            copy.assign(value)
        for v, value in self._optimizer_state:
            v.assign(value)
        lr = float(np.asarray(model.optimizer.learning_rate))
        model.optimizer.learning_rate = lr * self.lr_factor


class _float32_policies:
    """Temporarily sets every layer's dtype policy to float32."""

    def __init__(self, model):
        self.layers = hooks.flatten_layers(model)

    def __enter__(self):
        self.saved = [l.dtype_policy for l in self.layers]
        for l in self.layers:
            l.dtype_policy = "float32"

    def __exit__(self, *exc):
        for l, p in zip(self.layers, self.saved):
            l.dtype_policy = p


def _dump(directory, data, event, model):
    """Saves this worker's part of the bad batch (under several workers each
    holds another part, which may be the finite one: each writes its own
    file, `..._worker<i>.npz`)."""
    os.makedirs(directory, exist_ok=True)
    strategy = model.distribute_strategy
    worker = f"_worker{cluster.worker_index(strategy)}" if cluster.is_multi_worker(strategy) else ""
    path = os.path.join(directory, f"nonfinite_epoch{event.epoch}_step{event.step}{worker}.npz")
    flat = tf.nest.flatten(as_local_batch(data, model.distribute_strategy))
    np.savez(path, **{f"arr_{i}": np.asarray(t) for i, t in enumerate(flat)})
    return path
