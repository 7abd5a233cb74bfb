"""Estimates of what recomputing each block saves, and the `RecomputePlan`
that reports them.

The estimates come from the traced training graph: the forward tensors the
backward pass reads are what the forward keeps for it; a block's share is
those made inside its calls.
"""

import dataclasses

import tensorflow as tf

from keras_gradboost import flops as flops_lib

MIB = 2**20


@dataclasses.dataclass
class BlockEstimate:
    """One candidate block and its estimated activation memory.

    Attributes:
        name: the layer's name, or the segment's `"first..last"`.
        recomputed: whether the plan recomputes it.
        cached_bytes: bytes of activations produced inside the block that the
            backward pass keeps without recompute (its outputs excluded).
        input_bytes: bytes of its float inputs (kept when it is recomputed).
        recompute_flops: estimated cost of one extra forward of the block
            (for a selective plan, of what it replays: the block without
            its matmuls and convolutions by a weight).
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
            kept plus the largest recomputed block, rebuilt during backward;
            for a selective plan, what its traced step keeps plus what a
            replay rebuilds beyond what the backward has freed by then).
        gradient_bytes: bytes of the trainable variables' gradients, held
            at the end of the backward beside what is left of the
            activations.
        measured_peak_bytes: after a `fit` at `batch_size`, the device
            allocator's peak during it above the level before it (activations,
            plus gradients, optimizer slots it created and temporaries), read
            once at its end; None before, or where the device's allocator
            keeps no statistics (on some CPUs, unless
            `TF_CPU_ALLOCATOR_USE_BFC=true`).
    """

    setting: object
    batch_size: object = None
    blocks: list = dataclasses.field(default_factory=list)
    bytes_without: object = None
    bytes_with: object = None
    gradient_bytes: object = None
    measured_peak_bytes: object = None

    @property
    def peak_bytes(self):
        """The estimate a measured training peak compares with: `bytes_with`
        plus `gradient_bytes` (None when not estimated)."""
        if self.bytes_with is None:
            return None
        return self.bytes_with + (self.gradient_bytes or 0)

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
        if isinstance(self.setting, dict) and self.setting.get("policy") == "selective":
            lines.append(
                "  selective: the outputs of the kernel layers (Dense, EinsumDense, "
                "convolutions) are kept; GFLOP is what the backward replays"
            )
        if self.gradient_bytes is not None:
            lines.append(
                f"  with the gradients ({self.gradient_bytes / MIB:.1f} MiB): "
                f"~{self.peak_bytes / MIB:.1f} MiB training peak estimated"
            )
        if self.measured_peak_bytes is not None:
            lines.append(
                f"  measured in the last fit: allocator peak "
                f"{self.measured_peak_bytes / MIB:.1f} MiB above the level before "
                "it (activations, gradients, optimizer slots and temporaries)"
                + (
                    f", {self.measured_peak_bytes / self.peak_bytes:.2f}x the estimate"
                    if self.peak_bytes
                    else ""
                )
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


_CONTRACTIONS = flops_lib.MATMULS + flops_lib.CONVOLUTIONS + ("Einsum",)


def _flops(op):
    """An op's cost: a contraction's FLOPs (`flops.op_flops`: a depthwise
    convolution sums over its window alone), else one per output element."""
    if op.type in _CONTRACTIONS:
        counted = flops_lib.op_flops(op)
        if counted:  # None (a shape unknown), 0.0 (an einsum of one operand)
            return counted
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

def estimate(model, forward, input_spec, keys, selective=False):
    """Traces one training step and measures what each block keeps.

    Args:
        model: the model (its trainable variables are differentiated).
        forward: `forward(x, probe)` runs the model's training forward on `x`,
            calling each candidate block through `probe.run(key, fn, ...)`.
        input_spec: nested `tf.TensorSpec`s with a concrete batch size.
        keys: the candidate blocks' keys, in order.
        selective: count as a block's recompute FLOPs only what selective
            recompute replays: not the matmuls and convolutions by a weight
            (the kernel layers', whose outputs it keeps). Defaults to
            `False`.

    Returns:
        `(bytes_without, per_block, sizes)`: total cached bytes; per key a
        dict with `cached` and `inputs` (bytes), `flops`, `inside` (names of
        the cached tensors made inside the block) and `input_roots` (input
        tensor names to bytes); and the size of every cached tensor by name.
    """
    probe = _Probe()
    graph, backward_start = _trace_step(model, forward, probe, input_spec)
    operations = graph.get_operations()
    cached = _cached(operations, backward_start)
    total = sum(_bytes(t) for t in cached.values())
    # In the order the forward first calls them (`plan_bytes` needs it).
    first_call = {key: probe.calls[key][0][0] for key in keys if probe.calls.get(key)}
    ordered = sorted(keys, key=lambda k: first_call.get(k, len(operations)))
    per_block = {
        key: _block_figures(probe.calls.get(key, []), operations, cached, selective)
        for key in ordered
    }
    sizes = {name: _bytes(t) for name, t in cached.items()}
    return total, per_block, sizes


def _trace_step(model, forward, probe, input_spec):
    """The graph of one traced training step (forward through `probe`, then
    the gradients of the trainable variables), and the index of its first
    backward operation."""
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
    return graph, marker[0]


def kept_bytes(model, forward, input_spec):
    """Bytes of the forward tensors that the live part of one traced
    training step's backward pass reads: what a plan really keeps.

    Unlike `estimate`, which traces the step without recompute, this traces
    it as `forward` runs it (a selective plan's replay included) and walks
    back from the gradients (`live_backward`), so operations nothing needs
    (a replay's matmul whose output only its own value would use) and the
    forward tensors only they read are left out, as TensorFlow prunes them.

    Args:
        model: the model (its trainable variables are differentiated).
        forward: `forward(x, probe)` runs the training forward (`probe` is
            None).
        input_spec: nested `tf.TensorSpec`s with a concrete batch size.

    Returns:
        An int, bytes.
    """
    _, kept = live_backward(model, forward, input_spec)
    return sum(_bytes(t) for t in kept.values())


def live_backward(model, forward, input_spec):
    """The backward operations of one traced training step that its
    gradients need, and the forward tensors they read.

    Args:
        model, forward, input_spec: as in `kept_bytes`.

    Returns:
        `(operations, kept)`: the live backward `tf.Operation`s, and the
        forward tensors they read (through reshapes and identities), by name.
    """
    graph, backward_start = _trace_step(model, forward, None, input_spec)
    index = {op.name: i for i, op in enumerate(graph.get_operations())}
    kept, live = {}, {}
    pending = [t.op for t in graph.outputs]
    while pending:
        op = pending.pop()
        if op.name in live or index.get(op.name, 0) < backward_start:
            continue
        live[op.name] = op
        pending.extend(op.control_inputs)
        for t in op.inputs:
            root = _root(t)
            if index.get(root.op.name, backward_start) >= backward_start:
                pending.append(t.op)
            elif root.op.type not in ("ReadVariableOp", "Const"):
                kept[root.name] = root
    return list(live.values()), kept


def _cached(operations, backward_start):
    """The forward tensors the backward reads, by name: what the forward
    keeps for it (weights and constants aside)."""
    forward_ops = {op.name: i for i, op in enumerate(operations[:backward_start])}
    cached = {}
    for op in operations[backward_start:]:
        for t in op.inputs:
            root = _root(t)
            if root.op.name in forward_ops and root.op.type not in ("ReadVariableOp", "Const"):
                cached[root.name] = root
    return cached


_WEIGHT_PATH = _ALIASES | {"Cast"}


def _by_weight(op):
    """Whether a matmul or convolution multiplies by a weight (a variable's
    value, through casts and reshapes): a kernel layer's."""
    if op.type not in _CONTRACTIONS:
        return False
    for t in op.inputs:
        while t.op.type in _WEIGHT_PATH and t.op.inputs:
            t = t.op.inputs[0]
        if t.op.type == "ReadVariableOp":
            return True
    return False


def _block_figures(calls, operations, cached, selective=False):
    """One block's figures (see `estimate`) from its `_Probe` calls."""
    inside, outputs, input_roots, flops = set(), set(), {}, 0.0
    for start, end, inputs, outs in calls:
        outputs |= {_root(t).name for t in outs}
        for t in inputs:
            if t.dtype.is_floating:
                input_roots[_root(t).name] = _bytes(t)
        for op in operations[start:end]:
            if not (selective and _by_weight(op)):
                flops += _flops(op)
            for t in op.outputs:
                if t.name in cached and t.name not in outputs:
                    inside.add(t.name)
    inside -= outputs | set(input_roots)
    return {
        "cached": sum(_bytes(cached[n]) for n in inside),
        "inputs": sum(input_roots.values()),
        "flops": flops,
        "inside": inside,
        "input_roots": input_roots,
    }


def plan_bytes(total, per_block, sizes, chosen):
    """Estimated peak activation bytes when the `chosen` keys are recomputed.

    The backward pass runs the blocks from the last (`per_block`'s order is
    the forward's) to the first: when it reaches a block, the blocks after
    it have freed what they kept, and this block's activations are all
    alive (kept, or rebuilt when it is recomputed). The peak is the largest
    of those moments and the end of the forward, on top of what no block
    holds (kept throughout) and the recomputed blocks' inputs. So
    recomputing the last block saves nothing: its rebuild comes first,
    while everything else is still kept.
    """
    chosen = set(chosen)
    dropped = set()
    for key in chosen:
        dropped |= per_block[key]["inside"]
    kept = total - sum(sizes[name] for name in dropped)
    extra = {}
    for key in chosen:
        for name, size in per_block[key]["input_roots"].items():
            if name not in sizes or name in dropped:
                extra[name] = size
    inside = {key: per_block[key]["cached"] for key in per_block}
    kept_inside = {key: 0 if key in chosen else inside[key] for key in per_block}
    outside = max(0, kept - sum(kept_inside.values()))
    worst, before = sum(kept_inside.values()), 0
    for key in per_block:
        worst = max(worst, before + inside[key])
        before += kept_inside[key]
    return outside + sum(extra.values()) + worst


def selective_rebuild(per_block, chosen):
    """Estimated bytes a selective plan's replays add to what its step keeps.

    The backward meets the blocks last to first (`per_block`'s order is the
    forward's, as in `plan_bytes`). A replay rebuilds at most its block's
    activations (less what the step keeps anyway: its kernel layers'
    outputs). By then, assuming the backward of the blocks after it has
    finished, those of them that are not recomputed have freed their
    activations, all of them kept. So a replay adds its block's activations
    less what those later blocks freed, if that is positive; the largest of
    these is the estimate. (What the later recomputed blocks kept is not
    subtracted.) With the block the backward meets first left out, as
    "auto" does, alike blocks add nothing.

    Args:
        per_block: the blocks' figures, as `estimate` returns them.
        chosen: the keys of the recomputed blocks.

    Returns:
        An int, bytes.
    """
    added, freed = 0, 0
    for key in reversed(list(per_block)):
        if key in chosen:
            added = max(added, per_block[key]["cached"] - freed)
        else:
            freed += per_block[key]["cached"]
    return added
