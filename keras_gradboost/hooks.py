"""The one place where keras_gradboost touches Keras internals.

Everything else in the package uses public Keras and TensorFlow APIs only. Each
function here wraps one private attribute, and `tests/test_hooks.py` checks each
of them against the installed Keras, so an upgrade that moves one fails loudly
in one named test instead of somewhere deep inside a training step.
"""

import contextlib
import sys
import threading

import keras
import numpy as np
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


def untracked_state(layer):
    """The variables the forward pass of `layer` (its sub-layers included)
    writes that Keras leaves out of `layer.variables`: a stateful RNN's
    states (`RNN.states`, which Keras makes under
    `no_automatic_dependency_tracking`, so that saving skips them). Whatever
    puts a model's state back after a forward pass (a dropped step, a
    replay, a probe, a recomputed block) must put these back too. None
    before the RNN is built (`check_untracked_state`)."""
    listed = {id(v) for v in layer.variables}
    found = {}
    for inner in flatten_layers(layer):
        if isinstance(inner, keras.layers.RNN) and inner.stateful:
            for v in tf.nest.flatten(inner.states or []):
                if isinstance(v, keras.Variable) and id(v) not in listed:
                    found[id(v)] = v
    return list(found.values())


def forward_state(layer, metrics=True):
    """The variables a forward pass of `layer` may write, which whatever
    puts its state back after one (a dropped step, a replay, a probe, a
    recomputed block) must cover: its non-trainable variables (moving
    statistics, seed generators, frozen weights), a stateful RNN's states
    (`untracked_state`) and, with `metrics`, its metrics' variables."""
    found = [v for v in layer.variables if not v.trainable] + untracked_state(layer)
    if metrics:
        found += layer.metrics_variables
    return list({id(v): v for v in found}.values())


def compiled_metric_objects(model):
    """The `keras.metrics.Metric` objects given to `compile(metrics=...,
    weighted_metrics=...)`, built or not. Keras builds its container of
    compiled metrics in the train step's first trace (without a strategy),
    so before it `model.metrics` lists none of them, while an object passed
    in holds its variables already. Reads the private
    `Trainer._compile_metrics` and `CompileMetrics._user_metrics` /
    `_user_weighted_metrics`."""
    container = getattr(model, "_compile_metrics", None)
    if container is None:
        return []
    found = {}
    for given in (container._user_metrics, container._user_weighted_metrics):
        for item in tf.nest.flatten(given) if given is not None else []:
            if isinstance(item, keras.metrics.Metric):
                found[id(item)] = item
    return list(found.values())


def check_compiled_metric_objects():
    """A metric object given to `compile` is found before the first step,
    when `model.metrics` does not list it yet."""
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    mae = keras.metrics.MeanAbsoluteError()
    model.compile(optimizer="sgd", loss="mse", metrics=[mae, "mse"],
                  weighted_metrics={"dense": [keras.metrics.MeanSquaredError()]})
    found = compiled_metric_objects(model)
    assert found[0] is mae and len(found) == 2, found
    assert not any(m is mae for m in model.metrics)


def check_untracked_state():
    """A built stateful LSTM's two states are variables Keras does not list
    among the layer's (else `untracked_state` is not needed), and a forward
    pass assigns them."""
    lstm = keras.layers.LSTM(2, stateful=True)
    lstm(tf.ones((1, 3, 2)))
    states = untracked_state(lstm)
    assert len(states) == 2, states
    assert not {id(v) for v in states} & {id(v) for v in lstm.variables}
    assert float(np.abs(states[0].numpy()).sum()) > 0.0


# Where `keep_input_dtypes` keeps what it changed, to undo it.
_KEPT_INPUTS = "_keras_gradboost_kept_inputs"


def casts_inputs(layer):
    """Whether `layer.__call__` converts its inputs through its dtype policy
    (a mixed policy casts float inputs to the compute dtype) before `call`.

    Reads the private `Layer._convert_input_args`. Keras sets it False on a
    Functional model (it converts each input to its `Input`'s dtype itself)
    and on its preprocessing layers (lookups, hashing, category encoding).
    """
    return bool(layer._convert_input_args)


def keep_input_dtypes(layer, keep=True):
    """Makes `layer.__call__` pass its inputs to `call` as given (`keep=True`),
    as Keras does for a Functional model, or undoes that (`keep=False`).

    Sets the private `Layer._convert_input_args` to False, and
    `_allow_non_tensor_positional_args` to True (as a Functional has it: a
    NumPy array, no longer converted, reaches `call` as it is). The layer's
    dtype policy, the autocasting of its variables and its sub-layers' own
    input casting are left as they are. Undoing restores both attributes.
    """
    kept = getattr(layer, _KEPT_INPUTS, None)
    if keep and kept is None:
        setattr(layer, _KEPT_INPUTS, (layer._convert_input_args,
                                      layer._allow_non_tensor_positional_args))
        layer._convert_input_args = False
        layer._allow_non_tensor_positional_args = True
    elif not keep and kept is not None:
        layer._convert_input_args, layer._allow_non_tensor_positional_args = kept
        delattr(layer, _KEPT_INPUTS)


def keeps_input_dtypes(layer):
    """Whether `keep_input_dtypes` is in force on `layer`."""
    return getattr(layer, _KEPT_INPUTS, None) is not None


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


def keras_mask(tensor):
    """The Keras mask a layer attached to `tensor` (an `Embedding(mask_zero=
    True)`, `Masking` or `compute_mask` of a custom layer), or None. Keras'
    losses read it (`backend.get_keras_mask`, private) to divide a batch's
    loss by its valid entries. Symbolic `KerasTensor`s of a functional graph
    carry theirs too."""
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor)


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


def layer_graph(layer):
    """The functional graph whose calls `layer`'s `call` runs: `layer` itself
    when functional, a built `keras.Sequential`'s inner one (the private
    `Sequential._functional`, which its `call` runs), else None (also for a
    class that overrides their `call`: it may run something else)."""
    functional = functional_model_class()
    if is_functional(layer) and type(layer).call is functional.call:
        return layer
    if isinstance(layer, keras.Sequential) and type(layer).call is keras.Sequential.call:
        inner = getattr(layer, "_functional", None)
        return inner if is_functional(inner) else None
    return None


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


_LOSSES = threading.local()  # per thread: MirroredStrategy traces replicas in threads
_COLLECTS = "_keras_gradboost_collects_losses"  # on the installed `add_loss`


def _install_loss_collector():
    """Puts a wrapper in front of `keras.layers.Layer.add_loss` (once, for
    every layer class that does not override it): inside
    `collecting_losses` it records the losses instead of adding them."""
    layer_class = keras.layers.Layer
    original = layer_class.add_loss
    if getattr(original, _COLLECTS, False):
        return

    def add_loss(self, loss):
        collected, keep = getattr(_LOSSES, "collected", None) or (None, True)
        losses = keras.tree.flatten(loss)
        if collected is None or not all(keras.ops.is_tensor(x) for x in losses):
            return original(self, loss)  # Keras' own (and its error)
        collected.extend((self, x) for x in losses)
        if keep:
            return original(self, loss)

    add_loss.__doc__ = original.__doc__
    setattr(add_loss, _COLLECTS, True)
    layer_class.add_loss = add_loss


@contextlib.contextmanager
def collecting_losses(keep=False):
    """A context in which `Layer.add_loss` (a layer's own losses, activity
    regularizers) records each `(layer, loss)` in the yielded list, instead
    of adding it to the layer (or to a `StatelessScope`), or, with `keep`,
    as well.

    A recomputed block's forward runs where no tape records, so a loss
    its layers add there reaches none of its weights: the recompute
    collects them, returns them from its custom gradient and adds those
    back with `layer.add_loss`. Accumulation looks at which layers add
    losses (`keep=True`).
    """
    _install_loss_collector()
    previous = getattr(_LOSSES, "collected", None)
    collected = []
    _LOSSES.collected = (collected, keep)
    try:
        yield collected
    finally:
        _LOSSES.collected = previous


_DROPOUT_ROUTE = [None]  # what the installed `dropout` calls; None: Keras' own


def route_backend_dropout(route):
    """Keras' TensorFlow `backend.random.dropout`, which Keras' Dropout,
    SpatialDropout, Attention and RNN cells call at each draw
    (`keras.src.backend.tensorflow.random.dropout`, private), calls
    `route(original, inputs, rate, noise_shape, seed)` from now on (None:
    Keras' own again). Process-wide: the function put in front of Keras'
    stays, calling Keras' own while no route is set. Returns the route it
    replaced."""
    from keras.src.backend.tensorflow import random as tf_random

    if not getattr(tf_random.dropout, "_keras_gradboost_routed", False):
        original = tf_random.dropout

        def dropout(inputs, rate, noise_shape=None, seed=None):
            route_now = _DROPOUT_ROUTE[0]
            if route_now is None:
                return original(inputs, rate, noise_shape=noise_shape, seed=seed)
            return route_now(original, inputs, rate, noise_shape, seed)

        dropout.__doc__ = original.__doc__
        dropout._keras_gradboost_routed = True
        tf_random.dropout = dropout
    previous = _DROPOUT_ROUTE[0]
    _DROPOUT_ROUTE[0] = route
    return previous


def keras_noise_shape(inputs, noise_shape):
    """The noise shape Keras' TensorFlow `dropout` draws for `inputs` (a
    shape tensor, or a list of ints and scalar tensors). Private
    `_get_concrete_noise_shape`."""
    from keras.src.backend.tensorflow import random as tf_random

    return tf_random._get_concrete_noise_shape(inputs, noise_shape)


def keras_dropout_seed(seed):
    """The int32 seed Keras' TensorFlow `dropout` draws with for `seed` (a
    `SeedGenerator` moves on, as in Keras' draw). Private `_cast_seed` and
    `draw_seed`."""
    from keras.src.backend.tensorflow import random as tf_random

    return tf_random._cast_seed(tf_random.draw_seed(seed))


def check_backend_dropout():
    """Keras' Dropout draws through the routed `dropout`, with the seed and
    noise shape read as above."""
    seen = []

    def record(original, inputs, rate, noise_shape, seed):
        seen.append(seed)
        return original(inputs, rate, noise_shape=noise_shape, seed=seed)

    drop = keras.layers.Dropout(0.5, seed=3)
    x = tf.ones((4, 6))
    previous = route_backend_dropout(record)
    try:
        assert drop(x, training=True).shape == (4, 6)
    finally:
        route_backend_dropout(previous)
    assert seen == [drop.seed_generator], "Dropout no longer draws through backend.random.dropout"
    state = drop.seed_generator.state.numpy().copy()
    seed = keras_dropout_seed(drop.seed_generator)
    assert seed.dtype == tf.int32 and (drop.seed_generator.state.numpy() != state).any()
    assert [int(d) for d in keras_noise_shape(x, None)] == [4, 6]
    assert [int(d) for d in keras_noise_shape(x, (None, 1))] == [4, 1]
    return True


class _UpdateRecordingScope(keras.StatelessScope):
    def __init__(self, mapping):
        super().__init__(state_mapping=mapping)
        self.variables = {id(v): v for v, _ in mapping}
        self.updated = []
        self.read = set()  # ids of the variables read from the scope

    def add_update(self, update):
        self.updated.append(update[0])
        self.variables[id(update[0])] = update[0]
        super().add_update(update)

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        if value is not None:
            self.read.add(id(variable))
        return value


def update_recording_scope(state_mapping):
    """A `keras.StatelessScope` over `state_mapping` that also keeps the
    Keras variables assigned inside it, in `scope.updated` (in order).

    Keras' scope keeps its updates by `id(variable)` only, in
    `state_mapping`; a variable's `assign` reaches the scope through its
    `add_update((variable, value))`, which `_UpdateRecordingScope` extends.
    The recompute uses it to find state a block updates that no listed layer
    owns (its recompute would read it after the forward's update).
    """
    return _UpdateRecordingScope(state_mapping)


def scope_value(scope, variable):
    """`variable`'s value in an `update_recording_scope` (None: not in it),
    without counting a read."""
    return scope.state_mapping.get(id(variable))


def scope_values(scope):
    """`(variable, value)` for every variable an `update_recording_scope`
    holds now: its mapping, with the updates made inside it. Keras' scope
    keeps values by `id(variable)` (`state_mapping`); a variable reads its
    value through `scope.get_current_value`."""
    return [(v, scope.state_mapping[i]) for i, v in scope.variables.items()]


def onednn_enabled():
    """Whether TensorFlow runs its CPU kernels with oneDNN (on by default
    only on CPUs with AVX-512 and newer; `TF_ENABLE_ONEDNN_OPTS` overrides).
    Reads TensorFlow's private `_pywrap_util_port.IsMklEnabled`; None when
    it is gone."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return None
    check = getattr(_pywrap_util_port, "IsMklEnabled", None)
    return bool(check()) if check else None


def in_xla_context():
    """Whether the graph being traced here is compiled by XLA as a whole
    (inside a `tf.function(jit_compile=True)`, such as a step Keras compiles
    with `jit_compile=True`, or a function called from one). Reads
    TensorFlow's private `control_flow_util.GraphOrParentsInXlaContext`,
    which TensorFlow's own tracing consults; raises when it is gone."""
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def keras_saveable_class():
    """`keras.src.saving.keras_saveable.KerasSaveable`, the base of what
    Keras' saving walk visits (layers, optimizers, metrics): an object of a
    subclass, found as an attribute of a model, is saved and loaded through
    its `save_own_variables` / `load_own_variables`. It has no public
    name."""
    from keras.src.saving.keras_saveable import KerasSaveable

    return KerasSaveable


def leaf_saveable_class():
    """A `KerasSaveable` base for an object with no saveable children of
    its own: its private `_obj_type()` says "Loss", one of the few object
    types Keras' saving walk accepts (a type of one's own is refused)."""

    class LeafSaveable(keras_saveable_class()):
        def _obj_type(self):
            return "Loss"

    return LeafSaveable


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
    from tensorflow.python.framework.config import is_op_determinism_enabled

    no_xla = no_xla_device()
    reasons = [no_xla] if no_xla else []
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


def no_xla_device():
    """Why this machine's TensorFlow cannot compile with XLA, or None."""
    import platform

    if (
        platform.system() == "Darwin"
        and "arm" in platform.processor().lower()
        and tf.config.list_physical_devices("GPU")
    ):
        return "TensorFlow has no XLA on the Apple-silicon GPU"
    return None


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


def reduces_logs_across_workers(strategy):
    """Whether Keras' TensorFlow trainer reduces a step's logs across workers
    with `strategy.reduce("MEAN", v, axis=0)`: its private
    `_collective_all_reduce_multi_worker` (a MultiWorkerMirroredStrategy in
    multi-worker mode), the very test `reduce_per_replica` makes."""
    from keras.src.backend.tensorflow import trainer

    return bool(trainer._collective_all_reduce_multi_worker(strategy))


def _rank_one(value):
    if isinstance(value, (tf.Tensor, tf.Variable)) and value.shape.rank == 0:
        return tf.reshape(value, [1])
    return value


def logs_for_worker_reduce(step_function):
    """`step_function` with each scalar it returns as shape `(1,)`.

    Keras' TensorFlow trainer (`reduce_per_replica`, keras-team/keras#20585,
    tensorflow/tensorflow#72388) reduces a step's outputs across workers with
    `strategy.reduce("MEAN", v, axis=0)`, which fails on the scalar logs of
    every step. On a `(1,)` value it is the mean over all replicas of all
    workers, returned as a scalar: what Keras gives on one machine.
    """

    def step(data):
        return tf.nest.map_structure(_rank_one, step_function(data))

    return step


def first_local_batch(strategy, batch):
    """A distributed batch as this worker's first replica's part.

    Keras' build step (`_maybe_symbolic_build`, private) reduces a whole
    distributed `(x, y)` batch with `strategy.reduce("MEAN", ..., axis=None)`
    only to read its shapes and dtypes: a cross-device reduce of the data
    that MultiWorkerMirroredStrategy fails ("Attempt to convert a value
    (PerReplica:{...})"), for dict inputs too. One replica's part has the
    same dtypes and per-replica shapes, which is what each replica's step
    sees.
    """

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tf.nest.map_structure(local, batch)


class MultiWorkerTrainer:
    """Mixin for a `keras.Model` (GradBoostModel): Keras' TensorFlow trainer
    under MultiWorkerMirroredStrategy, its two failures worked around.

    1. the build step reads the first batch's shapes from this worker's
       first replica instead of reducing the batch across devices
       (`first_local_batch`);
    2. the train and test functions' steps return their scalar logs with
       shape `(1,)`, which Keras' cross-worker `reduce(..., axis=0)` reduces
       to the scalar mean over all replicas (`logs_for_worker_reduce`).

    Under any other strategy (or none) both are Keras' own code, unchanged.
    Overrides the private `_maybe_symbolic_build` and `_make_function` of
    Keras' TensorFlow trainer.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy  # None: Keras builds lazily
        if (
            iterator is not None
            and data_batch is None
            and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        ):
            # Keras' epoch iterator yields (begin, end, iterator) (3.15),
            # (step, iterator) in older Keras (3.8): the iterator comes last.
            for item in iterator:
                data_batch = first_local_batch(strategy, next(item[-1]))
                break
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _make_function(self, step_function):
        if reduces_logs_across_workers(self.distribute_strategy):
            step_function = logs_for_worker_reduce(step_function)
        return super()._make_function(step_function)


def set_initial_epoch(model, epoch):
    """Makes the next `fit()` of `model` start at `epoch` (None: at its own
    `initial_epoch` argument), as Keras' `BackupAndRestore` does: through
    the private `_initial_epoch`, which `fit()` reads before its first epoch
    (`self._initial_epoch or initial_epoch`) and never resets."""
    model._initial_epoch = epoch


def initial_epoch(model):
    """What `set_initial_epoch` set (None when nothing did)."""
    return model._initial_epoch


def fit_epoch_iterator(model, frame=None):
    """Keras' epoch iterator of the `fit()` of `model` that is running now
    (the local `epoch_iterator` of `fit`, private), or None when no `fit()`
    of `model` is on the call stack. `frame`: where to start looking up the
    stack (a signal handler's frame); defaults to the caller's."""
    frame = sys._getframe(1) if frame is None else frame
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
            found = frame.f_locals.get("epoch_iterator")
            if found is not None:
                return found
        frame = frame.f_back
    return None


def stream_position(epoch_iterator):
    """How many batches the epoch iterator has drawn from the data iterator
    it will draw the next batch from, where `fit()` keeps one data iterator
    across epochs (a `steps_per_epoch` was given: the epochs go on from each
    other until the data runs out); None where each epoch starts a new one.
    (Keras' private `_steps_seen`, which it compares with the data's length
    to start the data again.)"""
    if not epoch_iterator.steps_per_epoch:
        return None
    return int(epoch_iterator._steps_seen)


def advance_stream(epoch_iterator, batches):
    """Tells the epoch iterator that `batches` more batches were drawn from
    its data iterator (by BackupAndRestore, outside Keras' own count), so it
    starts the data again where the uninterrupted `fit()` would."""
    epoch_iterator._steps_seen += int(batches)


def symbolic_build(model, batch):
    """Builds what Keras builds at the first trace of a model's train
    function (its compiled metrics and loss), from the shapes of one `batch`
    of its data (`(x, y)` or `(x, y, sample_weight)`): Keras' private
    `_symbolic_build`, which `fit()` runs itself only under a strategy."""
    model._symbolic_build(data_batch=batch)


def call_context_values():
    """The arguments Keras' current layer-call context passes down to the
    layers called inside it (`training`, and any other call-context
    argument), as a dict; None outside a layer call. Keras keeps the context
    in its private global state (`current_call_ctx`, a `CallContext`)."""
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    if context is None:
        return None
    return {k: v for k, v in vars(context).items() if k != "entry_layer"}


@contextlib.contextmanager
def call_context(values):
    """Runs its body inside a Keras layer-call context holding `values`
    (from `call_context_values`; None: no context), as a layer's call does:
    the layers called in the body take their `training` from it. Outside
    any layer call (a replay run while the tape differentiates), each layer
    would start a context of its own, with `training` unset (Dropout off,
    BatchNormalization on its moving statistics)."""
    from keras.src.backend.common import global_state
    from keras.src.layers.layer import CallContext

    previous = global_state.get_global_attribute("current_call_ctx")
    context = None
    if values is not None:
        context = CallContext(entry_layer=None)  # no layer's exit resets it
        for name, value in values.items():
            setattr(context, name, value)  # Keras 3.8 has no `set_value`
    global_state.set_global_attribute("current_call_ctx", context)
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", previous)


def check_call_context():
    """Checks `call_context_values` and `call_context` against Keras: a
    layer's call sees `training=True` from its caller's context, and a
    Dropout called inside `call_context` drops as it would in that call."""
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(call_context_values())
            return x

    class Caller(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.probe = Probe()

        def call(self, x, training=None):
            return self.probe(x)

    Caller()(tf.ones((1, 2)), training=True)
    assert seen[-1] is not None and seen[-1].get("training") is True, seen
    assert call_context_values() is None
    drop = keras.layers.Dropout(0.5, seed=1)
    x = tf.ones((1, 64))
    assert np.all(drop(x).numpy() == 1.0)  # no context: inference
    with call_context({"training": True}):
        assert call_context_values() == {"training": True}
        assert np.any(drop(x).numpy() == 0.0)
    assert call_context_values() is None


def check_collecting_losses():
    """Checks `collecting_losses` against Keras: an activity regularizer's
    and a layer's own loss reach `add_loss`, which records them inside
    and adds them to `layer.losses` outside."""

    class Adds(keras.layers.Layer):
        def call(self, x):
            self.add_loss(tf.reduce_sum(x))
            return x

    dense = keras.layers.Dense(1, activity_regularizer="l2")
    adds = Adds()
    x = tf.ones((1, 2))
    with collecting_losses() as collected:
        adds(dense(x))
    assert [layer for layer, _ in collected] == [dense, adds], collected
    assert not dense.losses and not adds.losses
    with collecting_losses(keep=True) as collected:
        adds(dense(x))
    assert len(collected) == 2 and len(dense.losses) == 1 and len(adds.losses) == 1
    with collecting_losses():
        try:
            adds.add_loss(1.0)  # not a tensor: Keras' own error
        except ValueError:
            pass
        else:
            raise AssertionError("add_loss took a non-tensor inside collecting_losses")


def _eager_context():
    from tensorflow.python.eager import context

    return context.context()


def tensorflow_runtime_started():
    """Whether this process has started TensorFlow's runtime (its context
    made, or its physical devices listed: on a GPU that sets up CUDA).
    Importing TensorFlow does neither; the first op or device query does.
    Reads the private `context_safe()`, `Context._initialized` and
    `Context._physical_devices` (`tensorflow.python.eager.context`), without
    making a context."""
    from tensorflow.python.eager import context

    ctx = context.context_safe()
    return ctx is not None and (
        bool(ctx._initialized) or ctx._physical_devices is not None
    )


class CoordinationKeyExists(Exception):
    """`coordination_set` of a key that another worker set first."""


def coordination_set(key, value):
    """Sets `key` to the string `value` in the cluster's coordination service
    (the key-value store TensorFlow's `PreemptionCheckpointHandler` agrees on
    a step through; `tensorflow.python.eager.context`, private). A key is
    set once: raises `CoordinationKeyExists` when it already has a value."""
    try:
        _eager_context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError as e:
        raise CoordinationKeyExists(key) from e


def coordination_get(key, timeout_seconds=None):
    """The value of `key` in the coordination service, waiting until a
    worker sets it; after `timeout_seconds` (None: no limit) raises
    `TimeoutError`. (TensorFlow before 2.17 takes no timeout: the wait then
    runs in a daemon thread, given up after the time.)"""
    import inspect
    import threading

    get = _eager_context().get_config_key_value
    if timeout_seconds is None:
        return get(key)
    if "timeout_in_ms" in inspect.signature(get).parameters:
        try:
            return get(key, timeout_in_ms=max(1, int(timeout_seconds * 1000)))
        except tf.errors.DeadlineExceededError as e:
            raise TimeoutError(f"no worker set {key!r} within {timeout_seconds} s") from e
    found = []
    waiter = threading.Thread(target=lambda: found.append(get(key)), daemon=True)
    waiter.start()
    waiter.join(timeout_seconds)
    if not found:
        raise TimeoutError(f"no worker set {key!r} within {timeout_seconds} s")
    return found[0]


def check_coordination():
    """Checks the coordination-service calls `coordination_set` and
    `coordination_get` rely on (they need a cluster to run)."""
    import inspect

    ctx = _eager_context()
    assert list(inspect.signature(ctx.set_config_key_value).parameters) == [
        "key", "value"
    ]
    get = inspect.signature(ctx.get_config_key_value).parameters
    assert list(get)[:1] == ["key"], list(get)


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
    passthrough = keras.layers.Reshape((1,), dtype="mixed_bfloat16")
    assert casts_inputs(passthrough) and not casts_inputs(model)
    assert passthrough(tf.constant([[257.0]])).dtype == tf.bfloat16
    keep_input_dtypes(passthrough)
    assert not casts_inputs(passthrough) and keeps_input_dtypes(passthrough)
    assert float(passthrough(np.array([[257.0]], "float32"))[0, 0]) == 257.0
    keep_input_dtypes(passthrough, keep=False)
    assert casts_inputs(passthrough) and not keeps_input_dtypes(passthrough)
    model.optimizer.build(model.trainable_variables)
    assert optimizer_trainable_variables(model.optimizer) == list(
        model.trainable_variables
    )
    assert call_has_training_arg(model) in (True, False)
    masked = keras.layers.Masking()(tf.constant([[0.0], [1.0]]))
    assert keras_mask(masked).numpy().tolist() == [False, True]
    symbolic = keras.Input((4,), dtype="int32")
    assert keras_mask(keras.layers.Embedding(5, 3, mask_zero=True)(symbolic)) is not None
    assert is_functional(model)
    assert layer_graph(model) is model
    stack = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    (_, ins, outs), = functional_nodes(layer_graph(stack))
    assert ins[0] is stack.inputs[0] and outs == stack.outputs
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
    counter = keras.Variable(0.0, trainable=False)
    with update_recording_scope([(counter, tf.constant(1.0))]) as scope:
        counter.assign_add(1.0)
        assert float(counter.value) == 2.0
    assert scope.updated == [counter] and float(counter.numpy()) == 0.0
    assert keras_supports_jit(model) is True and jit_blockers(model) == []
    assert issubclass(keras.layers.Layer, keras_saveable_class())
    from keras.src.saving.saving_lib import get_attr_skipset

    assert isinstance(get_attr_skipset(leaf_saveable_class()()._obj_type()), set)
    assert issubclass(keras.optimizers.Optimizer, keras_saveable_class())
    from keras.src.utils.io_utils import print_msg as _print_msg

    assert callable(_print_msg)
    check_multi_worker_trainer()
    check_coordination()
    check_call_context()
    check_collecting_losses()
    check_untracked_state()
    check_compiled_metric_objects()
    check_backend_dropout()
    assert tensorflow_runtime_started()  # (ops ran above)
    assert initial_epoch(model) is None
    set_initial_epoch(model, 2)
    assert model._initial_epoch == 2 and initial_epoch(model) == 2
    set_initial_epoch(model, None)
    return True


class _MultiWorkerExtended:
    def _in_multi_worker_mode(self):
        return True


def check_multi_worker_trainer():
    """Checks the facts `MultiWorkerTrainer` relies on, without a cluster:
    Keras' trainer has the two private methods it overrides (with their
    arguments), its epoch iterator yields tuples ending in the batch
    iterator, it reduces a step's logs across workers for a multi-worker
    MultiWorkerMirroredStrategy only, and does so with
    `strategy.reduce("MEAN", v, axis=0)`, which makes the `(1,)` logs of
    `logs_for_worker_reduce` scalars again."""
    import inspect

    from keras.src.backend.tensorflow import trainer

    build = inspect.signature(trainer.TensorFlowTrainer._maybe_symbolic_build)
    assert list(build.parameters) == ["self", "iterator", "data_batch"], build
    make = inspect.signature(trainer.TensorFlowTrainer._make_function)
    assert list(make.parameters) == ["self", "step_function"], make
    epochs = trainer.TFEpochIterator(
        x=np.zeros((4, 1), "float32"), batch_size=2,
        distribute_strategy=tf.distribute.get_strategy(),
    )
    for item in epochs:  # what `_maybe_symbolic_build` reads its batch from
        assert isinstance(item, tuple) and hasattr(item[-1], "__next__"), item
        break
    assert not reduces_logs_across_workers(tf.distribute.get_strategy())
    # An uninitialised MultiWorkerMirroredStrategy in multi-worker mode,
    # recording how Keras reduces the logs.
    fake = object.__new__(tf.distribute.MultiWorkerMirroredStrategy)
    fake._extended = _MultiWorkerExtended()
    calls = []

    def reduce(op, value, axis):
        calls.append((op, axis))
        return tf.reduce_mean(value, axis=axis)

    fake.reduce = reduce
    assert reduces_logs_across_workers(fake)
    logs = logs_for_worker_reduce(lambda data: {"loss": tf.constant(2.0)})(None)
    assert logs["loss"].shape == (1,)
    reduced = trainer.reduce_per_replica(logs, fake, reduction="auto")
    assert calls == [("MEAN", 0)], calls
    assert reduced["loss"].shape == () and float(reduced["loss"]) == 2.0


