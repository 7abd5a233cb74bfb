"""Choosing what to recompute: blocks by name or pattern, or "auto".

Two kinds of block:

* a layer that holds layers (a residual block, a transformer encoder layer, a
  sub-model), recomputed by putting `mechanism.recomputed` in front of its
  `call`;
* for a functional model without such layers, a segment of its layer graph
  between two single-tensor cut points (Chen et al., 2016, "Training Deep Nets
  with Sublinear Memory Cost"), recomputed by running the model as a chain of
  segments; likewise a segment of the graph of a functional model or a
  `Sequential` nested in it (keras.io's fine-tuning pattern: a
  keras.applications base called as a layer), whose calls then run as a
  chain of its segments.
"""

import dataclasses
import fnmatch
import math

import keras
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost.recompute import selective


@dataclasses.dataclass(eq=False)
class Segment:
    """Part of a functional model's graph, from one cut tensor to the next.

    Attributes:
        name: `"<first layer>..<last layer>"`.
        model: a functional model over those layers (sharing them).
        layers: the layers it calls.
        last: whether it produces the model's outputs (never recomputed:
            the backward needs its insides first).
        holder: the layer of the model whose call runs the graph it cuts
            (a functional model or a `Sequential` called as a layer; None:
            the model's own graph).
    """

    name: str
    model: keras.Model
    layers: list
    last: bool = False
    holder: object = None
    readers_cast: bool = True

    def check_input(self, tensor):
        """Raises unless `tensor`, arriving at this segment (not the
        first), reaches its layers as it would without the cut.

        The segment's functional model converts it to the dtype the graph
        gave it. Where the dtype policy changed after the cut points were
        chosen, that narrows it, or widens it before a reader that computes
        in the dtype it is given (`readers_cast` False). A guard:
        `RecomputeSetup` chooses again at a trace under another policy
        (`_settle`).

        Raises:
            ValueError: naming the segment, both dtypes and what to do.
        """
        expected = tf.as_dtype(tf.nest.flatten(self.model.inputs)[0].dtype)
        got = tensor.dtype
        if got == expected or not (got.is_floating and expected.is_floating):
            return
        if expected.size > got.size and self.readers_cast:
            return  # widened, and every reader casts it back
        raise ValueError(
            f"Cannot run the recompute segment {self.name!r} exactly: its input "
            f"arrives as {got.name}, and the segment (a functional model over "
            f"the graph, built in {expected.name}) converts it to "
            f"{expected.name}, "
            + ("losing precision" if expected.size < got.size else
               "and a layer or operation reading it computes in the dtype it is given")
            + ": the dtype policy changed after its cut points were chosen. Set "
            "the policy before building the model "
            "(keras.mixed_precision.set_global_policy), or name the blocks to "
            'recompute: recompute=["name", ...].'
        )

    def __call__(self, x):
        return self.model(x, training=True)


def _holds_layers(layer):
    return bool(hooks.child_layers(layer))


def nested_blocks(model):
    """Every layer below `model` that holds layers, outermost first."""
    return [
        layer
        for layer in hooks.flatten_layers(model, include_self=False)
        if _holds_layers(layer)
    ]


def auto_layer_blocks(model):
    """The nested blocks "auto" recomputes.

    Starts from the outermost layers that hold layers and replaces a block by
    its own blocks while it holds two or more of them: a stack of encoder
    layers is split into the layers, while an encoder layer that holds one
    attention block stays whole.
    """

    def blocks_in(layer):
        return [c for c in hooks.child_layers(layer) if _holds_layers(c)]

    chosen = []
    pending = blocks_in(model)
    while pending:
        block = pending.pop(0)
        inner = blocks_in(block)
        if len(inner) >= 2 or (len(inner) == 1 and len(pending) == 0 and not chosen):
            pending = inner + pending  # a stack (or a wrapper around one)
        else:
            chosen.append(block)
    return chosen


# "auto" also considers recomputing blocks inside blocks when a model has at
# most this many: with n blocks, a flat plan's replay holds about 1/n of the
# activations at once.
NESTED_UP_TO = 2


def inner_blocks(layer):
    """The layers directly in `layer` worth recomputing inside its replay:
    those that hold layers (an attention block), and kernel layers with an
    activation of their own (a feed-forward's first Dense, whose
    pre-activation and activation internals the backward keeps)."""
    found = []
    for child in hooks.child_layers(layer):
        activation = getattr(child, "activation", None)
        linear = activation is None or activation is keras.activations.linear
        if _holds_layers(child) or (selective.is_kernel_layer(child) and not linear):
            found.append(child)
    return found


def nested_names(layers):
    """Per layer id, its name, prefixed with those of the layers among
    `layers` that hold it (`"transformer_layer_0/self_attention"`)."""
    below = {
        id(layer): {id(i) for i in hooks.flatten_layers(layer, include_self=False)}
        for layer in layers
    }
    names = {}

    def name(layer):
        if id(layer) not in names:
            holders = [o for o in layers if id(layer) in below[id(o)]]
            # The innermost holder: the one the other holders hold.
            up = next(
                (o for o in holders if all(o is h or id(o) in below[id(h)] for h in holders)),
                None,
            )
            names[id(layer)] = f"{name(up)}/{layer.name}" if up is not None else layer.name
        return names[id(layer)]

    for layer in layers:
        name(layer)
    return names


def match_blocks(model, patterns):
    """The layers of `model` (nested ones included) matching the names or
    glob patterns, in model order.

    Raises:
        ValueError: naming a pattern that matches no layer, with the names of
            the blocks that exist.
    """
    layers = hooks.flatten_layers(model, include_self=False)
    layers = [layer for layer in layers if not isinstance(layer, keras.layers.InputLayer)]
    chosen = []
    for pattern in patterns:
        found = [layer for layer in layers if fnmatch.fnmatchcase(layer.name, pattern)]
        if not found:
            blocks = [layer.name for layer in nested_blocks(model)]
            others = [layer.name for layer in layers if layer.name not in blocks]
            raise ValueError(
                "Invalid value for argument `recompute`: the pattern "
                f"{pattern!r} matches no layer of model {model.name!r}. "
                f"Blocks (layers that hold layers): {blocks or 'none'}. "
                f"Other layers: {_shorten(others)}."
            )
        chosen.extend(layer for layer in found if layer not in chosen)
    return [layer for layer in layers if layer in chosen]


def _shorten(names, limit=20):
    if len(names) <= limit:
        return names
    return names[:limit] + [f"... {len(names) - limit} more"]


def cut_points(model, as_built=False):
    """Indices `i` of the calls of a functional model's graph after which one
    tensor alone carries everything later calls need (with `as_built`, as
    if its layers computed in the dtypes the graph was built in).

    Returns:
        `(calls, cuts)`: the graph's calls (`hooks.functional_nodes`) and the
        sorted indices of the calls whose end is a cut point.
    """
    calls = hooks.functional_nodes(model)
    outputs = {id(t) for t in tf.nest.flatten(model.outputs)}
    last_use = {}
    for i, (_, inputs, _) in enumerate(calls):
        for t in inputs:
            last_use[id(t)] = i
    readers = _readers(calls)
    cuts = []
    retyped = not as_built and _retyped(calls)
    live = {id(t) for t in tf.nest.flatten(model.inputs)}
    for i, (_, inputs, produced) in enumerate(calls):
        live |= {id(t) for t in produced}
        live = {t for t in live if last_use.get(t, -1) > i or t in outputs}
        if i < len(calls) - 1 and len(live) == 1 and len(produced) == 1:
            (only,) = live
            if (
                only == id(produced[0])
                and only not in outputs
                and _crossable(produced[0], readers.get(only, []), retyped, calls[i][0])
            ):
                cuts.append(i)
    return calls, cuts


def _readers(calls):
    """Per tensor id, the operations of `calls` that read it."""
    found = {}
    for op, inputs, _ in calls:
        for t in inputs:
            found.setdefault(id(t), []).append(op)
    return found


def _retyped(calls):
    """Whether a layer of the graph computes in another dtype than the graph
    was built in (a mixed policy set after the model was built, as
    `compile(precision=...)` does): its float outputs' symbolic dtype is
    not its compute dtype."""
    return any(
        isinstance(layer, keras.layers.Layer)
        and any(
            t.dtype != layer.compute_dtype and keras.backend.is_float_dtype(t.dtype)
            for t in produced
        )
        for layer, _, produced in calls
    )


def retyped(model):
    """Whether a functional graph of `model` (its own, or one it calls as a
    layer) has fewer cut points than as built: it computes in another dtype
    than it was built in, and an operation computing in the dtype it is
    given reads a tensor that would be one (`_crossable`)."""
    return any(
        len(cut_points(g)[1]) < len(cut_points(g, as_built=True)[1]) for g in _graphs(model)
    )


def graphs_retyped(model):
    """Whether a functional graph of `model` (its own, or one it calls as a
    layer) computes in another dtype than it was built in (`_retyped`: a
    mixed policy set after building, as `compile(precision=...)` does)."""
    return any(_retyped(hooks.functional_nodes(g)) for g in _graphs(model))


def _graphs(model):
    """The functional graphs of `model`, its own and its layers', each once."""
    graphs = {id(g): g for g in map(hooks.layer_graph, hooks.flatten_layers(model)) if g}
    return list(graphs.values())


RETYPED_NOTE = (
    " Under a mixed policy set after the model was built (as "
    "`compile(precision=...)` sets it), no cut is made where an operation "
    "that computes in the dtype it is given reads the tensor (a raw "
    "`x + f(x)`, a layer with autocast=False): the cut would run it in the "
    "dtype the graph was built in. Set the policy before building the model "
    "(keras.mixed_precision.set_global_policy) to cut there."
)


def _crossable(tensor, readers, retyped, producer=None):
    """Whether a segment may start at `tensor`. No Keras mask may ride on it
    (a recomputed segment's outputs are new tensors, without it). And the
    segment (a functional model) converts it to its symbolic dtype: where
    the graph is `retyped`, float32 where it computes in bfloat16, so only
    where every reader casts its inputs to its own compute dtype anyway (a
    layer that converts its inputs, or a functional model or `Sequential`,
    which converts them to its `Input`'s dtype). A raw operation
    (`x + y`, `keras.ops.sin(x)` in a functional graph; ConvNeXt's residual
    add) computes in the dtype it is given: in float32 after the cut; so
    does a layer with `autocast=False`. Nor where the graph's dtype is
    narrower than its `producer`'s compute dtype (built in bfloat16,
    computing in float32): the conversion would round it.
    (`Segment.check_input` refuses, at run time, a cut whose dtype changed
    since it was chosen.)"""
    if hooks.keras_mask(tensor) is not None:
        return False
    if not retyped:
        return True
    if isinstance(producer, keras.layers.Layer) and (
        tf.as_dtype(tensor.dtype).is_floating
        and tf.as_dtype(tensor.dtype).size < tf.as_dtype(producer.compute_dtype).size
    ):
        return False
    return all(
        isinstance(r, keras.layers.Layer)
        and ((hooks.casts_inputs(r) and r.autocast) or hooks.layer_graph(r) is not None)
        for r in readers
    )


def segment_layouts(model):
    """The cut sets a budget's search tries on a functional model's graph:
    "auto"'s (~sqrt(n) segments) first, then about 2, 3, ... segments, up to
    one between every two cut points.

    Returns:
        `(all_cuts, layouts)`: every cut index (`cut_points`), and a list of
        sorted tuples of cut indices, without repeats.
    """
    calls, all_cuts = cut_points(model)
    if not all_cuts:
        return all_cuts, []
    layouts = [tuple(_spread(all_cuts, len(calls)))]
    for count in range(2, len(all_cuts) + 2):
        layouts.append(tuple(_spread(all_cuts, len(calls), count)))
    layouts.append(tuple(all_cuts))
    return all_cuts, list(dict.fromkeys(layouts))


def segments(model, count=None, cuts=None, holder=None):
    """Splits a functional model's graph into segments at cut points.

    Args:
        model: a functional model.
        count: how many segments (about; at most the cut points + 1).
            Defaults to the square root of the number of layer calls.
        cuts: use exactly these cut indices instead (from `cut_points`).
        holder: the layer of the model being trained whose call runs
            `model`'s graph (`hooks.layer_graph`), when it is not the model
            itself: the segments' `holder`, whose name prefixes theirs.

    Returns:
        A list of `Segment`s, at least 2, or `[]` if the graph has no cut
        point.
    """
    calls, all_cuts = cut_points(model)
    if not all_cuts:
        return []
    if cuts is None:
        cuts = _spread(all_cuts, len(calls), count)
    readers = _readers(calls)
    pieces = []
    start_tensors = model.input
    start = 0
    for index in list(cuts) + [len(calls) - 1]:
        last = index == len(calls) - 1
        end_tensors = model.output if last else calls[index][2][0]
        layers = []
        for layer, _, _ in calls[start : index + 1]:
            if layer not in layers:
                layers.append(layer)
        name = f"{layers[0].name}..{layers[-1].name}" if len(layers) > 1 else layers[0].name
        if holder is not None:
            name = f"{holder.name}/{name}"
        piece = keras.Model(start_tensors, end_tensors, name=f"segment_{len(pieces)}")
        cast = not pieces or _crossable(start_tensors, readers.get(id(start_tensors), []), True)
        pieces.append(Segment(name, piece, layers, last, holder, cast))
        start_tensors, start = end_tensors, index + 1
    return pieces


def graph_of(model, pieces):
    """The functional graph `pieces` (segments) cut: `model`'s own, or that
    of the layer of `model` that holds them."""
    holder = pieces[0].holder
    return model if holder is None else hooks.layer_graph(holder)


def resegment(model, pieces, cuts=None):
    """The segments of the graph `pieces` cut (`graph_of`), at `cuts` (by
    default about sqrt(n) of them, as `segments`)."""
    return segments(graph_of(model, pieces), cuts=cuts, holder=pieces[0].holder)


def nested_graphs(model, blocks):
    """The functional layers and built `Sequential`s among `blocks` (the
    nested blocks "auto" found) whose graph has cut points, when the blocks
    are few (`NESTED_UP_TO`), or else the one that holds more layers than all the
    others together: a keras.applications base called as a layer is one
    block, whose replay would hold all its activations at once, and its
    graph can be cut like a model's (its segments share the search's one
    trace, but under a mixed policy set after building, where each holder's
    takes a trace of its own). Not one whose input carries a Keras mask,
    which does not cross the cut tensors."""
    cuttable = [
        layer
        for layer in blocks
        if hooks.layer_graph(layer) is not None
        and cut_points(hooks.layer_graph(layer))[1]
        and not _receives_mask(model, layer)
    ]
    if len(blocks) <= NESTED_UP_TO:
        return cuttable
    size = {id(b): len(hooks.flatten_layers(b)) for b in blocks}
    total = sum(size.values())
    return [layer for layer in cuttable if 2 * size[id(layer)] > total]


def _receives_mask(model, layer):
    """Whether a call of `layer` in the functional graphs of `model` (its
    own and its functional layers') takes an input carrying a Keras mask."""
    graphs = [hooks.layer_graph(g) for g in hooks.flatten_layers(model)]
    return any(
        op is layer and any(hooks.keras_mask(t) is not None for t in inputs)
        for graph in graphs
        if graph is not None
        for op, inputs, _ in hooks.functional_nodes(graph)
    )


def _spread(all_cuts, calls, count=None):
    """About `count` - 1 of `all_cuts`, sorted, each the nearest to an even
    split of the `calls` layer calls; `count` defaults to sqrt(`calls`)."""
    count = count or max(2, round(math.sqrt(calls)))
    cuts = []
    for k in range(1, count):
        target = k * calls / count - 1
        best = min(all_cuts, key=lambda c: abs(c - target))
        if best not in cuts:
            cuts.append(best)
    cuts.sort()
    return cuts


def own_graph_cuttable(model):
    """Whether the model's own `call` runs its functional graph, which a
    plan may then run as a chain of segments instead: not when its class
    overrides `call` (it may run something else than the graph)."""
    return hooks.layer_graph(model) is model


def choose(model, setting):
    """The blocks for a `recompute` setting that needs no shapes.

    Args:
        model: the model (functional, Sequential-derived or subclassed).
        setting: `"auto"` or a tuple of names/patterns.

    Returns:
        `(layers, segments)`: layers to recompute, or segments to run the
        model as (the last is not recomputed); one of them is empty.

    Raises:
        ValueError: nothing matches, or "auto" finds no block.
    """
    if setting != "auto":
        return match_blocks(model, setting), []
    layers = auto_layer_blocks(model)
    if layers:
        return layers, []
    if own_graph_cuttable(model):
        pieces = segments(model)
        if pieces:
            return [], pieces
    if own_graph_cuttable(model):
        why = "its layer graph has no single-tensor cut point. "
    elif hooks.is_functional(model):
        why = (
            f"its class {type(model).__name__} overrides `call`, which may run "
            "something else than its layer graph (so the graph is not cut). "
        )
    else:
        why = "is not a functional model (whose graph could be cut). "
    raise ValueError(
        'recompute="auto" found nothing to recompute in model '
        f"{model.name!r}: it has no layer that holds layers and "
        + why
        + (RETYPED_NOTE[1:] + " Or name" if retyped(model) else "Name")
        + " the layers to recompute instead: recompute=[\"name\", ...]."
    )


def budget_candidates(model):
    """The blocks a `{"budget_mb": N}` setting chooses among.

    Returns:
        `(layers, segments)` as in `choose`: the layers "auto" would
        recompute, or else a segment between every two cut points of a
        functional model's graph (whose figures the search merges into
        coarser segments, `segment_layouts`).

    Raises:
        ValueError: there is neither.
    """
    layers = auto_layer_blocks(model)
    pieces = []
    if not layers and own_graph_cuttable(model):
        _, cuts = cut_points(model)
        pieces = segments(model, cuts=cuts) if cuts else []
    if not layers and not pieces:
        choose(model, "auto")  # raises the "nothing to recompute" error
    return layers, pieces


def _own_train_step(model):
    """Whether `model`'s class defines its own `train_step`."""
    from keras_gradboost.model import own_steps  # model.py imports this package

    return "train_step" in own_steps(model)


def search_families(model):
    """The kinds of plan "auto" and a budget choose among, estimated from
    one trace (`RecomputeSetup.search`): the nested blocks "auto" would
    recompute (if any), and a segment between every two cut points of a
    functional model's
    graph (if it has any), whose coarser segmentations the search merges.
    A model whose nested blocks are few or small beside the flat graph
    around them (ConvNeXt's 18 blocks sit inline between 4 nested
    `Sequential`s) is served by the second. With at most `NESTED_UP_TO`
    nested blocks (a 2-layer GPT-2), a third: those blocks and the blocks
    inside them (`inner_blocks`), recomputed inside their replays; a flat
    plan of so few blocks keeps a whole block's activations at its replay.
    And of those blocks, each functional one whose graph can be cut
    (`nested_graphs`: a keras.applications base called as a layer), a
    segment between every two of its cut points.

    A model with a `train_step` of its own gets the segments of its own
    graph only when there is nothing else: GradBoostModel's forward alone
    runs them, and its step may run its own (which raises at its first
    trace), where nested blocks and a layer's segments run in any forward.

    Returns:
        A list of `(layers, segments)` pairs, one of each pair empty.

    Raises:
        ValueError: there is neither.
    """
    families = []
    layers = auto_layer_blocks(model)
    if layers:
        families.append((layers, []))
    if 0 < len(layers) <= NESTED_UP_TO:
        nested = [b for layer in layers for b in [layer] + inner_blocks(layer)]
        if len(nested) > len(layers):
            families.append((nested, []))
    for holder in nested_graphs(model, layers):
        graph = hooks.layer_graph(holder)
        families.append(([], segments(graph, cuts=cut_points(graph)[1], holder=holder)))
    if own_graph_cuttable(model) and not (families and _own_train_step(model)):
        _, cuts = cut_points(model)
        if cuts:
            families.append(([], segments(model, cuts=cuts)))
    if not families:
        choose(model, "auto")  # raises the "nothing to recompute" error
    return families


def selective_blocks(model, setting):
    """The blocks of `recompute={"policy": "selective", "blocks": setting}`.

    With `"auto"`: of the kinds of plan (`search_families`: the nested
    blocks, or a functional graph's ~sqrt(n) segments, the model's or a
    functional layer's), the one whose recomputed parts hold the most
    kernel layers (a functional layer whose graph is cut counting for its
    segments only): a selective plan keeps
    their outputs and recomputes the rest, so it pays where it covers most
    of the model (ConvNeXt's 18 blocks sit inline, outside its nested
    `Sequential`s; a BERT's encoder layers are its nested blocks). The
    setup then leaves out the last nested block (as the last segment), whose
    replay would come first in the backward and save nothing.

    Args:
        model: the model.
        setting: `"auto"` or a tuple of names/patterns.

    Returns:
        `(layers, segments)` as in `choose`.

    Raises:
        ValueError: nothing matches, "auto" finds no block, or the blocks
            hold no kernel layer (nothing to keep: recompute fully instead).
    """
    if setting != "auto":
        layers, pieces = match_blocks(model, setting), []
        parts = layers
    else:
        best = None
        families = search_families(model)
        # A functional layer whose graph is cut is served by its segments:
        # replayed whole, its replay would hold all it rebuilds at once.
        cut = [p[0].holder for _, p in families if p and p[0].holder is not None]
        for layers, pieces in families:
            if pieces:
                pieces = resegment(model, pieces)
            parts = layers or [l for s in pieces if not s.last for l in s.layers]
            covered = len(selective.kernel_layers([p for p in parts if p not in cut]))
            if best is None or covered > best[0]:
                best = (covered, layers, pieces, parts)
        _, layers, pieces, parts = best
    if not selective.kernel_layers(parts):
        names = [layer.name for layer in layers] or [s.name for s in pieces]
        raise ValueError(
            f'Invalid value for argument `recompute`: {{"policy": "selective"}} '
            f"keeps the outputs of the kernel layers (Dense, EinsumDense, "
            f"convolutions) in the blocks {_shorten(names)}, and they hold "
            'none. Recompute them fully instead: recompute={"policy": "full", '
            f'"blocks": {list(setting) if setting != "auto" else "auto"!r}}}.'
        )
    return layers, pieces
