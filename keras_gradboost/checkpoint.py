"""GradBoostModel's training state in Keras' saved weights.

Keras' saving walks a model's attributes and saves each saveable object it
finds through `save_own_variables(store)`, and loads it back through
`load_own_variables(store)`: `model.save(".keras")`, `save_weights` /
`load_weights`, `ModelCheckpoint` and `BackupAndRestore` all go through it.
A GradBoostModel shows that walk one more object, `TrainingState`, saved
under its own path (`_gradboost_training_state`), with:

* the loss scale and its count of finite steps since the last change;
* the step facts' skip counters (the loss-scale health warnings read them);
* the accumulation window: the gradient sums of the micro-batches added
  since the last update (for a variable with `overwrite_with_gradient`, the
  maximum of its values), their sample count, the position in the window,
  which variables get a gradient, and whether its micro-batches ran under
  XLA (`jit_compile="measure"` finishes a loaded window under the same
  setting, so its Dropout masks stay the large batch's; a model with a
  fixed other setting warns; `jit_measure.WindowSetting`);
* `precision="auto"`'s (or `"measure"`'s) decision, or, saved before it
  was made, its measuring progress (`precision_measure.saved_state`): a loaded model
  compiled with `precision="auto"` trains on in the saved run's policy,
  or goes on with its schedule, instead of measuring again; the same of
  `jit_compile="measure"` (`jit_measure.saved_state`).

So a model saved mid-window and loaded again goes on as if it had never
been saved. A plain Keras model loading the same file does not visit that
path, and a file without it (saved before, or by a plain model) loads as
before. The scale, the counters and the window position are the same on
every replica (every replica records the same all-reduced decisions). The
window's sums differ per replica, but only their sum over the replicas
matters (the update all-reduces them): that sum is saved (for a maximum,
the maximum over the replicas), and a load puts it on the first replica, so
a window saved under `MirroredStrategy` loads on one device and the other
way round.
"""

import warnings
import weakref

import numpy as np

from keras_gradboost import cluster
from keras_gradboost import hooks
from keras_gradboost import precision_measure
from keras_gradboost.step import local_value

_SCALE = "loss_scale"
_GOOD_STEPS = "loss_scale_good_steps"
_DYNAMIC = "loss_scale_dynamic"
_FACTS = ("skipped_steps", "checked_steps", "nonfinite_steps")
_STEPS = "accumulate_steps"
_COUNT = "window_samples"
_MICRO = "window_micro_batches"
_MASK = "window_gradient_mask"
_SUM = "window_sum_"
_REPLICAS = "window_replicas"
_ROWS = "window_rows"  # samples added, where the next Dropout rows start
_SEED = "window_seed_"  # each window_dropout generator's state at the window's start
_WINDOW_JIT = "window_jit"  # 1: the pending micro-batches ran under XLA
_PRECISION = "precision_measure"  # JSON, as uint8 (measure_schedule.encode_state)
_JIT = "jit_measure"  # the same, of jit_compile="measure"


class TrainingState(hooks.leaf_saveable_class()):
    """The saveable object through which Keras' saving reaches a
    GradBoostModel's training state (`collect` / `restore`).

    Args:
        model: the GradBoostModel.
    """

    def __init__(self, model):
        # A weak reference: the saving walk visits this object's attributes
        # too, and must not walk into the model again.
        self._model = weakref.ref(model)

    def save_own_variables(self, store):
        model = self._model()
        for key, value in collect(model._gradboost, model.distribute_strategy).items():
            store[key] = value
        if model._gradboost.plan is None:
            return
        jit = model._pending_window_jit()
        if jit is not None:
            store[_WINDOW_JIT] = np.asarray(int(jit), np.int8)
        record = model._precision_state()
        if record is not None:
            store[_PRECISION] = precision_measure.encode_state(record)
        record = model._jit_state()
        if record is not None:
            store[_JIT] = precision_measure.encode_state(record)

    def load_own_variables(self, store):
        state = {key: np.asarray(store[key]) for key in store.keys()}
        if not state:
            return  # a file saved without it
        model = self._model()
        if model._gradboost.plan is None:  # put back by the next compile()
            model._gradboost.loaded_state = state
        else:
            restore(model, state)


def _local(variable, strategy):
    return list(strategy.experimental_local_results(variable))


def _first(variable, strategy):
    return np.asarray(local_value(variable, strategy).numpy())


def pending_micro_batches(model):
    """The micro-batches in `model`'s accumulation window, added since its
    last update (0 for a model that does not accumulate, or a plain Keras
    model)."""
    rt = getattr(model, "_gradboost", None)
    acc = None if rt is None else rt.accumulator
    if acc is None:
        return 0
    return acc.pending(model.distribute_strategy)


def _refuse_partial_window_of_several_workers(acc, strategy):
    """Each worker holds only its own replicas' part of a window's sums, and
    a save reads this worker's: a file of one worker's part would load as
    the whole window, wrong."""
    pending = acc.pending(strategy)
    if pending and cluster.is_multi_worker(strategy):
        raise ValueError(
            f"Cannot save a GradBoostModel in the middle of an accumulation "
            f"window under MultiWorkerMirroredStrategy: {pending} of "
            f"{acc.steps} micro-batches are pending, and each worker holds only "
            "its own part of their gradients. Save at an update boundary "
            "(keras_gradboost.callbacks.BackupAndRestore waits for one), or at "
            "an epoch's end."
        )


def collect(rt, strategy):
    """The entries to save for a model's runtime state `rt` (empty before
    `compile()`).

    Raises:
        ValueError: under several workers, when the accumulation window
            holds micro-batches (only this worker's part of it is here).
    """
    state = {}
    _warn_unsaved(rt, strategy)
    if rt.accumulator is not None:
        _refuse_partial_window_of_several_workers(rt.accumulator, strategy)
    if rt.facts is not None:
        for name in _FACTS:
            state[name] = _first(getattr(rt.facts, name), strategy)
    if rt.scaler is not None:
        state[_SCALE] = _first(rt.scaler.scale, strategy)
        state[_GOOD_STEPS] = _first(rt.scaler.good_steps, strategy)
        state[_DYNAMIC] = np.asarray(rt.scaler.dynamic)
    acc = rt.accumulator
    if acc is not None:
        counts = [float(c.numpy()) for c in _local(acc.count, strategy)]
        state[_STEPS] = np.asarray(acc.steps, np.int64)
        state[_COUNT] = np.asarray(sum(counts), np.float32)
        state[_MICRO] = _first(acc.micro_step, strategy)
        state[_ROWS] = _first(acc.rows, strategy)
        for i, start in enumerate(rt.window_draws.starts if rt.window_draws else ()):
            state[f"{_SEED}{i}"] = _first(start, strategy)
        state[_MASK] = np.asarray(acc.grad_mask, bool)
        state[_REPLICAS] = np.asarray(strategy.num_replicas_in_sync, np.int64)
        for i, (total, keeps_max) in enumerate(zip(acc.sums, acc.keeps_max)):
            parts = [
                np.asarray(part.numpy())
                for part, count in zip(_local(total, strategy), counts)
                if count > 0  # a replica that added nothing holds stale sums
            ]
            combine = np.maximum.reduce if keeps_max else sum
            state[f"{_SUM}{i}"] = combine(parts) if parts else np.zeros(total.shape, np.float32)
    return state


def _warn_unsaved(rt, strategy):
    """Names what `minimize()` keeps for other optimizers: not saved yet."""
    others = [state for state in rt.other_states.values() if any(state)]
    pending = [acc for acc, _ in others if acc is not None and acc.pending(strategy)]
    scaled = [scaler for _, scaler in others if scaler is not None and scaler.dynamic]
    if pending or scaled:
        warnings.warn(
            f"Saving: the state minimize() keeps for {len(others)} optimizer(s) "
            "other than the model's own is not saved"
            + (f" ({len(pending)} pending accumulation window(s) are lost)" if pending else "")
            + (f" ({len(scaled)} dynamic loss scale(s) restart at their initial value)"
               if scaled else "")
            + ". Save at an epoch's end (windows are applied then) to lose no "
            "micro-batch.",
            stacklevel=3,
        )


def _assign_all(variable, value, strategy):
    for part in _local(variable, strategy):
        part.assign(value)


def restore(model, state):
    """Puts saved entries back into a compiled GradBoostModel's runtime
    state; warns, naming it, about any entry the model cannot take."""
    rt = model._gradboost
    strategy = model.distribute_strategy
    ignored = []
    if rt.facts is not None and "checked_steps" in state:
        for name in _FACTS:
            _assign_all(getattr(rt.facts, name), state[name], strategy)
        rt.last_health = (
            int(state["skipped_steps"]),
            int(state["checked_steps"]),
        )
    if _SCALE in state:
        ignored.extend(_restore_scale(rt.scaler, state, strategy))
    # First: whether a loaded window's unit goes on.
    jit = precision_measure.decode_state(state[_JIT]) if _JIT in state else None
    ignored.extend(model._restore_jit(jit))
    if _MICRO in state:
        ignored.extend(_restore_window(model, state, strategy))
    record = precision_measure.decode_state(state[_PRECISION]) if _PRECISION in state else None
    ignored.extend(model._restore_precision(record))
    if ignored:
        warnings.warn(
            "The loaded weights hold gradboost training state this model "
            f"cannot take: {'; '.join(ignored)}. It is dropped; compile the "
            "model as it was saved to keep it.",
            stacklevel=3,
        )


def _restore_scale(scaler, state, strategy):
    """Restores a saved dynamic loss scale; returns what it could not. A
    fixed scale is the model's own setting (from `compile()`), never
    overwritten by a file."""
    scale = float(state[_SCALE])
    dynamic = bool(state.get(_DYNAMIC, True))
    if scaler is None:
        return [f"the loss scale {scale:g} (loss scaling is off)"]
    if dynamic and scaler.dynamic:
        _assign_all(scaler.scale, state[_SCALE], strategy)
        _assign_all(scaler.good_steps, state[_GOOD_STEPS], strategy)
        return []
    if not dynamic and not scaler.dynamic and scale == float(scaler.scale.numpy()):
        return []
    saved = "dynamic" if dynamic else "fixed"
    own = "dynamic" if scaler.dynamic else f"fixed at {float(scaler.scale.numpy()):g}"
    return [f"the {saved} loss scale {scale:g} (this model's scale is {own})"]


def _restore_window_draws(rt, state, pending, strategy):
    """Restores where the window's Dropout rows start and its seeds
    (`window_dropout`); returns what it could not."""
    acc = rt.accumulator
    starts = rt.window_draws.starts if rt.window_draws else []
    saved = sum(k.startswith(_SEED) for k in state)
    if saved == len(starts) and _ROWS in state:
        _assign_all(acc.rows, int(state[_ROWS]), strategy)
        for i, start in enumerate(starts):
            _assign_all(start, state[f"{_SEED}{i}"], strategy)
        return []
    _assign_all(acc.rows, 0, strategy)
    if not (pending and starts):
        return []
    return [
        f"the Dropout seeds of the {pending} pending micro-batches ({saved} saved, "
        f"{len(starts)} here): the rest of the window draws its masks from the "
        "seeds it finds, not as the large-batch step would"
    ]


def _restore_window(model, state, strategy):
    """Restores a saved accumulation window; returns what it could not."""
    rt = model._gradboost
    pending = int(state[_MICRO])
    sums = [state[f"{_SUM}{i}"] for i in range(sum(k.startswith(_SUM) for k in state))]
    variables = model.trainable_variables
    if rt.config.accumulate_steps == 1:
        return [] if pending == 0 else [
            f"{pending} accumulated micro-batches (accumulate_steps=1)"
        ]
    shapes = [tuple(v.shape) for v in variables]
    if [tuple(s.shape) for s in sums] != shapes:
        return [
            f"{pending} accumulated micro-batches of {len(sums)} variables "
            f"(the model has {len(variables)} of other shapes)"
        ]
    acc = model._ensure_accumulator()
    acc.grad_mask = [bool(m) for m in state[_MASK]]
    for i, total in enumerate(acc.sums):
        for j, part in enumerate(_local(total, strategy)):
            part.assign(sums[i] if j == 0 else np.zeros_like(sums[i]))
    for j, part in enumerate(_local(acc.count, strategy)):
        part.assign(state[_COUNT] if j == 0 else 0.0)
    _assign_all(acc.micro_step, pending, strategy)
    lost = _restore_window_draws(rt, state, pending, strategy)
    rt.loaded_window = rt.loaded_window or pending > 0
    model._loaded_window(bool(state[_WINDOW_JIT]) if _WINDOW_JIT in state else None, pending)
    saved_replicas = int(state.get(_REPLICAS, strategy.num_replicas_in_sync))
    if saved_replicas != strategy.num_replicas_in_sync and pending:
        warnings.warn(
            f"The loaded accumulation window was saved with {saved_replicas} "
            f"replicas and goes on with {strategy.num_replicas_in_sync}: exact "
            "when `fit` built it (each replica ran its part of every batch), "
            "not when `train_on_batch` did under the strategy (each replica "
            "ran the whole batch, so its samples count once per replica).",
            stacklevel=4,
        )
    saved_steps = int(state[_STEPS])
    if saved_steps != acc.steps and pending:
        warnings.warn(
            f"The loaded accumulation window was saved with accumulate_steps="
            f"{saved_steps}; this model uses accumulate_steps={acc.steps}: its "
            f"{pending} pending micro-batches count towards the next update.",
            stacklevel=4,
        )
    return lost
