"""Choosing what to recompute: blocks by name or pattern, "auto", or a memory
budget, and the estimate of what each block's recompute saves.

Two kinds of block:

* a layer that holds layers (a residual block, a transformer encoder layer, a
  sub-model), recomputed by putting `recompute.recomputed` in front of its
  `call`;
* for a functional model without such layers, a segment of its layer graph
  between two single-tensor cut points (Chen et al., 2016, "Training Deep Nets
  with Sublinear Memory Cost"), recomputed by running the model as a chain of
  segments.
"""

import copy
import dataclasses
import fnmatch
import math
import warnings

import keras
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost import recompute

MIB = 2**20


# ------------------------------------------------------------------ blocks


@dataclasses.dataclass(eq=False)
class Segment:
    """Part of a functional model's graph, from one cut tensor to the next.

    Attributes:
        name: `"<first layer>..<last layer>"`.
        model: a functional model over those layers (sharing them).
        layers: the layers it calls.
        last: whether it produces the model's outputs (never recomputed:
            the backward needs its insides first).
    """

    name: str
    model: keras.Model
    layers: list
    last: bool = False

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


def cut_points(model):
    """Indices `i` of the calls of a functional model's graph after which one
    tensor alone carries everything later calls need.

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
    cuts = []
    live = {id(t) for t in tf.nest.flatten(model.inputs)}
    for i, (_, inputs, produced) in enumerate(calls):
        live |= {id(t) for t in produced}
        live = {t for t in live if last_use.get(t, -1) > i or t in outputs}
        if i < len(calls) - 1 and len(live) == 1 and len(produced) == 1:
            (only,) = live
            if only == id(produced[0]) and only not in outputs:
                cuts.append(i)
    return calls, cuts


def segments(model, count=None, cuts=None):
    """Splits a functional model's graph into segments at cut points.

    Args:
        model: a functional model.
        count: how many segments (about; at most the cut points + 1).
            Defaults to the square root of the number of layer calls.
        cuts: use exactly these cut indices instead (from `cut_points`).

    Returns:
        A list of `Segment`s, at least 2, or `[]` if the graph has no cut
        point.
    """
    calls, all_cuts = cut_points(model)
    if not all_cuts:
        return []
    if cuts is None:
        count = count or max(2, round(math.sqrt(len(calls))))
        cuts = []
        for k in range(1, count):
            target = k * len(calls) / count - 1
            best = min(all_cuts, key=lambda c: abs(c - target))
            if best not in cuts:
                cuts.append(best)
        cuts.sort()
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
        piece = keras.Model(start_tensors, end_tensors, name=f"segment_{len(pieces)}")
        pieces.append(Segment(name, piece, layers, last))
        start_tensors, start = end_tensors, index + 1
    return pieces


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
    if hooks.is_functional(model):
        pieces = segments(model)
        if pieces:
            return [], pieces
    raise ValueError(
        'recompute="auto" found nothing to recompute in model '
        f"{model.name!r}: it has no layer that holds layers and "
        + (
            "its layer graph has no single-tensor cut point. "
            if hooks.is_functional(model)
            else "is not a functional model (whose graph could be cut). "
        )
        + "Name the layers to recompute instead: recompute=[\"name\", ...]."
    )


# --------------------------------------------------------------- estimates


@dataclasses.dataclass
class BlockEstimate:
    """One candidate block and its estimated activation memory.

    Attributes:
        name: the layer's name, or the segment's `"first..last"`.
        recomputed: whether the plan recomputes it.
        cached_bytes: bytes of activations produced inside the block that the
            backward pass keeps without recompute (its outputs excluded).
        input_bytes: bytes of its float inputs (kept when it is recomputed).
        recompute_flops: estimated cost of one extra forward of the block.
    """

    name: str
    recomputed: bool
    cached_bytes: int
    input_bytes: int
    recompute_flops: float


@dataclasses.dataclass
class RecomputePlan:
    """What `compile(recompute=...)` recomputes, with memory estimates.

    The estimates are of activation memory the backward pass keeps (weights,
    gradients and optimizer slots are not included), from the traced
    training graph at `batch_size`.

    Attributes:
        setting: the `recompute` compile argument.
        batch_size: the batch size the estimates are for (None: not estimated).
        blocks: `BlockEstimate` per candidate block.
        bytes_without: estimated activation bytes without recompute.
        bytes_with: estimated peak activation bytes with this plan (what is
            kept plus the largest recomputed block, rebuilt during backward).
    """

    setting: object
    batch_size: object = None
    blocks: list = dataclasses.field(default_factory=list)
    bytes_without: object = None
    bytes_with: object = None

    @property
    def recomputed(self):
        """Names of the recomputed blocks."""
        return [b.name for b in self.blocks if b.recomputed]

    def __str__(self):
        lines = [f"Recompute plan (recompute={self.setting!r})"]
        if self.batch_size is None:
            lines.append("  blocks: " + (", ".join(self.recomputed) or "none"))
            return "\n".join(lines)
        lines.append(
            f"  batch size {self.batch_size}: activations kept for backward "
            f"~{self.bytes_without / MIB:.1f} MiB without recompute, "
            f"~{self.bytes_with / MIB:.1f} MiB peak with this plan"
        )
        width = max([len(b.name) for b in self.blocks] + [5])
        lines.append(
            f"  {'block':<{width}}  recompute  cached MiB  inputs MiB  GFLOP"
        )
        for b in self.blocks:
            lines.append(
                f"  {b.name:<{width}}  {'yes' if b.recomputed else 'no':<9}  "
                f"{b.cached_bytes / MIB:>10.2f}  {b.input_bytes / MIB:>10.2f}  "
                f"{b.recompute_flops / 1e9:>5.2f}"
            )
        return "\n".join(lines)


_ALIASES = {"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient"}


def _root(tensor):
    """The tensor whose buffer `tensor` shares (through reshapes/identities)."""
    while tensor.op.type in _ALIASES and tensor.op.inputs:
        index = tensor.value_index if tensor.op.type == "IdentityN" else 0
        tensor = tensor.op.inputs[index]
    return tensor


def _bytes(tensor):
    shape = tensor.shape
    if not shape.is_fully_defined() or tensor.dtype in (tf.resource, tf.variant):
        return 0
    return shape.num_elements() * tensor.dtype.size


def _flops(op):
    if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D", "Conv1D", "Conv3D", "DepthwiseConv2dNative"):
        out = op.outputs[0].shape
        a = op.inputs[0].shape
        if out.is_fully_defined() and a.is_fully_defined() and a.rank:
            # output elements x reduced size x 2 (multiply-add)
            if op.type.startswith("Conv") or op.type.startswith("Depthwise"):
                kernel = op.inputs[1].shape
                reduced = kernel[:-1].num_elements() if kernel.is_fully_defined() else 1
            elif op.type == "Einsum":
                reduced = max(1, a.num_elements() // max(1, out.num_elements()))
            else:
                transpose = op.get_attr("transpose_a") if op.type == "MatMul" else op.get_attr("adj_x")
                reduced = a[-2] if transpose else a[-1]
            return 2.0 * out.num_elements() * reduced
    return float(sum(_bytes(t) / max(1, t.dtype.size) for t in op.outputs))


class _Probe:
    """Records, while a forward is traced, which graph operations each block
    call created and which tensors went in and came out."""

    def __init__(self):
        self.calls = {}  # block key -> list of (first op, end op, inputs, outputs)

    def run(self, key, fn, *args, **kwargs):
        graph = tf.compat.v1.get_default_graph()
        inputs = [t for t in tf.nest.flatten((args, kwargs)) if isinstance(t, tf.Tensor)]
        start = len(graph.get_operations())
        outputs = fn(*args, **kwargs)
        end = len(graph.get_operations())
        flat = [t for t in tf.nest.flatten(outputs) if isinstance(t, tf.Tensor)]
        self.calls.setdefault(key, []).append((start, end, inputs, flat))
        return outputs


def estimate(model, forward, input_spec, keys):
    """Traces one training step and measures what each block keeps.

    Args:
        model: the model (its trainable variables are differentiated).
        forward: `forward(x, probe)` runs the model's training forward on `x`,
            calling each candidate block through `probe.run(key, fn, ...)`.
        input_spec: nested `tf.TensorSpec`s with a concrete batch size.
        keys: the candidate blocks' keys, in order.

    Returns:
        `(bytes_without, per_block, sizes)`: total cached bytes; per key a
        dict with `cached` and `inputs` (bytes), `flops`, `inside` (names of
        the cached tensors made inside the block) and `input_roots` (input
        tensor names to bytes); and the size of every cached tensor by name.
    """
    probe = _Probe()
    marker = []

    def step(x):
        with tf.GradientTape() as tape:
            y = forward(x, probe)
            target = tf.add_n(
                [
                    tf.reduce_sum(tf.cast(t, tf.float32))
                    for t in tf.nest.flatten(y)
                    if t.dtype.is_floating
                ]
            )
        marker.append(len(tf.compat.v1.get_default_graph().get_operations()))
        grads = tape.gradient(target, model.trainable_variables)
        return [g for g in grads if g is not None]

    graph = tf.function(step, autograph=False).get_concrete_function(input_spec).graph
    operations = graph.get_operations()
    forward_ops = {op.name: i for i, op in enumerate(operations[: marker[0]])}
    cached = {}
    for op in operations[marker[0] :]:
        for t in op.inputs:
            root = _root(t)
            if root.op.name in forward_ops and root.op.type not in ("ReadVariableOp", "Const"):
                cached[root.name] = root
    total = sum(_bytes(t) for t in cached.values())
    per_block = {}
    for key in keys:
        inside, outputs, input_roots, flops = set(), set(), {}, 0.0
        for start, end, inputs, outs in probe.calls.get(key, []):
            outputs |= {_root(t).name for t in outs}
            for t in inputs:
                if t.dtype.is_floating:
                    input_roots[_root(t).name] = _bytes(t)
            for op in operations[start:end]:
                flops += _flops(op)
                for t in op.outputs:
                    if t.name in cached and t.name not in outputs:
                        inside.add(t.name)
        inside -= outputs | set(input_roots)
        per_block[key] = {
            "cached": sum(_bytes(cached[n]) for n in inside),
            "inputs": sum(input_roots.values()),
            "flops": flops,
            "inside": inside,
            "input_roots": input_roots,
        }
    sizes = {name: _bytes(t) for name, t in cached.items()}
    return total, per_block, sizes


def plan_bytes(total, per_block, sizes, chosen):
    """Estimated peak activation bytes when the `chosen` keys are recomputed:
    what stays cached, plus the recomputed blocks' inputs, plus the largest
    recomputed block, rebuilt during the backward pass."""
    dropped = set()
    for key in chosen:
        dropped |= per_block[key]["inside"]
    kept = total - sum(sizes[name] for name in dropped)
    extra = {}
    for key in chosen:
        for name, size in per_block[key]["input_roots"].items():
            if name not in sizes or name in dropped:
                extra[name] = size
    transient = max([per_block[key]["cached"] for key in chosen], default=0)
    return kept + sum(extra.values()) + transient


def budget_choice(budget_bytes, total, per_block, sizes, keys):
    """The fewest blocks, best saving per recompute cost first, whose
    estimate fits `budget_bytes`.

    Returns:
        `(chosen keys, estimated bytes, fits)`.
    """
    chosen = []
    estimate_now = total
    if estimate_now <= budget_bytes:
        return chosen, estimate_now, True
    ranked = sorted(
        keys,
        key=lambda k: -(per_block[k]["cached"] - per_block[k]["inputs"])
        / max(per_block[k]["flops"], 1.0),
    )
    for key in ranked:
        if per_block[key]["cached"] <= per_block[key]["inputs"]:
            continue  # recomputing it would not save anything
        chosen.append(key)
        estimate_now = plan_bytes(total, per_block, sizes, chosen)
        if estimate_now <= budget_bytes:
            return chosen, estimate_now, True
    return chosen, estimate_now, False


# ------------------------------------------------------------ per model


class RecomputeSetup:
    """A model's `recompute` setting turned into blocks, and the training
    forward that recomputes them.

    Args:
        model: the GradBoostModel.
        setting: the normalised `recompute` compile argument (not None).

    Raises:
        ValueError: a pattern matches nothing, or "auto" finds no block.
    """

    def __init__(self, model, setting):
        self.setting = setting
        self.budget = isinstance(setting, dict)
        self.batch_hint = setting.get("batch_size") if self.budget else None
        self.input_spec = None  # per-example specs, seen at the first trace
        self.layers, self.segments = [], []
        self.chosen = set()  # keys: id(layer), or segment index
        self.plan = None  # the RecomputePlan made for a budget
        if not self.budget:
            self.layers, self.segments = choose(model, setting)
            self.chosen = set(self.keys) - {
                i for i, s in enumerate(self.segments) if s.last
            }
        self.pending = self.budget

    @property
    def keys(self):
        if self.segments:
            return list(range(len(self.segments)))
        return [id(layer) for layer in self.layers]

    def names(self):
        if self.segments:
            return {i: s.name for i, s in enumerate(self.segments)}
        return {id(layer): layer.name for layer in self.layers}

    def apply(self):
        for layer in self.layers:
            recompute.mark(layer)

    def forward(self, model, x, only=None, probe=None):
        """The training forward, recomputing the chosen blocks (or `only`
        these keys), or recording each block's operations into `probe`."""
        chosen = self.chosen if only is None else set(only)
        if self.segments:
            h = x
            for i, segment in enumerate(self.segments):
                if probe is not None:
                    h = probe.run(i, segment, h)
                elif i in chosen and not segment.last:
                    state = recompute.state_variables(segment.model)
                    h = recompute.recomputed(
                        segment, state, segment.name, segment.model.trainable_variables
                    )(h)
                else:
                    h = segment(h)
            return h
        if probe is not None:
            context = recompute.probing(probe, self.keys)
        else:
            context = recompute.active(chosen)
        with context:
            if hooks.call_has_training_arg(model):
                return model(x, training=True)
            return model(x)

    def observe(self, x):
        """Records the per-example input specs of a traced training batch."""
        self.input_spec = tf.nest.map_structure(
            lambda t: tf.TensorSpec(t.shape[1:], t.dtype), x
        )
        batch = tf.nest.flatten(x)[0].shape[0]
        if batch is not None and self.batch_hint is None:
            self.batch_hint = int(batch)

    def _spec(self, model, batch_size):
        spec = self.input_spec
        if spec is None and hooks.is_functional(model):
            spec = tf.nest.map_structure(
                lambda t: tf.TensorSpec(t.shape[1:], t.dtype), model.input
            )
        if spec is None or batch_size is None:
            return None
        return tf.nest.map_structure(
            lambda s: tf.TensorSpec([batch_size] + list(s.shape), s.dtype), spec
        )

    def resolve_budget(self, model, x):
        """Chooses the blocks for `{"budget_mb": N}` (at the first trace).

        Args:
            model: the model.
            x: a training batch's inputs (tensors or `tf.TensorSpec`s).
        """
        self.observe(x)
        spec = self._spec(model, self.batch_hint)
        if spec is None:
            raise ValueError(
                f"recompute={self.setting!r} needs the batch size to estimate "
                "activation memory, and the training batches do not have a "
                'fixed one. Add it: recompute={"budget_mb": '
                f'{self.setting["budget_mb"]:g}, "batch_size": B}}.'
            )
        self.layers = auto_layer_blocks(model)
        if not self.layers and hooks.is_functional(model):
            _, cuts = cut_points(model)
            self.segments = segments(model, cuts=cuts) if cuts else []
        if not self.layers and not self.segments:
            choose(model, "auto")  # raises the "nothing to recompute" error
        self.apply()
        estimated = estimate(
            model, lambda v, p: self.forward(model, v, probe=p), spec, self.keys
        )
        budget = self.setting["budget_mb"] * MIB
        keys = [k for k in self.keys if not (self.segments and self.segments[k].last)]
        chosen, best, fits = budget_choice(budget, *estimated, keys)
        self.chosen = set(chosen)
        self.plan = self._plan(estimated, self.batch_hint)
        self.pending = False
        if not fits:
            warnings.warn(
                f"recompute={self.setting!r}: the activation memory cannot be "
                f"brought under {self.setting['budget_mb']:g} MiB at batch size "
                f"{self.batch_hint}; the best estimate, recomputing every "
                f"block that saves memory, is {best / MIB:.1f} MiB "
                f"(without recompute: {estimated[0] / MIB:.1f} MiB). Lower the "
                "batch size (with accumulate_steps to keep the effective "
                "batch), use mixed precision, or raise the budget.",
                stacklevel=2,
            )

    def _plan(self, estimated, batch_size):
        total, per_block, sizes = estimated
        names = self.names()
        rows = [
            BlockEstimate(
                name=names[k],
                recomputed=k in self.chosen,
                cached_bytes=per_block[k]["cached"],
                input_bytes=per_block[k]["inputs"],
                recompute_flops=per_block[k]["flops"],
            )
            for k in self.keys
        ]
        return RecomputePlan(
            setting=self.setting,
            batch_size=batch_size,
            blocks=rows,
            bytes_without=total,
            bytes_with=plan_bytes(total, per_block, sizes, sorted(self.chosen)),
        )

    def report(self, model, batch_size=None):
        """A `RecomputePlan` with estimates when the input shapes are known."""
        batch_size = batch_size or self.batch_hint
        if self.pending:  # what the budget would choose, not committed
            spec = self._spec(model, batch_size)
            if spec is None:
                return RecomputePlan(setting=self.setting)
            trial = copy.copy(self)
            trial.batch_hint = batch_size
            trial.resolve_budget(model, spec)
            return trial.plan
        if self.plan is not None and batch_size == self.plan.batch_size:
            return self.plan
        spec = self._spec(model, batch_size)
        if spec is None:
            names = self.names()
            return RecomputePlan(
                setting=self.setting,
                blocks=[
                    BlockEstimate(names[k], k in self.chosen, 0, 0, 0.0)
                    for k in self.keys
                ],
            )
        estimated = estimate(
            model, lambda v, p: self.forward(model, v, probe=p), spec, self.keys
        )
        return self._plan(estimated, batch_size)
