"""The one place where keras_gradboost touches Keras internals.

Everything else in the package uses public Keras and TensorFlow APIs only. Each
function here wraps one private attribute, and `tests/test_hooks.py` checks each
of them against the installed Keras, so an upgrade that moves one fails loudly
in one named test instead of somewhere deep inside a training step.
"""

import itertools

import keras
import tensorflow as tf


def flatten_layers(model, include_self=True):
    """All layers of `model`, nested ones included, each once, in order.

    `Layer._flatten_layers` is private. The public `model.layers` lists only the
    direct children, and misses layers held by subclassed layers.
    """
    return list(model._flatten_layers(include_self=include_self, recursive=True))


def child_layers(layer):
    """The layers `layer` holds directly (not their sub-layers), in order."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def functional_nodes(model):
    """The calls of a functional model's graph, in the order Keras runs them.

    Each is `(layer, input KerasTensors, output KerasTensors)`; a layer used
    twice appears twice. Reads the private `Function._nodes_by_depth`.
    """
    calls = []
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if node.operation is None or node.is_input:
                continue
            calls.append(
                (node.operation, list(node.input_tensors), list(node.output_tensors))
            )
    return calls


def loss_tracker(model):
    """The `Mean` metric behind `logs["loss"]`, created by `compile()`."""
    return model._loss_tracker


def optimizer_trainable_variables(optimizer):
    """The variables a built optimizer updates, in the order of
    `optimizer.apply(grads)` without `trainable_variables`."""
    return list(optimizer._trainable_variables)


def compute_loss(model, x, y, y_pred, sample_weight, training=True):
    """`model.compute_loss`, also for overrides that lack `training=`.

    Keras' own `train_step` calls the private `_compute_loss` for this reason.
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def call_has_training_arg(model):
    """Whether `model.call` accepts `training=` (Keras decides this at init)."""
    return model._call_has_training_arg


def functional_model_class():
    """`keras.src.models.functional.Functional`, the class behind
    `keras.Model(inputs, outputs)`; it has no public name."""
    from keras.src.models.functional import Functional

    return Functional


def is_functional(model):
    """Whether `model` is a `Functional` (`keras.Model(inputs, outputs)`).

    A `keras.Sequential` is not: it wraps a functional graph, built lazily.
    """
    return isinstance(model, functional_model_class())


def functional_init_arguments(args, kwargs):
    """Whether `Model(*args, **kwargs)` asks for a functional model."""
    from keras.src.models.model import functional_init_arguments as _f

    return _f(args, kwargs)


def is_fit_validation(evaluate_kwargs):
    """Whether an `evaluate()` call is `fit()`'s own end-of-epoch validation.

    `fit` passes the private `_use_cached_eval_dataset=True`; a callback that
    evaluates mid-epoch does not.
    """
    return bool(evaluate_kwargs.get("_use_cached_eval_dataset", False))


def current_autocast():
    """The dtype Keras autocasts float variables to right now, or None.

    Set by a layer's `__call__` around its `call` (mixed precision). A block's
    `call` recomputed during the backward pass runs outside that `__call__`,
    so the recompute re-enters the scope the forward saw.
    """
    from keras.src.backend.common.variables import get_autocast_scope

    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


def autocast(dtype):
    """A context in which float variables are read as `dtype` (None: as they
    are stored)."""
    from keras.src.backend.common.variables import AutocastScope

    return AutocastScope(dtype)


def stop_recording():
    """A context in which no gradient tape records (TensorFlow's private
    `record.stop_recording`, which `tf.recompute_grad` uses too): the forward
    of a recomputed block is differentiated by its custom gradient only."""
    from tensorflow.python.eager import record

    return record.stop_recording()


def keras_saveable_class():
    """`keras.src.saving.keras_saveable.KerasSaveable`, the base of what
    Keras' saving walk visits (layers, optimizers, metrics): an object of a
    subclass, found as an attribute of a model, is saved and loaded through
    its `save_own_variables` / `load_own_variables`. It has no public
    name."""
    from keras.src.saving.keras_saveable import KerasSaveable

    return KerasSaveable


def jit_blockers(model):
    """Why Keras turns `jit_compile` off for `model`, as short reasons.

    Keras' `model_supports_jit` (private, in `keras.src.trainers.trainer`)
    says only yes or no, and `compile()` then sets `jit_compile=False`
    silently (for `"auto"`) or with a warning that names no cause. The
    reasons are the ones it checks: layers with `supports_jit=False`, op
    determinism enabled in TensorFlow, and TensorFlow on an Apple-silicon
    GPU.

    Returns:
        A list of reasons such as `"layer 'rnn' (MyRNN) has
        supports_jit=False"`; empty when Keras allows XLA.
    """
    import platform

    from tensorflow.python.framework.config import is_op_determinism_enabled

    reasons = []
    if (
        platform.system() == "Darwin"
        and "arm" in platform.processor().lower()
        and tf.config.list_physical_devices("GPU")
    ):
        reasons.append("TensorFlow has no XLA on the Apple-silicon GPU")
    layers = [
        layer for layer in flatten_layers(model) if not getattr(layer, "supports_jit", True)
    ]
    for layer in layers[:3]:
        reasons.append(
            f"layer {layer.name!r} ({type(layer).__name__}) has supports_jit=False"
        )
    if len(layers) > 3:
        reasons.append(f"{len(layers) - 3} more layers have supports_jit=False")
    if not layers and is_op_determinism_enabled():
        reasons.append(
            "op determinism is enabled "
            "(tf.config.experimental.enable_op_determinism)"
        )
    return reasons


def keras_supports_jit(model):
    """Keras' own verdict (`model_supports_jit`), to check `jit_blockers`."""
    from keras.src.trainers.trainer import model_supports_jit

    return model_supports_jit(model)


def print_msg(message):
    """Prints `message` as Keras prints its progress bar: to stdout, or to
    absl logging when `keras.utils.disable_interactive_logging()` is on.
    (`keras.src.utils.io_utils.print_msg` has no public name.)"""
    from keras.src.utils.io_utils import print_msg as _print_msg

    _print_msg(message)


def check():
    """Fails with an AttributeError naming what moved, if a hook is broken.

    Used by the test suite; cheap enough to call at import time in a debugger.
    """
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    assert len(flatten_layers(model)) == 3
    assert [layer.name for layer in child_layers(model)] == [
        layer.name for layer in model.layers
    ]
    (layer, ins, outs), = functional_nodes(model)
    assert layer is model.layers[1] and ins[0] is inputs and outs == model.outputs
    assert isinstance(loss_tracker(model), keras.metrics.Mean)
    model.optimizer.build(model.trainable_variables)
    assert optimizer_trainable_variables(model.optimizer) == list(
        model.trainable_variables
    )
    assert call_has_training_arg(model) in (True, False)
    assert is_functional(model)
    assert functional_init_arguments((inputs, inputs), {})
    with autocast("bfloat16"):
        assert current_autocast() == "bfloat16"
        with autocast(None):
            assert current_autocast() is None
    assert current_autocast() is None
    with tf.GradientTape() as tape:
        x = tf.constant(1.0)
        tape.watch(x)
        with stop_recording():
            y = x * 2.0
    assert tape.gradient(y, x) is None
    assert keras_supports_jit(model) is True and jit_blockers(model) == []
    assert issubclass(keras.layers.Layer, keras_saveable_class())
    assert issubclass(keras.optimizers.Optimizer, keras_saveable_class())
    from keras.src.utils.io_utils import print_msg as _print_msg

    assert callable(_print_msg)
    return True


def make_train_function_with_logs(model, extra_logs):
    """Makes a new train function whose step also returns `extra_logs()`.

    `extra_logs` is called inside the traced step (after the model's own
    `train_step`) and returns a dict of tensors, which the train function
    returns with the step's logs: the callback that reads them late reads a
    value the step already computed, with no extra op. Keras'
    `make_train_function` binds `model.train_step` when it makes the
    function: the wrapped step is in place only while it is made.
    `model.train_function` is left as it was.

    Returns:
        The new train function (not yet traced).
    """
    top = model.train_function
    own = vars(model).get("train_step")
    step = model.train_step

    def train_step(data):
        return {**step(data), **extra_logs()}

    model.train_step = train_step
    try:
        model.make_train_function(force=True)
        made = model.train_function
    finally:
        if own is None:
            del model.train_step
        else:
            model.train_step = own
        model.train_function = top
    return made


FUNCTIONS = ("train", "test", "predict")
# What fit() and evaluate() hand the train and test functions.
_TF_ITERATORS = (tf.data.Iterator, tf.distribute.DistributedIterator)


def hold_batches(
    model,
    extra_logs=None,
    before_call=None,
    after_call=None,
    function="train",
    is_current=None,
    teardown=None,
):
    """Wraps one of `model.train_function`, `model.test_function` or
    `model.predict_function` so the batches of the last call stay reachable,
    at no cost (the tensors exist anyway; nothing is copied).

    Keras' train and test functions take an iterator; given a list of
    batches they run their compiled one-step function on each. This wrapper
    draws up to `steps_per_execution` batches itself and runs that list path
    inside one `tf.function` traced for the iterator's `element_spec`, so the
    step is traced as Keras traces it (the batch dimension stays `None`: a
    short last batch is no retrace) and a chunk of `steps_per_execution`
    steps is still one call. Keras' predict function is called with the list
    of batches already drawn (`predict()` draws them); the wrapper passes it
    on.

    Wrappers stack: several callbacks may each hold the batches. Undoing a
    wrapper that another one has since wrapped turns it into a pass-through.

    Args:
        model: a Keras model whose function is made (`make_train_function`,
            `make_test_function`, `make_predict_function`).
        extra_logs: optional callable returning a dict merged into the logs
            of every call (so the progress bar and History show it); ignored
            for `function="predict"`, whose result is the predictions (and
            note that extra keys in the test logs change what `evaluate()`
            returns). Defaults to `None`.
        before_call: optional callable `(batches)`, called before each call
            with the list of batches it will run (eager tensors: their shapes
            are concrete, and reading a shape costs no device sync).
            Defaults to `None`.
        after_call: optional callable `(batches, logs)` called after each
            call with its logs (tensors, not yet read; for predict, the
            outputs); a dict it returns is merged into the logs, as for
            `extra_logs`. Defaults to `None`.
        function: which function to wrap: `"train"`, `"test"` or
            `"predict"`. Defaults to `"train"`.
        is_current: optional callable `()` asked at each call from `fit()` or
            `evaluate()` (a call with a `tf.data` iterator); False means the
            owner of the wrapper is not part of that run (the run that put
            the wrapper in place ended in an exception, and Keras called no
            `on_*_end`): the wrapper then calls `teardown` and passes the
            call on. Defaults to `None`.
        teardown: optional callable `()` that removes the owner's wrappers
            (this one included), called when `is_current()` is False and when
            a call raises anything other than the end of the data. Defaults
            to `None`.

    Returns:
        `(held, undo)`: the list that holds the last call's batches, and a
        function that restores the original function.

    Raises:
        ValueError: for an unknown `function`, or one the model has not made.
    """
    if function not in FUNCTIONS:
        raise ValueError(
            "Invalid value for argument `function`. Received: "
            f"function={function!r}. Expected one of "
            f"{', '.join(map(repr, FUNCTIONS))}."
        )
    attribute = f"{function}_function"
    if getattr(model, attribute, None) is None:
        raise ValueError(
            f"Invalid value for argument `function`. Received: "
            f"function={function!r}, but `model.{attribute}` is None. Call "
            f"`model.make_{function}_function()` first."
        )
    cell = [getattr(model, attribute)]  # what this wrapper calls (see below)
    held = []
    active = [True]
    predict = function == "predict"

    def draw(iterator):
        if predict:  # predict() hands over the list it drew
            return list(iterator)
        return draw_batches(model, iterator)

    def wrapper(iterator):
        original = cell[0]
        if (
            active[0]
            and is_current is not None
            and isinstance(iterator, _TF_ITERATORS + (_Chunk,))
            and not is_current()
        ):
            (teardown or undo)()
            active[0] = False
        if not active[0]:
            return _run_chunk(model, original, iterator)
        try:
            return call(original, iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            raise  # the end of the data: the run goes on
        except BaseException:
            if teardown is not None:
                teardown()  # Keras calls no on_*_end after an exception
            raise

    def call(original, iterator):
        batches = draw(iterator)
        if not batches:
            raise StopIteration
        held[:] = batches
        if before_call is not None:
            before_call(batches)
        logs = _run_chunk(model, original, batches)
        if after_call is not None:
            more = after_call(batches, logs)
            if more and not predict:
                logs = {**logs, **more}
        if extra_logs is not None and not predict:
            logs = {**logs, **extra_logs()}
        return logs

    wrapper._held_original = cell
    wrapper._held_active = active
    setattr(model, attribute, wrapper)

    def undo():
        active[0] = False
        if getattr(model, attribute) is wrapper:
            # Drop this wrapper and any pass-through ones below it.
            setattr(model, attribute, _skip_inactive(cell[0]))

    return held, undo


def draw_batches(model, iterator):
    """The batches one call of `model.train_function` (or `test_function`)
    would run: up to `steps_per_execution` batches drawn from `iterator`.

    Drawn from a `tf.data` iterator, the list keeps its `element_spec`, so
    `run_batches` runs them as one call traced for that spec. A list already
    drawn (by a `hold_batches` wrapper) is returned as it is.

    Args:
        model: the compiled model.
        iterator: what Keras passes to the function: a `tf.data` or
            distributed iterator, a drawn list, or any iterable of batches.

    Returns:
        A list of batches (empty when the iterator is exhausted).
    """
    if isinstance(iterator, _Chunk):  # drawn by a wrapper above this one
        return iterator
    if isinstance(iterator, _TF_ITERATORS):
        batches = _Chunk(iterator.element_spec)
        for _ in range(model.steps_per_execution):
            try:
                batches.append(next(iterator))
            except (StopIteration, tf.errors.OutOfRangeError):
                break
        return batches
    return list(itertools.islice(iterator, model.steps_per_execution))


def run_batches(model, function, batches):
    """Runs a train/test function (Keras' own, or a wrapper) on batches from
    `draw_batches`, as one call: the step is not traced again for the
    batches' concrete shapes, and a chunk of `steps_per_execution` batches
    is not split into separate calls.

    Returns:
        The logs of the call.
    """
    return _run_chunk(model, function, batches)


def runs_batches(function):
    """Marks `function` (a train function that dispatches to other ones) as
    taking a list of drawn batches itself: `hold_batches` wrappers above it
    call it with the list instead of tracing it into a `tf.function` (which
    would freeze its Python dispatch). It must then hand a list to
    `run_batches`. Returns `function`."""
    function._runs_batches = True
    return function


class _Chunk(list):
    """The batches one call runs, drawn from a `tf.data` iterator whose
    `element_spec` they keep (wrappers below the drawing one pass it on)."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec


def _run_chunk(model, function, batches):
    """Calls `function` (a wrapper, or Keras' function at the bottom) on
    `batches`. Keras' function is run in a `tf.function` traced once per
    chunk length for the drawn iterator's `element_spec`: called eagerly with
    the batches it would trace its step for their concrete shapes, then
    again for the short last batch, and would run a chunk of
    `steps_per_execution` steps as that many calls."""
    if (
        getattr(function, "_held_original", None) is not None
        or getattr(function, "_runs_batches", False)
        or not isinstance(batches, _Chunk)
        or model.run_eagerly
    ):
        return function(batches)
    runner = getattr(function, "_chunk_runner", None)
    if runner is None:  # kept on the function, so it goes when that goes
        runner = function._chunk_runner = _ChunkRunner(function)
    return runner(batches)


class _ChunkRunner:
    def __init__(self, function):
        self.traced = set()
        self.run = tf.function(function, autograph=False)

    def __call__(self, batches):
        key = (len(batches), tuple(tf.nest.flatten(batches.spec)))
        if key not in self.traced:
            # Traced for the spec, eager calls dispatch to it (a supertype).
            self.run.get_concrete_function([batches.spec] * len(batches))
            self.traced.add(key)
        return self.run(list(batches))


def base_function(model, function="train"):
    """The train/test/predict function under every `hold_batches` wrapper:
    the one Keras (or a callback) made; None when it is not made."""
    fn = getattr(model, f"{function}_function")
    while getattr(fn, "_held_original", None) is not None:
        fn = fn._held_original[0]
    return fn


def _skip_inactive(fn):
    while getattr(fn, "_held_active", [True])[0] is False:
        fn = fn._held_original[0]
    return fn


def base_train_function(model):
    """The train function under every `hold_batches` wrapper: the one Keras
    (or a callback) made."""
    return base_function(model, "train")


def replace_base_train_function(model, new):
    """Puts `new` in place of `base_train_function(model)`, under the
    `hold_batches` wrappers of other callbacks (which stay in place).

    Returns:
        A function that puts the previous base function back.
    """
    fn, cell = model.train_function, None
    while getattr(fn, "_held_original", None) is not None:
        cell = fn._held_original
        fn = cell[0]
    old = fn
    if cell is None:
        model.train_function = new
    else:
        cell[0] = new

    def undo():
        if cell is not None and cell[0] is new:
            cell[0] = old
        if model.train_function is new:
            model.train_function = old
            return
        # Wrappers put on top since: find `new` under them.
        fn = model.train_function
        while getattr(fn, "_held_original", None) is not None:
            if fn._held_original[0] is new:
                fn._held_original[0] = old
                return
            fn = fn._held_original[0]

    return undo
