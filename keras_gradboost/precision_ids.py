"""Token ids under a mixed precision policy: ids carried in a float input
reach `Embedding` and the other index layers exactly as given where a
functional or Sequential graph shows the way, and ids a layer casts to
float16/bfloat16 elsewhere are refused with a `ValueError` (see
`precision.apply_policy`, which calls this module)."""

import keras
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost import wrappers

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
_HALF = ("float16", "bfloat16")
# Every integer up to this is exact in the dtype (256 + 1 is not, in bfloat16).
_EXACT_UP_TO = {"bfloat16": 256, "float16": 2048}
# On an index layer (or a nested model) under a mixed policy: the
# `wrappers.patch` of its `call` that refuses ids cast to a half dtype.
_ID_CHECK = "_keras_gradboost_id_check"


def index_input_layers(model):
    """The layers of `model` that pass ids on their way to an `INDEX_LAYERS`
    layer, and would cast them under a mixed policy: `apply_policy` has them
    pass their inputs on uncast.

    A layer casts its float inputs to its compute dtype in `__call__`
    (Keras' `Layer.__call__`; an `Embedding` itself does not, nor do a
    Functional model or the preprocessing layers). Only layers whose data
    flow shows that their float input is ids are kept from casting:
    - in a functional graph (or a Sequential), the layers without weights
      between a float input and an index layer, a model that converts its
      inputs itself, or a holder kept below (`Reshape`, `Lambda`,
      `Concatenate`, ...). A layer with weights computes: its inputs are
      activations, not ids.
    - a layer that holds an index layer (a custom token-and-position
      embedding, keras_hub's `TokenAndPositionEmbedding`, a nested
      Sequential), is a node of such a graph, and receives there exactly one
      tensor, a float one, when that input does reach an index layer inside
      it, uncast: a trial trace of the holder on a float32 input, with it and
      its sub-layers without weights passing their inputs uncast, must go
      through and deliver the input to an index layer as float32. The
      sub-layers without weights are kept along with it.

    Any other holder (a subclassed model, `boost()`'s wrapper of one, a layer
    with several inputs, a layer whose float input is features) keeps
    casting as in plain Keras: its float inputs may be features mixed with
    the ids' embeddings in raw ops, which then need the compute dtype. Ids
    it casts reach the index layer as float16/bfloat16, which `apply_policy`
    refuses with a `ValueError` when the layer is called.

    Returns:
        The layers, each once, that cast a float input to float16 or
        bfloat16 now.
    """
    return trace_ids(model)[0]


def trace_ids(model):
    """`(layers to keep uncast, [(nested model, its Inputs that carry
    ids)])`; see `index_input_layers`."""
    holders = _holders(model)
    graphs = [
        l
        for l in hooks.flatten_layers(model, include_self=True)
        if hooks.is_functional(l) or isinstance(l, keras.Sequential)
    ]
    kept = {}  # id(holder) -> [holder, its sub-layers without weights]
    for holder, spec in _one_float_input_holders(graphs, holders):
        inner = _inner_layers(holder, holders)
        if _ids_pass_uncast(holder, inner, spec):
            kept[id(holder)] = [holder, *inner]
    targets = {
        id(l): True
        for l in hooks.flatten_layers(model, include_self=True)
        if holders.get(id(l))
        and (isinstance(l, INDEX_LAYERS) or not _casts_to_half(l) or id(l) in kept)
    }
    found = [layer for group in kept.values() for layer in group]
    entries = []
    for graph in graphs:
        reached = []
        if hooks.is_functional(graph):
            found.extend(_graph_path(hooks.functional_nodes(graph), targets, reached))
        else:
            leads_back = []
            found.extend(_sequential_path(graph.layers, targets, leads_back))
            reached = _sequential_inputs(graph) if leads_back else []
        if reached and graph is not model:
            entries.append((graph, reached))
    unique = {id(layer): layer for layer in found}
    return [layer for layer in unique.values() if _casts_to_half(layer)], entries


def _holders(model):
    """`{id(layer): whether it is or holds an INDEX_LAYERS layer}`."""
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
    return holders


def _one_float_input_holders(graphs, holders):
    """The holders (not index layers) that cast their inputs to a half
    dtype and, in every call of theirs in `graphs`, receive exactly one
    tensor, a float one: `(holder, that input's KerasTensor)`."""
    calls = {}
    for graph in graphs:
        if hooks.is_functional(graph):
            nodes = [(layer, ins) for layer, ins, _ in hooks.functional_nodes(graph)]
        else:
            nodes = [(layer, _sequential_input(layer)) for layer in graph.layers]
        for layer, ins in nodes:
            calls.setdefault(id(layer), (layer, []))[1].append(ins)
    for layer, inputs in calls.values():
        if (
            holders.get(id(layer))
            and not isinstance(layer, INDEX_LAYERS)
            and _casts_to_half(layer)
            and all(
                len(ins) == 1 and keras.backend.is_float_dtype(ins[0].dtype)
                for ins in inputs
            )
        ):
            yield layer, inputs[0][0]


def _sequential_inputs(model):
    """A built Sequential's `inputs` (empty when it has no known input)."""
    try:
        return list(model.inputs)
    except (AttributeError, ValueError):
        return []


def _sequential_input(layer):
    """What `layer` of a built Sequential receives: its `input`, flat (empty
    when not known)."""
    try:
        return keras.tree.flatten(layer.input)
    except (AttributeError, ValueError):
        return []


def _inner_layers(holder, holders):
    """The layers inside `holder` that the ids may pass on their way to its
    index layers: in a Sequential, those just before one (`_sequential_path`);
    in a custom layer (whose data flow is not known), the sub-layers without
    weights."""
    if isinstance(holder, keras.Sequential):
        return _sequential_path(holder.layers, holders)
    inner = []
    for child in hooks.child_layers(holder):
        if not child.weights:
            inner.extend(hooks.flatten_layers(child, include_self=True))
    return inner


def _ids_pass_uncast(holder, inner, spec):
    """Whether a float32 input given to `holder` reaches an index layer
    inside it, and only as float32, with `holder` and `inner` passing their
    inputs uncast: a trace of one call (a `tf.function` never run, in a
    `keras.StatelessScope`: no variable or loss changes) that must go
    through. A float input that does not reach an index layer is features,
    left to Keras' casting."""
    source = []
    reached = []  # the dtypes of the index layers' inputs that come from it

    def spy(call, *args, **kwargs):
        if source and args and not _reverse(args, kwargs):
            for tensor in keras.tree.flatten(args[0]):
                if _depends_on(tensor, source[0]):
                    reached.append(keras.backend.standardize_dtype(tensor.dtype))
        return call(*args, **kwargs)

    def trial(x):
        source.append(x)
        with keras.StatelessScope():
            holder(x)

    spies = [
        wrappers.patch(layer, "call", spy)
        for layer in hooks.flatten_layers(holder, include_self=False)
        if isinstance(layer, INDEX_LAYERS)
    ]
    newly = [l for l in [holder, *inner] if not hooks.keeps_input_dtypes(l)]
    for layer in newly:
        hooks.keep_input_dtypes(layer)
    try:
        tf.function(trial, autograph=False).get_concrete_function(
            tf.TensorSpec(spec.shape, "float32")
        )
    except Exception:  # noqa: BLE001 - keeping it would break it: leave it to Keras
        return False
    finally:
        for undo in spies:
            undo()
        for layer in newly:
            hooks.keep_input_dtypes(layer, keep=False)
    return bool(reached) and not any(dtype in _HALF for dtype in reached)


def _depends_on(tensor, source):
    """Whether graph tensor `tensor` is computed from graph tensor `source`."""
    if getattr(tensor, "graph", None) is not getattr(source, "graph", ()):
        return False
    stack, seen = [tensor.op], set()
    while stack:
        op = stack.pop()
        if op is source.op:
            return True
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
    return False


def _reverse(args, kwargs):
    """Whether an `Embedding.call` is a `ReversibleEmbedding`'s reverse one
    (`reverse=True`: activations to logits, not a lookup)."""
    reverse = kwargs.get("reverse", args[1] if len(args) > 1 else False)
    return not (reverse is False or reverse is None)


def _graph_path(nodes, targets, reached=None):
    """The weightless layers of a functional graph through which a float
    tensor reaches a layer in `targets` (see `index_input_layers`). The
    graph's inputs so reached are appended to `reached`."""
    produced = {id(t): (layer, ins) for layer, ins, outs in nodes for t in outs}
    stack = [t for layer, ins, _ in nodes if targets.get(id(layer)) for t in ins]
    found, seen = [], set()
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen or not keras.backend.is_float_dtype(tensor.dtype):
            continue
        seen.add(id(tensor))
        if id(tensor) not in produced:  # a model input
            if reached is not None:
                reached.append(tensor)
            continue
        layer, ins = produced[id(tensor)]
        if isinstance(layer, keras.layers.Layer):
            if layer.weights:
                continue
            found.append(layer)
        stack.extend(ins)  # a plain op (slicing, cast) casts nothing
    return found


def _sequential_path(layers, targets, reached=None):
    """The weightless layers of a Sequential just before a layer in
    `targets`. When they lead back to the Sequential's input, True is
    appended to `reached`."""
    found = []
    for i, layer in enumerate(layers):
        if targets.get(id(layer)):
            j = i - 1
            while j >= 0 and not layers[j].weights:
                found.append(layers[j])
                j -= 1
            if j < 0 and reached is not None and not reached:
                reached.append(True)
    return found


def _casts_to_half(layer):
    return (
        layer.autocast
        and hooks.casts_inputs(layer)
        and layer.input_dtype in _HALF
    )


def _parents(model):
    """`{id(layer): the layers that hold it}`."""
    parents = {}
    for layer in hooks.flatten_layers(model, include_self=True):
        for child in hooks.child_layers(layer):
            parents.setdefault(id(child), []).append(layer)
    return parents


def _casting_holder(layer, parents):
    """The nearest layer around `layer` that casts its inputs to a half
    dtype (the one that cast the ids), or None."""
    stack, seen = list(parents.get(id(layer), [])), set()
    while stack:
        holder = stack.pop(0)
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        if _casts_to_half(holder):
            return holder
        stack.extend(parents.get(id(holder), []))
    return None


class _IdCheck:
    """The `call` wrapper (`wrappers.patch`) of an index layer, or of a
    nested model whose float32 Inputs carry ids, under a mixed policy:
    refuses ids that arrive in float16 or bfloat16 or, seen while traced
    (`fit`, `evaluate`, `predict`, any `tf.function`), that went through
    one of them on the way and were cast back.

    Args:
        layer: the layer whose `call` is wrapped.
        policy: the mixed policy applied (for the message).
        holder: the layer around it that casts its inputs, or None.
        inputs: for a nested model, the indices in `layer.inputs` of the
            Inputs that carry ids. Defaults to `None`: the first argument of
            `call` (an index layer).
    """

    def __init__(self, layer, policy, holder, inputs=None):
        self.layer = layer
        self.policy = policy
        self.holder = holder
        self.inputs = inputs

    def __call__(self, call, *args, **kwargs):
        given = args[0] if args else kwargs.get("inputs")
        name = None
        if self.inputs is None:
            ids = [] if _reverse(args, kwargs) else keras.tree.flatten(given)
        else:
            flat = _model_inputs(self.layer, given)
            ids = [] if flat is None else [flat[i] for i in self.inputs]
            if flat is not None:
                name = self.layer.inputs[self.inputs[0]].name
        for tensor in ids:
            dtype = getattr(tensor, "dtype", None)
            if dtype is None or not keras.backend.is_float_dtype(dtype):
                continue
            dtype = keras.backend.standardize_dtype(dtype)
            through = dtype if dtype in _HALF else _half_on_the_way(tensor)
            if through is not None:
                raise ValueError(self.message(dtype, through, name))
        return call(*args, **kwargs)

    def message(self, dtype, through, name=None):
        """The error for ids that arrived as `dtype`, having been `through`
        (a half dtype: `dtype` itself, or one they were cast back from)."""
        layer = f"{type(self.layer).__name__} {self.layer.name!r}"
        arrived = dtype if dtype == through else f"{dtype}, cast back from {through}"
        if self.inputs is None:
            what = f"{layer} reads its input as indices (ids), and received it as {arrived}"
        else:
            reads = ", ".join(
                f"{type(l).__name__} {l.name!r}"
                for l in hooks.flatten_layers(self.layer, include_self=False)
                if isinstance(l, INDEX_LAYERS)
            )
            what = (
                f"{layer} received its Input {name!r}, which carries ids to "
                f"{reads}, as {arrived}"
            )
        if self.holder is not None:
            where = (
                f"in {type(self.holder).__name__} {self.holder.name!r}, the "
                "layer that holds it, which casts its float inputs to its "
                "compute dtype"
            )
        else:
            where = "in a layer or op before it"
        return (
            f"{what}: the {self.policy} precision policy cast the ids to "
            f"{through} on the way, {where}. {through} holds integers exactly "
            f"only up to {_EXACT_UP_TO[through]}: larger ids would read the "
            "wrong rows. keras_gradboost passes float ids on uncast only "
            "through functional and Sequential graphs, and into a layer "
            "there whose only input they are; a subclassed model or a layer "
            "with several inputs casts them, as in plain Keras, since its "
            "other float inputs may need the compute dtype. Feed the ids as "
            'integers (`keras.Input(..., dtype="int32")`, or an int32 '
            'tensor), or compile with precision="float32" (or precision=None '
            "on a model built in float32)."
        )


def _half_on_the_way(tensor):
    """The half dtype that a traced float tensor's values went through (it,
    or a float tensor it is computed from), or None. Eager tensors keep no
    history: None."""
    if not tf.is_symbolic_tensor(tensor):
        return None
    stack, seen = [tensor], set()
    while stack:
        t = stack.pop()
        if t.ref() in seen or not t.dtype.is_floating:
            continue
        seen.add(t.ref())
        dtype = keras.backend.standardize_dtype(t.dtype)
        if dtype in _HALF:
            return dtype
        stack.extend(t.op.inputs)
    return None


def _model_inputs(model, given):
    """`given` (what a model's `call` received) as a flat list in the order
    of `model.inputs`, or None when that is not clear."""
    expected = model.inputs
    if isinstance(given, dict) and all(t.name in given for t in expected):
        return [given[t.name] for t in expected]
    flat = keras.tree.flatten(given)
    return flat if len(flat) == len(expected) else None


def install_id_checks(model, policy, entries):
    """Wraps the `call` of every index layer of `model`, and of the nested
    models in `entries`, in an `_IdCheck` (see `apply_policy`)."""
    parents = _parents(model)
    checks = [
        (layer, _IdCheck(layer, policy, _casting_holder(layer, parents)))
        for layer in hooks.flatten_layers(model, include_self=True)
        if isinstance(layer, INDEX_LAYERS)
    ]
    for graph, reached in entries:
        ids = {id(t) for t in reached}
        positions = [
            i
            for i, t in enumerate(graph.inputs)
            if id(t) in ids and keras.backend.standardize_dtype(t.dtype) not in _HALF
        ]
        if positions:
            checks.append(
                (graph, _IdCheck(graph, policy, _casting_holder(graph, parents), positions))
            )
    for layer, check in checks:
        setattr(layer, _ID_CHECK, wrappers.patch(layer, "call", check))


def remove_id_check(layer):
    undo = getattr(layer, _ID_CHECK, None)
    if undo is not None:
        undo()
        delattr(layer, _ID_CHECK)
