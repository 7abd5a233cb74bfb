"""Block-level activation recompute (gradient checkpointing).

A recomputed block keeps only its inputs from the forward pass. Its backward
runs the block's forward again and differentiates that, in the state the first
forward saw: the same Dropout masks (Keras draws them from seed-generator
variables, read back as they were) and the same BatchNormalization batch
statistics, while moving statistics and seeds are updated once, by the first
forward only. Losses the block's layers add (`add_loss`, activity
regularizers) are outputs of its custom gradient, so they reach its weights.

`recomputed(fn, state)` does this for any function of tensors. Layers are
marked with `mark(layer)`, which puts a dispatcher in front of their `call`:
it recomputes only inside `active(plan)` (GradBoostModel's training forward,
for the blocks its plan chose) and is a plain call everywhere else.

Chosen blocks nest: a chosen block inside a recomputed one runs plain in
the forward (nothing is kept there anyway) and recomputes inside the outer
block's replay, so the outer block's backward holds its activations less
the inner block's, plus the inner block's while its own backward runs.
"""

import contextlib
import functools
import threading

import keras
import tensorflow as tf

from keras_gradboost import kernel_choice
from keras_gradboost import hooks
from keras_gradboost import wrappers
from keras_gradboost.recompute import selective as selective_lib

_LOCAL = threading.local()  # per thread: MirroredStrategy traces replicas in threads


@contextlib.contextmanager
def _handling(handler):
    """Marked layers' calls go through `handler(layer, call, args, kwargs)`
    inside this context; `None` runs them as they are."""
    previous = getattr(_LOCAL, "handler", None)
    _LOCAL.handler = handler
    try:
        yield
    finally:
        _LOCAL.handler = previous


def active(layer_ids, selective=False):
    """Marked layers whose id is in `layer_ids` recompute inside this context
    (selectively: see `recomputed`)."""
    layer_ids = frozenset(layer_ids)

    def handle(layer, call, args, kwargs):
        if id(layer) not in layer_ids:
            return call(*args, **kwargs)
        fn = recomputed(
            call,
            state_variables(layer),
            layer.name,
            layer.trainable_variables,
            selective=selective,
            nested=None if selective else handle,
        )
        return fn(*args, **kwargs)

    return _handling(handle)


def probing(probe, layer_ids):
    """Calls of marked layers in `layer_ids` go through `probe.run(id, ...)`."""
    return probing_together([(probe, layer_ids)], {})


def probing_together(probes, replaced):
    """One trace recording several kinds of plan: a marked layer's call
    runs `replaced[id(layer)](args, kwargs)` when it has an entry (a
    functional layer run as the chain of its segments), else its `call`,
    through each `probe.run(id, ...)` of the `(probe, layer_ids)` pairs
    `probes` whose ids hold it."""
    probes = [(probe, frozenset(ids)) for probe, ids in probes]

    def handle(layer, call, args, kwargs):
        fn = call
        if id(layer) in replaced:
            fn = functools.partial(_run_as_call, replaced[id(layer)])
        for probe, ids in probes:
            if id(layer) in ids:
                fn = functools.partial(probe.run, id(layer), fn)
        return fn(*args, **kwargs)

    return _handling(handle)


def _run_as_call(run, *args, **kwargs):
    """`run(args, kwargs)` called as the `call` it replaces."""
    return run(args, kwargs)


def replacing(layer, run):
    """The marked `layer`'s calls run `run(args, kwargs)` (the arguments of
    its `call`) instead of its `call` inside this context; other marked
    layers run as they are (a functional layer run as a chain of its
    segments, `RecomputeSetup`)."""
    return probing_together([], {id(layer): run})


def _plain():
    """Inside a recomputed block, nested marked blocks run as they are."""
    return _handling(None)


def state_variables(layer):
    """The variables a forward pass reads but does not differentiate:
    seed-generator states, moving statistics, frozen weights, a stateful
    RNN's states (`hooks.untracked_state`), the metrics its layers update
    (a replay's updates are dropped: the forward's count once)."""
    return hooks.forward_state(layer)


def snapshot(variables):
    """`(variable, value now)` pairs for a `keras.StatelessScope`.

    Read without autocasting; `tf.identity` copies each read into the graph
    at this point, so later assignments do not change the values.
    """
    with hooks.autocast(None):
        return [(v, tf.identity(v.value)) for v in variables]


def recomputed(fn, state, name="block", weights=(), selective=False, nested=None):
    """`fn` with the same forward, whose backward recomputes `fn`'s forward.

    Args:
        fn: a function of (nested) tensors and Python values.
        state: Keras variables `fn` may read and update that are not
            differentiated (see `state_variables`); the recompute reads their
            values from before the forward and leaves them untouched.
        name: used in error messages.
        weights: the trainable Keras variables `fn` reads. The recompute
            reads them once, in the forward (references, no copies), and
            each weight's gradient depends on that read: a read ordered
            before the optimizer's update only by a control dependency can
            lose it to grappler's dependency optimizer, and then, under
            load, the update can run first and the gradient flowing to
            earlier layers is computed with the new weights. A replay that
            casts them (a mixed policy) reads a gated copy of that read
            (`_after_weights`), so its casts are not the forward's.
        selective: keep the outputs of the kernel layers `fn` calls (marked
            ones, see `selective`) and recompute only the rest. Defaults to
            `False` (everything is recomputed).
        nested: the handler (see `_handling`) of the marked layers `fn`
            calls during the replay: `active`'s own, so chosen blocks inside
            this one recompute inside its replay. Defaults to `None` (they
            run as they are).

    Returns:
        A function with `fn`'s signature.
    """

    def call(*args, **kwargs):
        if getattr(_LOCAL, "replay", None) is not None:  # inside a replay
            return _recomputed_in_replay(fn, state, name, weights, nested, selective)(
                *args, **kwargs
            )
        flat = tf.nest.flatten((args, kwargs))
        positions = _tensor_positions(flat, name)

        rebuild = _rebuilder(args, kwargs, flat, positions)

        saved = snapshot(state)  # as the forward finds it, before it updates it
        held = snapshot(weights)  # the weights as the forward reads them
        # What the block's layers inherit from their caller (`training`): the
        # replay runs outside any layer call, so it sets the same.
        context = hooks.call_context_values()
        with hooks.autocast(None):  # the tf.Variables behind them, as read
            by_variable = {id(v.value): t for v, t in held}
        dtype = hooks.current_autocast()
        structure = []
        casting = []  # whether the forward cast a weight (autocast)
        kept = selective_lib.Kept(name) if selective else None
        native = kernel_choice.current()  # the replay runs the kernels the forward ran

        @tf.custom_gradient
        def forward(*tensors):
            a, k = rebuild(tensors)
            inside = _handling(kept.capture()) if kept else _plain()
            made = _operations_made()
            with hooks.stop_recording(), inside, hooks.collecting_losses() as losses:
                outputs = fn(*a, **k)
            operations = made()
            _refuse_unseeded_random(operations, name)
            structure.append((outputs, losses))
            casting.append(_casts_weights(operations))

            def grad(*upstream, variables=None):
                variables = list(variables or ())
                arrived = reached.take(upstream)
                if not arrived:  # no output reaches the loss: no gradients
                    return [None] * len(tensors), [None] * len(variables)
                first = [arrived[0][1]]
                inputs = _after(first, tensors)
                replay = kept.replay(_after(first, kept.tensors)) if kept else None
                with tf.GradientTape() as tape:
                    tape.watch([t for t in inputs if t.dtype.is_floating])
                    tape.watch([t for _, t in held])
                    a, k = rebuild(inputs)
                    with hooks.update_recording_scope(
                        _after_state(first, saved)
                        + (_after_weights(first, held) if casting[0] else held)
                    ) as scope, hooks.autocast(dtype), kernel_choice.running(native), (
                        _handling(replay) if kept else _handling(nested)
                    ), _replaying(scope, [id(v) for v, _ in held]), hooks.call_context(
                        context
                    ), hooks.collecting_losses() as losses_again:
                        again = fn(*a, **k)
                if kept:
                    kept.check_replayed(replay)
                _refuse_unsaved_updates(scope.updated, saved, name)
                # A weight's gradient is its held value's; a variable read
                # outside `weights` is differentiated as it is.
                sources = [by_variable.get(id(v), v) for v in variables]
                with _differentiating_replay():
                    grads = _differentiate(
                        tape, _replayed(again, losses_again, structure[0], name),
                        list(inputs) + sources,
                        arrived, len(upstream), name,
                    )
                weight_grads = [
                    _tied(g, source) if source is not v else g
                    for g, source, v in zip(grads[len(inputs) :], sources, variables)
                ]
                return grads[: len(inputs)], weight_grads

            return _with_losses(outputs, losses), grad

        reached = _Reached()
        flat_outputs = reached.marked(forward(*[flat[i] for i in positions]))
        return _add_back(structure[0], flat_outputs)

    return call


@contextlib.contextmanager
def _replaying(scope, weight_ids):
    """Marks a replay: `recomputed` blocks called inside it (nested chosen
    blocks) take `_recomputed_in_replay`, which reads the variables from
    `scope` as the replay does; `weight_ids` are the ids of the weights
    `scope` holds as tensors (this replay's and its outer replays')."""
    previous = getattr(_LOCAL, "replay", None)
    _LOCAL.replay = (scope, frozenset(weight_ids))
    try:
        yield
    finally:
        _LOCAL.replay = previous


@contextlib.contextmanager
def _differentiating_replay():
    """Around a replay's `tape.gradient`: the graph's operations made so far
    (the replay's forward among them) come before its backward, and a
    nested block's gradient, called inside, tells which of its readers
    belong to the backward by their position (`_read_by_backward`)."""
    graph = tf.compat.v1.get_default_graph()
    previous = getattr(_LOCAL, "backward_from", None)
    _LOCAL.backward_from = (graph, len(graph.get_operations()))
    try:
        yield
    finally:
        _LOCAL.backward_from = previous


def _read_by_backward(tensors):
    """Whether the backward made so far reads `tensors` (a nested block's
    outputs in the outer replay), directly or through the replay's forward:
    only then does that forward run at all (a block at the end of its outer
    block, followed by a residual add, needs none of its values there; its
    own replay rebuilds them). True where it cannot tell (eagerly, outside
    a replay's gradient), and where a reader is a partial gradient that
    TensorFlow prunes later: then that forward runs for nothing (compute,
    not memory or values)."""
    found = getattr(_LOCAL, "backward_from", None)
    graph = tf.compat.v1.get_default_graph()
    if found is None or found[0] is not graph or tf.executing_eagerly():
        return True
    backward = set(graph.get_operations()[found[1] :])
    seen, pending = set(), list(tensors)
    while pending:
        for op in pending.pop().consumers():
            if op in seen:
                continue
            seen.add(op)
            if op in backward:
                return True
            pending.extend(op.outputs)
    return False


def _recomputed_in_replay(fn, state, name, weights, nested, selective=False):
    """`recomputed` for a block called inside another block's replay.

    There every variable the outer block reads is a tensor of the outer
    replay's scope (the values the forward saw), and a `tf.custom_gradient`
    differentiates only its inputs and the variables it reads: the block's
    weights are passed in as inputs, and its gradient returns theirs. Its
    state is read from the outer scope here (as the forward saw it at this
    point), and what it updates goes back to that scope. Reading a weight
    of another layer of the outer block would lose that weight's gradient:
    refused. A selective block (a `Recompute(policy="selective")` inside a
    fully recomputed one) keeps its kernel layers' outputs from this run,
    as at the top.
    """

    def call(*args, **kwargs):
        outer, outer_weights = _LOCAL.replay
        flat = tf.nest.flatten((args, kwargs))
        positions = _tensor_positions(flat, name)
        count = len(positions)

        rebuild = _rebuilder(args, kwargs, flat, positions)

        here = hooks.scope_values(outer)  # (variable, value) as the replay has them now
        own = {id(v) for v in weights}
        others = [(v, t) for v, t in here if id(v) not in own]
        with hooks.autocast(None):
            weight_values = [tf.convert_to_tensor(v.value) for v in weights]
        saved = snapshot(state)  # as the forward saw it here
        context = hooks.call_context_values()  # the outer replay's, as here
        dtype = hooks.current_autocast()
        native = kernel_choice.current()
        structure = []
        kept = selective_lib.Kept(name) if selective else None

        def scope(weight_tensors, state_values):
            return hooks.update_recording_scope(
                others + state_values + list(zip(weights, weight_tensors))
            )

        @tf.custom_gradient
        def forward(*tensors):
            a, k = rebuild(tensors[:count])
            inside = _handling(kept.capture()) if kept else _plain()
            with hooks.stop_recording(), scope(tensors[count:], saved) as inner, inside, (
                _replaying(inner, outer_weights | own)  # a `Recompute` in it reads this scope
            ), hooks.collecting_losses() as losses:
                outputs = fn(*a, **k)
            _refuse_foreign_weights(inner.read & (outer_weights - own), here, name)
            for variable in inner.updated:  # the outer replay reads them after
                outer.add_update((variable, hooks.scope_value(inner, variable)))
            structure.append((outputs, losses))

            def grad(*upstream, variables=None):
                variables = list(variables or ())
                arrived = reached.take(upstream)
                if not arrived:  # no output reaches the loss: no gradients
                    return [None] * len(tensors), [None] * len(variables)
                # In the outer replay the upstream gradient can arrive before
                # this block's forward there has finished: where that forward
                # runs, the replay waits for its outputs too, or both run at
                # once and their activations are alive together.
                gates = [arrived[0][1]]
                produced = _tensors(outputs)
                if _read_by_backward(produced):
                    gates += produced
                if kept:  # its replay reads them: that forward runs anyway
                    gates += kept.tensors
                inputs = _after(gates, tensors[:count]) + list(tensors[count:])
                substitute = kept.replay(_after(gates, kept.tensors)) if kept else None
                with tf.GradientTape() as tape:
                    tape.watch([t for t in inputs if t.dtype.is_floating])
                    a, k = rebuild(inputs[:count])
                    with scope(inputs[count:], _after_state(gates, saved)) as replay, (
                        hooks.autocast(dtype)
                    ), kernel_choice.running(native), _handling(
                        substitute if kept else nested
                    ), _replaying(replay, outer_weights | own), hooks.call_context(
                        context
                    ), hooks.collecting_losses() as losses_again:
                        again = fn(*a, **k)
                if kept:
                    kept.check_replayed(substitute)
                _refuse_unsaved_updates(replay.updated, others + saved, name)
                with _differentiating_replay():
                    grads = _differentiate(
                        tape, _replayed(again, losses_again, structure[0], name),
                        inputs + variables,
                        arrived, len(upstream), name,
                    )
                return grads[: len(inputs)], grads[len(inputs) :]

            return _with_losses(outputs, losses), grad

        reached = _Reached()
        flat_outputs = reached.marked(forward(*[flat[i] for i in positions], *weight_values))
        return _add_back(structure[0], flat_outputs)

    return call


def _with_losses(outputs, losses):
    """A block call's flat outputs, then the losses its layers added
    (`hooks.collecting_losses`): the custom gradient returns both, so a
    loss made inside the block (an activity regularizer, a mixture of
    experts' load-balancing loss) is differentiated through the replay
    like an output, instead of reaching none of the block's weights. An
    output that is None (keras-hub's T5 attention returns its cache as
    None) is left out, and `_add_back` puts it back."""
    given = [t for t in tf.nest.flatten(outputs) if t is not None]
    return given + [loss for _, loss in losses]


def _replayed(again, losses_again, recorded, name):
    """A replay's outputs and losses as `_with_losses` gives them, where
    it returned None at the places its forward did (`recorded`: the
    forward's `(outputs, losses)`); else the gradients would meet other
    outputs than the forward's.

    Raises:
        RuntimeError: the Nones are elsewhere, or the outputs another structure.
    """
    nones = [[t is None for t in tf.nest.flatten(o)] for o in (recorded[0], again)]
    if nones[0] != nones[1]:
        raise RuntimeError(
            f"Recompute of block {name!r}: its replay returned None at other "
            "places than its forward, or another structure of outputs. The "
            "block's call must return the same structure both times; leave it "
            "out of `recompute`."
        )
    return _with_losses(again, losses_again)


def _add_back(recorded, flat_outputs):
    """The block's outputs, packed as its forward returned them, after
    adding the losses its layers added (`recorded`: `(outputs, losses)`)
    back to those layers, as the custom gradient returns them (connected
    to the block's inputs and weights)."""
    outputs, losses = recorded
    leaves = tf.nest.flatten(outputs)
    count = sum(t is not None for t in leaves)
    for (layer, _), loss in zip(losses, flat_outputs[count:]):
        # Keras' own `add_loss`: a class's override of it ran already, in
        # the forward, on the loss as it was recorded.
        keras.layers.Layer.add_loss(layer, loss)
    given = iter(flat_outputs[:count])
    return tf.nest.pack_sequence_as(
        outputs, [None if t is None else next(given) for t in leaves]
    )


def _operations_made():
    """A function returning the graph operations made since this call (none
    eagerly)."""
    if tf.executing_eagerly():
        return list
    graph = tf.compat.v1.get_default_graph()
    start = len(graph.get_operations())
    return lambda: graph.get_operations()[start:]


def _unseeded_random(op):
    """Whether `op` draws from a random state of TensorFlow's that the
    recompute cannot put back: the stateful random ops (`tf.random.uniform`
    without a Keras seed generator, `tf.random.Generator`'s), not the
    stateless ones Keras' `keras.random` runs from its seed variables."""
    kind = op.type
    if kind.startswith("Stateless") or kind == "StatefulPartitionedCall":
        return False
    return (
        "Random" in kind
        or kind.startswith("Stateful")
        or kind.endswith("CandidateSampler")
        or kind.startswith(("SampleDistortedBoundingBox", "Fractional"))
        or kind in (
            "TruncatedNormal", "ParameterizedTruncatedNormal", "Multinomial",
            "RngReadAndSkip", "RngSkip",
        )
    )


def _refuse_unseeded_random(operations, name):
    """Raises if a block's forward drew random numbers from a state the
    replay cannot put back: the replay would draw others, and the block's
    gradients would be those of another forward, silently. Sees the
    operations of the block's own graph: not those inside a function it
    calls (`tf.function`, `tf.cond`/`tf.while_loop` bodies), nor eager
    ones (`run_eagerly=True`); `recompute_check=True` compares gradients.

    Raises:
        ValueError: naming the block, the operation and the fix.
    """
    found = next((op for op in operations if _unseeded_random(op)), None)
    if found is None:
        return
    raise ValueError(
        f"Cannot recompute block {name!r} exactly: its forward draws random "
        f"numbers with TensorFlow's stateful operation {found.type} "
        f"({found.name!r}), which draws other numbers when the backward runs "
        "the forward again, so its gradients would be those of another "
        "forward. Draw them with `keras.random` and a "
        "`keras.random.SeedGenerator` of the layer (as Keras' Dropout does), "
        'or leave the block out: recompute=["name", ...] without it.'
    )


def _refuse_foreign_weights(read, here, name):
    """Raises if a block recomputed inside another's replay read a weight
    of the outer block that is not its own: that read is a tensor of the
    outer replay, and its gradient would be silently lost.

    Raises:
        ValueError: naming the weights and the fix.
    """
    if not read:
        return
    paths = ", ".join(repr(getattr(v, "path", v.name)) for v, _ in here if id(v) in read)
    raise ValueError(
        f"Cannot recompute block {name!r} inside the recompute of the block "
        f"that holds it: it reads the weight(s) {paths}, which belong to "
        "another layer of the outer block (tied weights), and their gradient "
        "through it would be lost. Recompute the outer block or the inner "
        "one, not both."
    )


def _rebuilder(args, kwargs, flat, positions):
    """A function putting new tensors at `positions` of a call's flattened
    arguments (`_tensor_positions`); returns `(args, kwargs)`."""

    def rebuild(tensors):
        values = list(flat)
        for i, tensor in zip(positions, tensors):
            values[i] = tensor
        return tf.nest.pack_sequence_as((args, kwargs), values)

    return rebuild


def _refuse_unsaved_updates(updated, saved, name):
    """Raises if the recompute updated a variable whose value before the
    forward was not saved: it read the forward's update instead (a Dropout
    seed drawn anew, a counter), so its gradients would be silently wrong.

    Raises:
        ValueError: naming the variables and the fix.
    """
    known = {id(v) for v, _ in saved}
    unsaved = list({id(v): v for v in updated if id(v) not in known}.values())
    if unsaved:
        paths = ", ".join(repr(getattr(v, "path", v.name)) for v in unsaved[:3])
        more = f" and {len(unsaved) - 3} more" if len(unsaved) > 3 else ""
        raise ValueError(
            f"Cannot recompute block {name!r} exactly: it updates the "
            f"variable(s) {paths}{more}, which belong to no layer given to "
            "the recompute, so the recompute would read them after the "
            "forward's update (a Dropout mask drawn anew, a BatchNormalization "
            "statistic updated twice) and its gradients would be wrong. Pass "
            "the layers the block calls to `kgb.recompute_function(fn, "
            "layers=[...])`, or give a custom layer its own "
            "`keras.random.SeedGenerator` instead of the global one."
        )


def _tensor_positions(flat, name):
    """The indices of the dense tensors among a call's flattened arguments.

    Raises:
        TypeError: an argument is a float ragged or sparse tensor, whose
            gradient the recompute would lose.
    """
    positions = []
    for i, value in enumerate(flat):
        if isinstance(value, tf.Tensor):
            positions.append(i)
        elif (
            isinstance(value, (tf.RaggedTensor, tf.SparseTensor))
            and value.dtype.is_floating
        ):
            raise TypeError(
                f"Cannot recompute block {name!r}: it takes a float "
                f"{type(value).__name__}, whose gradient the recompute "
                "would lose. Recompute a block with dense inputs instead."
            )
    return positions


class _Reached:
    """Which outputs of one recomputed block call a gradient reaches, as the
    tape itself finds them.

    Each float output passes through an identity whose gradient marks it.
    The tape calls a gradient function only on a path from the loss (an
    output nothing reads, or one behind `stop_gradient`, is on none), and
    calls the marks' before the block's own, which takes them. A zero that
    does reach it (an output read only through `tf.sign`, a loss weight of
    0) is a gradient, as without recompute.
    """

    def __init__(self):
        self.marks = []

    def marked(self, outputs):
        """`outputs` (a flat list), each float one behind its mark."""
        self.marks = [False] * len(outputs)
        return [self._mark(t, i) for i, t in enumerate(outputs)]

    def _mark(self, tensor, index):
        if not (isinstance(tensor, tf.Tensor) and tensor.dtype.is_floating):
            return tensor

        @tf.custom_gradient
        def mark(t):
            def grad(upstream):
                self.marks[index] = True
                return upstream

            return tf.identity(t), grad

        return mark(tensor)

    def take(self, upstream):
        """`(index, upstream gradient)` of the outputs reached since the
        last take (the marks are cleared: a second differentiation of the
        same forward marks again)."""
        arrived = [(i, u) for i, u in enumerate(upstream) if self.marks[i]]
        self.marks = [False] * len(self.marks)
        return arrived


def _differentiate(tape, outputs, sources, arrived, expected, name):
    """The gradients of a replay's `outputs` with respect to `sources`,
    from the outputs a gradient reached (`arrived`, from `_Reached.take`).

    TensorFlow's tape passes zeros for an output no gradient reached (a
    backbone's pooled output the head does not read). Differentiated with
    them, the weights only that output depends on would get zero gradients
    where the run without recompute gives them none (`None`): the optimizer
    would then apply an update it skips without recompute (AdamW's weight
    decay, a momentum step). Left out, they stay `None`; the values are the
    same (those outputs contribute zero).

    Raises:
        RuntimeError: the replay returned another number of tensors than
            the forward (`expected`).
    """
    if len(outputs) != expected:
        raise RuntimeError(
            f"Recompute of block {name!r}: its replay returned {len(outputs)} "
            f"tensors, its forward {expected} (its outputs, then the losses its "
            "layers add with `add_loss`). The block's call must return the same "
            "structure and add the same losses both times; leave it out of "
            "`recompute`."
        )
    return tape.gradient(
        [outputs[i] for i, _ in arrived], sources, output_gradients=[u for _, u in arrived]
    )


def _after(gates, tensors):
    """`tensors`, made to depend on the arrival of the `gates` tensors (the
    upstream gradient; in an outer replay also the block's forward outputs).

    Without the dependency, graph optimisers (and XLA, which ignores control
    dependencies) may run the recompute early or merge it with the forward,
    which keeps the activations alive. The same trick as `tf.recompute_grad`:
    a zero that XLA cannot prove is zero. Integers too: a replay's Dropout
    seed read as the forward's own gives random numbers XLA's
    common-subexpression pass merges with the forward's, and the masks (and
    what they gate) are then kept from the forward.
    """
    firsts = [tf.cast(tf.reshape(g, [-1])[:1], tf.float32) for g in gates]
    flag = tf.cast(tf.reduce_max(tf.concat(firsts, 0)), tf.bool)
    zero = tf.where(tf.equal(flag, flag), 0.0, float("nan"))
    # Minus zero: `-0.0 - 0.0` is -0.0 (plus would give +0.0).
    return [
        t - tf.cast(zero, t.dtype)
        if t.dtype.is_floating or t.dtype.is_integer
        else tf.identity(t)
        for t in tensors
    ]


def _casts_weights(operations):
    """Whether `operations` (a block's forward) cast a variable's value to
    another dtype (its layers autocast under a mixed policy)."""
    return any(
        op.type == "Cast" and op.inputs and op.inputs[0].op.type == "ReadVariableOp"
        for op in operations
    )


def _after_weights(gates, held):
    """The held weights (`snapshot`), those of float dtype made to depend
    on the arrival of `gates` (`_after`), for a replay that casts them.

    Its layers cast each weight again. Cast from the held read itself,
    that cast is the same computation as the forward's, and the graph
    optimiser merges the two: every recomputed block's casted weights
    lived from the forward to its replay, on top of the replay's own (8
    Dense(1024) layers under mixed_bfloat16 requested 28.2 MiB with
    recompute, 22.3 without). Gated, the cast waits for the replay: a
    copy of the block's weights and its cast while it replays (16.2 MiB)."""
    floats = [i for i, (_, t) in enumerate(held) if t.dtype.is_floating]
    gated = dict(zip(floats, _after(gates, [held[i][1] for i in floats])))
    return [(v, gated.get(i, t)) for i, (v, t) in enumerate(held)]


def _after_state(gates, saved):
    """The saved state (`snapshot`), its values made to depend on the
    arrival of `gates` (`_after`)."""
    return list(zip([v for v, _ in saved], _after(gates, [t for _, t in saved])))


def _tensors(structure):
    """The numeric tensors in a nested structure (a block's outputs)."""
    return [
        t for t in tf.nest.flatten(structure)
        if isinstance(t, tf.Tensor) and (t.dtype.is_floating or t.dtype.is_integer)
    ]


def _tied(gradient, value):
    """`gradient`, made to depend on `value` (a read of the weight it is the
    gradient of): the optimizer's update of that weight then waits for the
    read by a data dependency, which no graph rewrite drops. Same trick as
    `_after`."""
    if gradient is None or not isinstance(gradient, tf.Tensor):
        return gradient
    first = tf.reduce_max(tf.reshape(value, [-1])[:1])
    zero = tf.where(tf.equal(first, first), 0.0, float("nan"))
    return gradient + tf.cast(zero, gradient.dtype)


class _Dispatch:
    """A marked layer's `call` wrapper (see `wrappers.patch`): recomputes
    when chosen, and calls what is below it (the layer's own `call`)
    everywhere else."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, original, *args, **kwargs):
        handler = getattr(_LOCAL, "handler", None)
        if handler is None:
            return original(*args, **kwargs)
        # The handler reaches marked layers nested in this one too: a
        # recomputed block's forward runs them plain (`recomputed`), a
        # block that is not chosen passes them on.
        return handler(self.layer, original, args, kwargs)


def mark(layer):
    """Lets `layer` recompute when a plan chooses it (idempotent).

    Returns:
        The `wrappers.patch` of the layer's `call` (call it to unmark).
    """
    for p in wrappers.patches(layer, "call"):
        if isinstance(p.around, _Dispatch):
            return p
    return wrappers.patch(layer, "call", _Dispatch(layer))


def is_marked(layer):
    return any(
        isinstance(p.around, _Dispatch) for p in wrappers.patches(layer, "call")
    )
