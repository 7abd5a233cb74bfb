"""Estimates of what recomputing each block saves, and the `RecomputePlan`
that reports them.

The estimates come from the traced training graph: the forward tensors the
backward pass reads are what the forward keeps for it; a block's share is
those made inside its calls.
"""

import dataclasses
import types

import tensorflow as tf

from keras_gradboost import cpu_threads
from keras_gradboost import depthwise
from keras_gradboost import flops as flops_lib
from keras_gradboost import hooks
from keras_gradboost import precision
from keras_gradboost.recompute import updates

MIB = 2**20


def onednn_would_take(dtypes):
    """Whether turning oneDNN on would take convolutions of compute `dtypes`
    (names; `()` for a plan made by hand) off Eigen's kernels: it is off
    here, and they are not all float16 (oneDNN leaves those to Eigen)."""
    return hooks.onednn_enabled() is False and set(dtypes) != {"float16"}


def _why_eigen(dtypes):
    """Why convolutions of compute `dtypes` (names) run on Eigen's kernels:
    oneDNN is off, or they are float16 (oneDNN leaves those to Eigen); for
    `()` (a plan made by hand) whichever holds for this process."""
    reasons = []
    if onednn_would_take(dtypes):
        reasons.append(
            "oneDNN is off on this CPU; TF_ENABLE_ONEDNN_OPTS=1 turns it on, "
            "and needs less memory"
        )
    if "float16" in dtypes or not reasons:
        reasons.append("oneDNN leaves float16 convolutions to them")
    return "; ".join(reasons)


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

    The estimates are of activation memory the backward pass keeps, and
    (`peak_bytes`) of the training peak: those activations plus the
    gradients alive with them (weights and optimizer slots are not
    included), from the traced training graph at `batch_size`.

    Attributes:
        setting: the `recompute` compile argument.
        batch_size: the batch size the estimates are for (None: not
            estimated). The estimates are for one copy of the training
            step at that batch size: under a distribution strategy each
            replica runs its own on its share of the batch, so replicas on
            logical devices of one CPU, which share its memory, hold one
            such peak each (working buffers and XLA temporaries included).
        blocks: `BlockEstimate` per candidate block.
        bytes_without: estimated activation bytes without recompute.
        bytes_with: estimated peak activation bytes with this plan (what is
            kept plus the largest recomputed block, rebuilt during backward;
            for a selective plan, `selective_plan_bytes`: its chosen blocks
            hold their kernel layers' outputs until their replay).
        gradient_bytes: bytes of all the trainable variables' gradients.
        peak_bytes: the estimate a measured training peak compares with:
            at each moment of the backward (`plan_bytes`), the activations
            alive plus the gradients alive (the weights' of the block being
            differentiated, or of a stem or a head at theirs: TensorFlow
            applies each variable's update as soon as its gradient exists,
            with the buffers of that update, `updates.update_temporaries`;
            when `gradients_pile_up`, after a check whose updates run in
            turn, the gradients made until each moment and every one at
            the end with the updates' buffers, else every gradient
            throughout with those of the largest weight's update), and the
            working buffers of the backward of the convolutions there
            (`eigen_convolutions`, `xla_temporary_bytes`); None when not
            estimated.
        peak_bytes_updates_alone: the same with each optimizer update
            counted alone (`plan_bytes`' `alone`): the low end, where
            `peak_bytes` is the high one. Which one a step meets depends on
            TensorFlow's executor: it runs the update of a weight beside
            the next weight's when the backward between their gradients is
            shorter than the update. At 64x64, batch 16, "auto", Adam
            (allocations alive at the profiler's peak): ConvNeXtTiny with
            `depthwise="native"` held one 9 MiB kernel's gradient and its
            update's `Square`, 49.3-50.1 MiB requested (the median of 3
            processes twice, single runs; 55.7 once), ~49.5 MiB alone
            and ~67.5 estimated; 8 Dense(1024) at batch 16, two updates
            (16.4 MiB requested, ~16.6 estimated, ~8.6 alone). None when
            not estimated.
        peak_bytes_without: the same estimate without recompute.
        gradients_pile_up: why every gradient is alive at the end of the
            backward (`gradients_pile_up`: grappler's dependency optimizer
            is off, the step checks its gradients before its update, or
            the optimizer's update waits for every gradient, as with
            `global_clipnorm`), or None.
        eigen_convolutions: the model has convolutions and TensorFlow runs
            them with its own (Eigen) kernels, oneDNN being off (the
            default on CPUs without AVX-512), or in float16 with it on
            (`eigen_convolution_kernels`): the backward of each
            `Conv2D` allocates im2col working buffers of up to about 30 MiB
            (one for the filter's gradient, one for the input's), which
            the training peaks count at that convolution's moment
            (ResNet50 at 64x64, batch 16, "auto": 65.8-71 MiB requested,
            where the activations and gradients alone were estimated at
            52.5).
        eigen_dtypes: the compute dtypes of those convolutions, sorted
            names (`("float16",)`: oneDNN leaves them to Eigen even where
            it is on; `()` when there are none).
        xla_temporary_bytes: the largest temporary of the XLA backward of
            a depthwise convolution that Keras runs as a grouped one on a
            CPU (`depthwise.xla_backward_temporaries`), which the training
            peaks count at that convolution's moment, as every such
            layer's: no plan of recompute removes them;
            `compile(depthwise="chunked")` shrinks them and
            `compile(depthwise="native")` removes them (ConvNeXtTiny at 64x64,
            batch 16: ~220 MiB, where the activations are ~50); 0 when
            there is none.
        xla_temporary_layer: the name of that convolution, or None.
        xla_temporary_remedy: what the plan says of it
            (`depthwise.temporary_remedy`).
        working_buffer_bytes: what the working buffers of Eigen's
            convolution kernels (`eigen_convolutions`) add to `peak_bytes`:
            it less the same plan's estimate without them
            (`without_working_buffers`), about where oneDNN runs the
            convolutions (MobileNetV2 at 64x64, batch 16, "auto", oneDNN
            off: ~16.2 of its ~68.0 MiB); 0 when there are none, when an
            XLA depthwise temporary is counted too (`xla_temporary_bytes`
            says what removes it), or not estimated.
        lowest_unbuffered_bytes: with such buffers, for "auto" and a
            budget, the lowest training peak of the plans they chose among,
            each estimated again without the buffers
            (`budget.peaks_without_buffers`: the buffers bound what any
            plan saves, and a finer plan may then save more; MobileNetV2
            as above: ~25.3 MiB); None otherwise, and in a fit whose
            gradients pile up where the choice's did not (a NaNWatcher's).
        pointwise_convolutions: how many 1x1 `Conv2D` layers of the model
            run on Eigen's kernels that `compile(pointwise="matmul")` would
            run as matmuls, whose backward needs no such buffer
            (`pointwise.candidates`; 0 when it is on).
        measured_peak_bytes: after a `fit` at `batch_size`, the device
            allocator's peak during it above the level before it (activations,
            plus gradients, optimizer slots it created and temporaries), read
            once at its end; None before, or where the device's allocator
            keeps no statistics (on some CPUs, unless
            `TF_CPU_ALLOCATOR_USE_BFC=true`).
        measured_slot_bytes: of `measured_peak_bytes`, the bytes of the
            optimizer variables that fit created (a first fit with Adam: two
            of every weight's size; each replica's copy of a mirrored one
            where `measured_replicas` share the allocator), which no
            estimate counts; the plan's
            text compares the rest with the estimate. 0 when it created
            none; None with no measurement.
        measured_replicas: how many replicas' bytes `measured_peak_bytes`
            holds: 1, or a `MirroredStrategy`'s logical CPU devices, which
            share the CPU's allocator (the estimates are one replica's;
            the text compares with that many). None with no measurement.
    """

    setting: object
    batch_size: object = None
    blocks: list = dataclasses.field(default_factory=list)
    bytes_without: object = None
    bytes_with: object = None
    gradient_bytes: object = None
    peak_bytes: object = None
    peak_bytes_updates_alone: object = None
    peak_bytes_without: object = None
    measured_peak_bytes: object = None
    measured_slot_bytes: object = None
    measured_replicas: object = None
    gradients_pile_up: object = None
    eigen_convolutions: bool = False
    eigen_dtypes: tuple = ()
    xla_temporary_bytes: int = 0
    xla_temporary_layer: object = None
    xla_temporary_remedy: str = ""
    working_buffer_bytes: int = 0
    lowest_unbuffered_bytes: object = None
    pointwise_convolutions: int = 0

    @property
    def recomputed(self):
        """Names of the recomputed blocks."""
        return [b.name for b in self.blocks if b.recomputed]

    def __str__(self):
        lines = [f"Recompute plan (recompute={self.setting!r})"]
        if self.batch_size is None:
            lines.append("  blocks: " + (", ".join(self.recomputed) or "none"))
            if self.setting == "auto":
                lines.append(
                    "  not estimated (yet: no batch size, inputs of unknown shape, "
                    "or a forward the estimates do not trace): the blocks found "
                    "at compile"
                )
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
        if self.peak_bytes is not None and self.peak_bytes_without is not None:
            alive = (
                f"every gradient alive at the end of the backward ({self.gradients_pile_up})"
                if self.gradients_pile_up
                else "the gradients alive at each moment"
            )
            lines.append(
                f"  with {alive} (all: "
                f"{(self.gradient_bytes or 0) / MIB:.1f} MiB): ~{self.peak_bytes / MIB:.1f} "
                f"MiB training peak estimated (~{self.peak_bytes_without / MIB:.1f} "
                "MiB without recompute)"
            )
        if self._updates_alone_lower():
            lines.append(
                f"  ~{self.peak_bytes_updates_alone / MIB:.1f} MiB with each optimizer "
                "update alone: TensorFlow overlaps the updates of consecutive weights "
                "when the backward between their gradients is shorter than an update"
            )
        if self.xla_temporary_bytes:
            lines.append(
                f"  the training peaks include ~{self.xla_temporary_bytes / MIB:.1f} "
                "MiB that the XLA backward of the depthwise convolution "
                f"{self.xla_temporary_layer!r} allocates "
                + self.xla_temporary_remedy
            )
        if self.eigen_convolutions:
            why = _why_eigen(self.eigen_dtypes)
            lines.append(
                "  the training peaks include the working buffers of "
                f"TensorFlow's Eigen convolution kernels ({why}): up to ~30 MiB "
                "per Conv2D's backward, for its filter "
                "and again for its input (none for a 1x1 Conv2D that "
                'compile(pointwise="matmul") runs as a matmul)'
            )
            if self.peak_bytes and (
                self.working_buffer_bytes or self.lowest_unbuffered_bytes is not None
            ):
                lines.append(self._buffers_line())
        if self.measured_peak_bytes is not None:
            lines.append(self._measured_line())
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

    def _measured_line(self):
        """The last fit's allocator peak beside the estimate: without the
        optimizer slots the fit created (a first fit's Adam moments are
        twice the weights), which no estimate counts: ConvNeXtTiny's first
        fit (64x64, batch 16, "auto") read 4.08x the estimate with them,
        0.93x without."""
        slots = self.measured_slot_bytes or 0
        rest = self.measured_peak_bytes - slots
        line = (
            f"  measured in the last fit: allocator peak "
            f"{self.measured_peak_bytes / MIB:.1f} MiB above the level before it"
        )
        if slots:
            amount = f"{slots / MIB:.1f} MiB" if slots >= 0.05 * MIB else f"{slots / 1024:.1f} KiB"
            line += (
                f", of which ~{amount} the optimizer variables it "
                f"created (no estimate counts them): {rest / MIB:.1f} MiB of "
                "activations, gradients and temporaries"
            )
        else:
            line += " (activations, gradients and temporaries)"
        replicas = self.measured_replicas or 1
        if self.peak_bytes and replicas > 1:
            line += (
                f", {rest / (replicas * self.peak_bytes):.2f}x the estimate of "
                f"{replicas} replicas ({replicas} logical CPU devices share one "
                "allocator; the estimate is per replica)"
            )
        elif self.peak_bytes:
            line += f", {rest / self.peak_bytes:.2f}x the estimate"
        if self.peak_bytes and self._updates_alone_lower():
            line += (
                f" and {rest / (replicas * self.peak_bytes_updates_alone):.2f}x the "
                "one with each update alone"
            )
        return line + (
            " (the allocator reserves whole chunks: its peak reads above the "
            "bytes requested)"
        )

    def _updates_alone_lower(self):
        """Whether the estimate with each update alone is lower than
        `peak_bytes` (by 1% or more), so the plan shows both."""
        return bool(
            self.peak_bytes
            and self.peak_bytes_updates_alone is not None
            and self.peak_bytes_updates_alone < 0.99 * self.peak_bytes
        )

    def _buffers_line(self):
        """What the working buffers add to this plan's peak, and what plans
        reach without them."""
        unbuffered = self.peak_bytes - self.working_buffer_bytes
        line = (
            f"  they add ~{self.working_buffer_bytes / MIB:.1f} MiB to this plan's "
            f"training peak (~{unbuffered / MIB:.1f} MiB without them), which "
            "recompute cannot remove"
            if self.working_buffer_bytes
            else "  this plan's training peak is at none of them"
        )
        if self.lowest_unbuffered_bytes is not None and self.lowest_unbuffered_bytes < unbuffered:
            line += (
                "; without them the plans searched reach "
                f"~{self.lowest_unbuffered_bytes / MIB:.1f} MiB"
            )
        if self.pointwise_convolutions:
            n = self.pointwise_convolutions
            line += (
                f'; compile(pointwise="matmul") removes those of its {n} 1x1 '
                f"Conv2D layer{'s' * (n != 1)}"
            )
        return line


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
_CALLS = ("PartitionedCall", "StatefulPartitionedCall")


def _flops(op):
    """An op's cost: a contraction's FLOPs (`flops.op_flops`: a depthwise
    convolution sums over its window alone), else one per output element."""
    if op.type in _CONTRACTIONS:
        counted = flops_lib.op_flops(op)
        if counted:  # None (a shape unknown), 0.0 (an einsum of one operand)
            return counted
    return float(sum(_bytes(t) / max(1, t.dtype.size) for t in op.outputs))


# TensorFlow's own CPU kernels for a convolution's gradients (used where
# oneDNN is off; `Conv2DCustomBackpropFilterOp`, `Conv2DCustomBackpropInputOp`)
# allocate an im2col buffer for as many images as fit a 30 MiB working set;
# the input's kernel takes one image at a time instead when a thread's share
# of one image's matmul operands reaches a 256 KiB L2 cache.
_EIGEN_WORKING_SET = 30 << 20
_EIGEN_L2 = 256 << 10


def eigen_convolution_kernels(model=None, dtype=tf.float32):
    """Whether convolutions in `dtype` run on TensorFlow's own (Eigen) CPU
    kernels: no GPU, and oneDNN off (the default on CPUs without AVX-512;
    `TF_ENABLE_ONEDNN_OPTS=1` turns it on), or in float16, which these
    kernels run with oneDNN on too (ResNet50 under mixed_float16 on an AMD
    EPYC with AVX-512: two 22.2 MiB im2col buffers of a stage-2
    convolution's backward at the training peak; counted on every CPU, an
    estimate that may read high where oneDNN has float16 kernels); and for
    `model`'s training step, not compiled whole by XLA (`jit_compile=True`
    runs none of them)."""
    if getattr(model, "jit_compile", False) is True or precision.gpu_available():
        return False
    return hooks.onednn_enabled() is False or tf.as_dtype(dtype) == tf.float16


def _eigen_workspace(op, differentiable):
    """Bytes of the working buffers of the backward of the `Conv2D` `op` on
    TensorFlow's own CPU kernels, which run at once (MobileNetV2 at 64x64,
    batch 16, oneDNN off: both 23.9 MiB buffers of `block_2_project` alive
    at the training peak): when the kernel has a gradient (its name in
    `differentiable`), `Conv2DBackpropFilter`'s im2col buffer
    `[shard, out_h * out_w, kh * kw * in_channels]`, `shard` the images
    whose matmul operands fit `_EIGEN_WORKING_SET`; and, when the input has
    one, `Conv2DBackpropInput`'s, of the same shape or of one image
    (`_EIGEN_L2`). 0 for other ops."""
    if op.type != "Conv2D" or op.get_attr("data_format") != b"NHWC":
        return 0
    if any(d != 1 for d in op.get_attr("dilations")):
        return 0  # not these kernels
    kernel, output = op.inputs[1].shape, op.outputs[0].shape
    if not (kernel.is_fully_defined() and output.is_fully_defined()):
        return 0
    kh, kw, channels, filters = kernel
    image, patch = output[1] * output[2], kh * kw * channels
    itemsize = op.outputs[0].dtype.size
    per_image = image * patch + image * filters + patch * filters
    shard = -(-(_EIGEN_WORKING_SET // itemsize) // per_image)
    found = 0
    if op.inputs[1].name in differentiable:  # a frozen kernel has no gradient
        found += shard * image * patch * itemsize
    if op.inputs[0].name in differentiable:
        one_at_a_time = output[0] == 1 or per_image // cpu_threads.intra_op() >= (
            _EIGEN_L2 // itemsize
        )
        found += (1 if one_at_a_time else shard) * image * patch * itemsize
    return found


def _differentiable(operations, trainable):
    """Names of the float tensors that depend on a trainable variable (their
    gradients are computed), in a graph's `operations` (in creation order)."""
    found = set()
    for op in operations:
        # A variable's read, or a call that takes its handle (an XLA-compiled
        # grouped convolution), or anything downstream of one.
        if any(t.name in trainable or t.name in found for t in op.inputs):
            found.update(t.name for t in op.outputs if t.dtype.is_floating)
    return found


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

# `estimate`'s `pile_up` when not given.
_FROM_MODEL = object()


def estimate(
    model,
    forward,
    input_spec,
    keys,
    selective=False,
    owned=None,
    pile_up=_FROM_MODEL,
    update_buffers=0,
    update_buffers_alone=None,
):
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
        owned: per key, the trainable variables the block owns (its
            layer's), for `tied_inner_blocks`; None: not recorded.
        pile_up: why every gradient is alive at the end of the backward
            (`updates.gradients_pile_up`), or None; carried in the figures.
            Defaults to the model's (`updates.step_gradients_pile_up`).
        update_buffers: how many buffers of a weight's size the optimizer's
            update of one weight holds (`updates.update_temporaries`);
            carried in the figures, with `update_bytes` and
            `update_bytes_in_turn` (`updates.update_bytes`: what the updates
            hold beyond the gradients where those pile up, at once or in
            turn). Defaults to 0.
        update_buffers_alone: the same where the update runs alone
            (`updates.update_temporaries(..., alone=True)`); carried in the
            figures. Defaults to `update_buffers`.

    Returns:
        `(bytes_without, per_block, sizes)`: total cached bytes; per key a
        dict with `cached` and `inputs` (bytes), `kernel_cached` (bytes of
        the cached tensors that are kernel layers' outputs), `kernel_kept`
        (bytes of the kernel layers' outputs the block reads on, cached or
        not, which selective recompute keeps: a Dense before a gelu, whose
        gradient reads the gelu's own intermediates), `flops`, `inside` (names of the cached tensors
        made inside the block), `input_roots` (input
        tensor names to bytes), `weights` (the trainable variables it
        reads, by name, to their bytes), `largest` (bytes of its largest
        float tensor), `normalized` (bytes of the largest tensor a
        normalisation inside it squares for its statistics,
        `_normalizes`), `after` and `before` (`_place_outside_weights`),
        `outside_before` (`_place_outside_activations`), `own` (with
        `owned`: the names of the weights it owns); and
        the size of every cached tensor by name.
    """
    kind = {"keys": keys, "selective": selective, "owned": owned}
    return estimate_together(
        model, lambda x, probes: forward(x, probes[0]), input_spec, [kind], pile_up,
        update_buffers, update_buffers_alone,
    )[0]


def estimate_together(
    model, forward, input_spec, families, pile_up=_FROM_MODEL, update_buffers=0,
    update_buffers_alone=None,
):
    """`estimate` of several kinds of plan from one traced training step
    (tracing is most of an estimate's time: 3.4 s of MobileNetV2's at 32x32).

    Args:
        model, input_spec, pile_up, update_buffers, update_buffers_alone: as
            `estimate`'s.
        forward: `forward(x, probes)` runs the training forward on `x`,
            calling each block of kind `i` through `probes[i].run(key, ...)`.
        families: per kind, a dict of `estimate`'s `keys`, `selective` and
            `owned`.

    Returns:
        Per kind, `estimate`'s `(bytes_without, per_block, sizes)`.
    """
    probes = [_Probe() for _ in families]
    graph, backward_start = _trace_step(model, forward, probes, input_spec)
    step = _step_facts(
        model, graph, backward_start, pile_up, update_buffers, update_buffers_alone
    )
    return [
        _figures(step, probe, f["keys"], f.get("selective", False), f.get("owned"))
        for probe, f in zip(probes, families)
    ]


def _step_facts(model, graph, backward_start, pile_up, update_buffers, update_buffers_alone):
    """What every kind's figures read of the traced step, found once: the
    graph-wide walks (the tensors the backward keeps, the weights' handles,
    the backward's working buffers, the forward's working set) took 0.3 s
    per kind on a nested MobileNetV2. Nothing below changes them."""
    operations = graph.get_operations()
    _, cached = _live(graph, backward_start)
    trainable = _trainable_handles(graph, model)
    forward_ops = operations[:backward_start]
    workspace, anywhere = _workspaces(graph, forward_ops, trainable, model)
    if pile_up is _FROM_MODEL:
        pile_up = updates.step_gradients_pile_up(model)
    weights = [variable_bytes(v) for v in model.trainable_variables]  # in update order
    sizes = {name: _bytes(t) for name, t in cached.items()}
    return types.SimpleNamespace(
        graph=graph,
        operations=operations,
        forward_ops=forward_ops,
        cached=cached,
        sizes=sizes,
        total=sum(sizes.values()),
        trainable=trainable,
        workspace=workspace,
        anywhere=anywhere,
        index={op.name: i for i, op in enumerate(operations)},
        # The same in every block's figures.
        common={
            "forward_working": _forward_working(forward_ops, _bfloat16_widened()),
            "gradients_pile_up": pile_up,
            "update_buffers": update_buffers,
            "update_buffers_alone": (
                update_buffers if update_buffers_alone is None else update_buffers_alone
            ),
            "update_bytes": updates.update_bytes(weights, update_buffers, in_turn=False),
            "update_bytes_in_turn": updates.update_bytes(weights, update_buffers, in_turn=True),
        },
    )


def _figures(step, probe, keys, selective, owned):
    """`estimate`'s figures of the blocks `probe` recorded in the traced
    step (`_step_facts`)."""
    operations, cached = step.operations, step.cached
    # In the order the forward first calls them (`plan_bytes` needs it).
    first_call = {key: probe.calls[key][0][0] for key in keys if probe.calls.get(key)}
    ordered = sorted(keys, key=lambda k: first_call.get(k, len(operations)))
    per_block = {
        key: _block_figures(
            probe.calls.get(key, []), operations, cached, step.trainable, selective,
            step.workspace,
        )
        for key in ordered
    }
    _place_nested_blocks(per_block, probe.calls)
    for key in per_block if owned else ():
        per_block[key]["own"] = set(_handles(step.graph, owned.get(key, ())))
    _place_outside_weights(
        per_block, probe.calls, step.forward_ops, step.trainable, step.workspace
    )
    _place_outside_activations(per_block, probe.calls, cached, step.index)
    _place_within_parent(per_block, probe.calls, cached, operations, step.index)
    for figures in per_block.values():
        for field in ("workspace", "after_workspace", "before_workspace"):
            # A temporary not placed: at every moment.
            figures[field] = max(figures[field], step.anywhere)
        figures.update(step.common)
    return step.total, per_block, dict(step.sizes)


def variable_bytes(variable):
    """The bytes of a variable's value."""
    count = 1
    for d in variable.shape:
        count *= int(d)
    return count * tf.as_dtype(variable.dtype).size


def _forward_working(forward_ops, widens=False):
    """The largest working set of one forward operation: the float tensors
    it reads and writes, alive together. A floor under the training peak,
    whatever is recomputed: where the backward keeps little (a frozen
    keras.applications base, whose backward TensorFlow prunes), the peak is
    the forward's largest BatchNormalization or convolution with its input
    (MobileNetV2 at 64x64, batch 16: the moments gave 6.4 MiB where the
    steps requested 12.5). Weight reads and operations whose output shares
    its input's buffer (`_ALIASES`) are left out.

    Or, if larger, the weights' casts under a mixed policy: nothing holds
    them back, so TensorFlow casts every weight at the start of the step,
    and each lives until its layer's forward (8 Dense(1024) layers under
    mixed_bfloat16, recomputed: 16 MiB of casts at the start, where the
    moments gave 8.3 MiB). Where bfloat16 matmuls widen their operands to
    float32 (`widens`: `_bfloat16_widened()`; `_widened_bytes`), with the
    casts not yet read on top: the first of those layers' matmul widened
    its 2 MiB weight into a 4 MiB buffer beside the 16 MiB of casts (20.2
    MiB requested, 16.3 estimated without it)."""
    worst, casts, widened = 0, {}, []
    for index, op in enumerate(forward_ops):
        if op.type in _ALIASES or op.type in ("ReadVariableOp", "Const", "Placeholder"):
            continue
        if op.type == "Cast" and _from_weight(op.inputs[0]):
            if op.outputs[0].dtype.is_floating:  # once per weight and dtype
                casts[(_weight_handle(op.inputs[0]), op.outputs[0].dtype)] = _bytes(op.outputs[0])
            continue
        reads = [t for t in op.inputs if not _from_weight(t)]
        working = sum(_bytes(t) for t in list(op.outputs) + reads if t.dtype.is_floating)
        worst = max(worst, working)
        extra = _widened_bytes(op) if widens else 0
        if extra:
            widened.append((index, working + extra))
    worst = max(worst, sum(casts.values()))
    last_read = {}  # per weight's cast, the last forward op that reads it
    for index, op in enumerate(forward_ops if widened else ()):
        for t in op.inputs:
            if t.dtype.is_floating and _from_weight(t):
                last_read[(_weight_handle(t), t.dtype)] = index
    for index, working in widened:  # the casts not yet read (its own too), beside it
        alive = sum(b for key, b in casts.items() if last_read.get(key, -1) >= index)
        worst = max(worst, alive + working)
    return worst


def _widened_bytes(op):
    """The float32 buffers a bfloat16 matmul `op` allocates on TensorFlow's
    own CPU kernels (oneDNN off) where the CPU has no bfloat16 instructions
    (`_bfloat16_widened`, asked by the caller): its operands and its
    product widened (an AMD EPYC with AVX2, a Dense(1024) at batch 16: a 4
    MiB buffer for its 2 MiB weight). 0 for other ops, or where a shape is
    unknown."""
    if op.type not in flops_lib.MATMULS or op.outputs[0].dtype != tf.bfloat16:
        return 0
    shapes = [t.shape for t in list(op.inputs[:2]) + [op.outputs[0]]]
    if not all(shape.is_fully_defined() for shape in shapes):
        return 0
    return sum(4 * shape.num_elements() for shape in shapes)


def _bfloat16_widened():
    """Whether bfloat16 matmuls run widened to float32 here (`_widened_bytes`):
    not on a GPU, nor with oneDNN on (whose conversions are not seen here),
    nor on a CPU with bfloat16 instructions."""
    return (
        not precision.gpu_available()
        and hooks.onednn_enabled() is False
        and not precision.cpu_has_native_bfloat16()
    )


def _weight_handle(tensor):
    """The name of the variable handle whose value `tensor` is (through
    casts and reshapes; `_from_weight`)."""
    read = _weight_root(tensor)
    return read.op.inputs[0].name if read.op.inputs else read.name


def without_working_buffers(per_block):
    """Copies of the figures `per_block` without the working buffers of the
    backward (`_workspaces`): `plan_bytes` of them estimates a step that
    allocates none (oneDNN's convolutions, no XLA depthwise temporaries)."""
    return {
        key: {**figures, "workspace": 0, "after_workspace": 0, "before_workspace": 0}
        for key, figures in per_block.items()
    }


def _with_floor(peak, per_block, gradient_bytes):
    """A plan's `peak`, and for a training peak (`gradient_bytes` given) at
    least `_forward_working`, as the figures carry it (0 without blocks)."""
    if gradient_bytes is None:
        return peak
    return max(peak, max((f.get("forward_working", 0) for f in per_block.values()), default=0))


def _workspaces(graph, forward_ops, trainable, model):
    """Per forward op name, the working buffers its backward allocates:
    those of TensorFlow's own convolution kernels where they run
    (`_eigen_workspace`, `eigen_convolution_kernels`), and the temporaries
    of the XLA backward of a depthwise convolution Keras runs as a grouped
    one, on its XLA call (`depthwise.xla_backward_temporaries`; in slices,
    `depthwise="chunked"`, on each slice's call).

    Returns:
        `(found, anywhere)`: the dict, and the largest temporary whose op
        was not found in the graph (counted at every moment).
    """
    found, anywhere = {}, 0
    eigen = [
        op
        for op in forward_ops
        if op.type == "Conv2D" and eigen_convolution_kernels(model, op.outputs[0].dtype)
    ]
    if eigen:
        differentiable = _differentiable(forward_ops, trainable)
        for op in eigen:
            size = _eigen_workspace(op, differentiable)
            if size:
                found[op.name] = size
    # Per function call, the handles it reads: given, or sliced ("chunked").
    reads = {
        op: {name for t in op.inputs for name in (t.name, _sliced_weight(t))}
        for op in forward_ops
        if op.type in _CALLS
    }
    for layer, size in depthwise.xla_backward_temporaries(model):
        kernel = set(_handles(graph, [layer.kernel]))
        calls = [op for op, names in reads.items() if kernel & names]
        for op in calls:
            found[op.name] = found.get(op.name, 0) + size
        if not calls:
            anywhere = max(anywhere, size)
    return found, anywhere


def _place_nested_blocks(per_block, calls):
    """Adds to each block's figures `parent`: the key of the innermost
    other block whose calls hold all of its calls (None: a block at the
    top). Such a block is recomputed inside its parent's replay when both
    are chosen (`mechanism`), and its activations are among its parent's."""
    spans = {key: [(start, end) for start, end, _, _ in calls.get(key, [])] for key in per_block}
    order = {key: i for i, key in enumerate(per_block)}
    for key, figures in per_block.items():
        holders = [
            other
            for other in per_block
            if other != key
            and spans[key]
            and all(any(s <= a and b <= e for s, e in spans[other]) for a, b in spans[key])
            # The same calls (a wrapper and its only layer): the first in the
            # forward's order holds the other.
            and (spans[other] != spans[key] or order[other] < order[key])
        ]
        # The innermost: the holder with the shortest span (of equal ones,
        # the last in the forward's order).
        figures["parent"] = min(
            holders, key=lambda k: (sum(e - s for s, e in spans[k]), -order[k]), default=None
        )


def tied_inner_blocks(per_block):
    """The keys of the nested blocks that read a weight owned by another
    layer of a block holding them (a tied projection): recomputed inside
    that block's replay, the weight's gradient through them would be lost,
    so the mechanism refuses them there, and "auto" leaves them out. Needs
    `estimate(..., owned=...)`."""
    tied = []
    for key, figures in per_block.items():
        ancestors, up = set(), figures.get("parent")
        while up is not None:
            ancestors |= per_block[up].get("own", set())
            up = per_block[up].get("parent")
        if set(figures["weights"]) & (ancestors - figures.get("own", set())):
            tied.append(key)
    return tied


def _place_outside_activations(per_block, calls, cached, index):
    """Adds to each block's figures `outside_before`: the bytes of the cached
    activations made outside every block until the end of its last call
    (its outputs included: its own backward may read them). Those made
    after it (a later block's surroundings, a head) are freed by the time
    the backward reaches it. `index`: the traced operations' positions, by
    name."""
    inside = set().union(*(figures["inside"] for figures in per_block.values()))
    made = [
        (index[t.op.name], _bytes(t)) for name, t in cached.items() if name not in inside
    ]
    for key, figures in per_block.items():
        end = calls[key][-1][1] if calls.get(key) else len(index)
        figures["outside_before"] = sum(size for i, size in made if i < end)


def _place_within_parent(per_block, calls, cached, operations, index):
    """Adds to each nested block's figures `parent_before`, `parent_outputs`
    and `parallel`: the bytes of its parent's own cached activations (in
    none of the parent's nested blocks) made before its call or after it
    but not from it, and made during its call (its outputs); and the
    parent's other nested blocks after it that do not depend on it. When
    the backward reaches it, what the parent made from it afterwards is
    freed, and its outputs too when it is recomputed (the replay makes
    them again), while its own backward may read them when it is not.
    keras-hub GPT-2 (2 layers, 16 x 128 tokens, "auto"): the feed-forward
    replay ran without its forward output (8 MiB) and the layer's output
    projection, Dropout and residual sum (58.1 MiB requested, 69.6
    estimated with them). Not for a block called more than once, nor in a
    parent called more than once: between the calls everything stays.
    `index`: the traced `operations`' positions, by name."""
    parents = {key: figures.get("parent") for key, figures in per_block.items()}
    for parent, nested in _children(parents).items():
        if not nested or any(len(calls.get(key, ())) != 1 for key in [parent] + nested):
            continue
        stop = calls[parent][0][1]
        theirs = set().union(*(per_block[key]["inside"] for key in nested))
        own = [
            (index[cached[name].op.name], _bytes(cached[name]))
            for name in per_block[parent]["inside"] - theirs
        ]
        for key in nested:
            start, end = calls[key][0][:2]
            later = _dependent_ops(operations, index, start, end, stop)
            figures = per_block[key]
            figures["parent_before"] = sum(
                size for i, size in own if i < start or (i >= end and i not in later)
            )
            figures["parent_outputs"] = sum(size for i, size in own if start <= i < end)
            figures["parallel"] = [
                other
                for other in nested
                if calls[other][0][0] >= end
                and not later.intersection(range(*calls[other][0][:2]))
            ]


def _dependent_ops(operations, index, start, end, stop):
    """The indices of the operations in `[start, stop)` that are the ones in
    `[start, end)` or depend on them (through data or control inputs)."""
    found = set(range(start, end))
    for i in range(end, stop):
        op = operations[i]
        ups = [t.op for t in op.inputs] + list(op.control_inputs)
        if any(index.get(up.name) in found for up in ups):
            found.add(i)
    return found


def _place_outside_weights(per_block, calls, forward_ops, trainable, workspace=None):
    """Adds to each block's figures `after`: the trainable weights read
    outside every block between its calls and the next block's (or the
    end; a stem's, a head's), by name, to bytes; and to the first block's
    `before`: those read before any block (their gradients come last).
    Likewise `after_workspace` and `before_workspace`: the largest working
    buffers of the backward of an op there (`workspace`, by op name)."""
    ranges = sorted(  # of the blocks at the top: a nested block's are its parent's
        (start, end, key)
        for key in per_block
        if per_block[key].get("parent") is None
        for start, end, _, _ in calls.get(key, [])
    )
    inside = set()
    for figures in per_block.values():
        figures["after"], figures["before"] = {}, {}
        figures["after_workspace"] = figures["before_workspace"] = 0
        inside |= set(figures["weights"])
    workspace = workspace or {}
    position = {op.name: i for i, op in enumerate(forward_ops)} if workspace else {}
    for name, size in workspace.items():
        index = position[name]
        if any(start <= index < end for start, end, _ in ranges) or not per_block:
            continue
        previous = [key for start, end, key in ranges if end <= index]
        key, side = (previous[-1], "after") if previous else (next(iter(per_block)), "before")
        figures = per_block[key]
        figures[f"{side}_workspace"] = max(figures[f"{side}_workspace"], size)
    for index, op in enumerate(forward_ops):
        name = op.inputs[0].name if op.type == "ReadVariableOp" and op.inputs else None
        if name not in trainable or name in inside:
            continue
        inside.add(name)
        previous = [key for start, end, key in ranges if end <= index]
        if previous:
            per_block[previous[-1]]["after"][name] = trainable[name]
        elif per_block:
            per_block[next(iter(per_block))]["before"][name] = trainable[name]


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
    it as `forward` runs it (a selective plan's replay included); both walk
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
    return _live(graph, backward_start)


def _live(graph, backward_start):
    """`live_backward` of a traced step's `graph`: the backward operations
    its outputs (the gradients) need, walked back from them, and the forward
    tensors they read. Backward operations nothing needs (the gradients
    through a frozen `keras.applications` base, whose variables the tape
    still watches) are dead code that TensorFlow prunes: what they read is
    not kept."""
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


def _trainable_handles(graph, model):
    """The traced graph's placeholders of the trainable variables' handles,
    by name, to the variable's bytes (a distributed variable's: any of its
    replicas'). A variable not found is left out: its gradient then counts
    as alive throughout the backward (`plan_bytes`)."""
    return _handles(graph, model.trainable_variables)


def _handles(graph, variables):
    """`_trainable_handles` of the given variables."""
    sizes = {}
    for v in variables:
        value = v.value  # a tf.Variable, or a distributed variable
        for component in getattr(value, "values", None) or (value,):
            handle = getattr(component, "handle", None)
            if handle is not None:
                sizes[id(handle)] = _bytes(value)
    return {
        internal.name: sizes[id(external)]
        for external, internal in graph.captures
        if id(external) in sizes
    }


_WEIGHT_PATH = _ALIASES | {"Cast"}


def _by_weight(op):
    """Whether a matmul or convolution multiplies by a weight (a variable's
    value, through casts and reshapes): a kernel layer's. Also the join
    of Keras' convolutions on slices of a weight (`depthwise="chunked"`:
    a `ConcatV2` of function calls, each given a slice)."""
    if op.type == "ConcatV2":
        calls = [_root(t).op for t in op.inputs[:-1]]
        if not calls or any(call.type not in _CALLS for call in calls):
            return False
        # One slice of one split of one weight per call, all of them.
        slices = [[t for t in call.inputs if _sliced_weight(t)] for call in calls]
        if any(len(found) != 1 for found in slices):
            return False
        splits = {_weight_root(found[0]).op for found in slices}
        return len(splits) == 1 and len(next(iter(splits)).outputs) == len(calls)
    return op.type in _CONTRACTIONS and any(_from_weight(t) for t in op.inputs)


def _sliced_weight(tensor):
    """The name of the variable handle whose value `tensor` is a slice of
    (`SplitV` of a `ReadVariableOp`, through casts and reshapes:
    `depthwise="chunked"`), or None."""
    root = _weight_root(tensor)
    if root.op.type != "SplitV":
        return None
    value = _weight_root(root.op.inputs[0])
    return value.op.inputs[0].name if value.op.type == "ReadVariableOp" else None


def _from_weight(tensor):
    """Whether `tensor` is a variable's value (through casts and reshapes)."""
    return _weight_root(tensor).op.type == "ReadVariableOp"


def _weight_root(tensor):
    """`tensor` followed back through casts and reshapes (`_WEIGHT_PATH`)."""
    while tensor.op.type in _WEIGHT_PATH and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    return tensor


_BIAS_ADDS = ("BiasAdd", "AddV2", "Add")


def _bias_added(op):
    """The contraction a bias add (`op`) adds a weight to, or None."""
    if op.type in _BIAS_ADDS and len(op.inputs) == 2:
        a, b = op.inputs
        for value, bias in ((a, b), (b, a)):
            if _from_weight(bias) and _by_weight(_root(value).op):
                return _root(value).op
    return None


def _consumers(op):
    """The operations that read `op`'s outputs, through reshapes and
    identities."""
    found, pending = [], [c for t in op.outputs for c in t.consumers()]
    while pending:
        c = pending.pop()
        if c.type in _ALIASES:
            pending.extend(cc for t in c.outputs for cc in t.consumers())
        else:
            found.append(c)
    return found


def _kernel_output(tensor):
    """Whether `tensor` is a kernel layer's output before its activation,
    which a selective replay takes from the forward instead of rebuilding:
    a contraction by a weight, or that plus a bias. Not the depthwise half
    of a separable convolution, which feeds the pointwise one: its replay
    rebuilds it. (Missed, so counted as rebuilt: a transposed convolution,
    a grouped one Keras runs as a function call, and one in slices whose
    batch has no fixed size (`depthwise="chunked"`'s `tf.cond`); found in
    slices otherwise, `_by_weight`.)"""
    op = _root(tensor).op
    contraction = _bias_added(op)
    if contraction is None:
        if any(_bias_added(c) is op for c in _consumers(op)):
            return False  # a contraction a bias is added to
        contraction = op
    return _kept_contraction(contraction)


def _kept_contraction(op):
    """Whether `op` is a kernel layer's contraction by a weight whose
    output selective recompute keeps: not the depthwise half of a separable
    convolution (it feeds the pointwise one), which the replay runs."""
    return _by_weight(op) and not (
        op.type == "DepthwiseConv2dNative" and any(_by_weight(c) for c in _consumers(op))
    )


def _block_figures(calls, operations, cached, trainable, selective=False, workspace=None):
    """One block's figures (see `estimate`) from its `_Probe` calls;
    `trainable` maps the trainable variables' handles to their bytes,
    `workspace` forward op names to their backward's working buffers."""
    inside, outputs, input_roots, flops, weights = set(), set(), {}, 0.0, {}
    largest, convolutions, made, normalized = 0, [], [], 0
    workspace = workspace or {}
    own_ops = {op.name for start, end, _, _ in calls for op in operations[start:end]}
    kernel_kept = {}
    for start, end, inputs, outs in calls:
        outputs |= {_root(t).name for t in outs}
        for t in inputs:
            if t.dtype.is_floating:
                input_roots[_root(t).name] = _bytes(t)
                largest = max(largest, _bytes(t))
        for op in operations[start:end]:
            if workspace.get(op.name):
                convolutions.append((len(made), workspace[op.name]))
            made.extend(t.name for t in op.outputs if t.name in cached)
            if not (selective and _kept_contraction(op)):
                flops += _flops(op)
            if op.type == "ReadVariableOp":
                if op.inputs[0].name in trainable:
                    weights[op.inputs[0].name] = trainable[op.inputs[0].name]
                continue
            if _normalizes(op):
                normalized = max(normalized, _bytes(op.inputs[0]))
            for t in op.outputs:
                if t.dtype.is_floating and op.type != "Const":
                    largest = max(largest, _bytes(t))
                    # What a selective replay keeps: a kernel output made
                    # here that the rest of the block reads on.
                    if (
                        (op.type in _BIAS_ADDS or _by_weight(op))
                        and _root(t).op.name in own_ops
                        and _kernel_output(t)
                        and _read_on(t, own_ops)
                    ):
                        kernel_kept[_root(t).name] = _bytes(t)
                if t.name in cached and t.name not in outputs:
                    inside.add(t.name)
    inside -= outputs | set(input_roots)
    for name in outputs | set(input_roots):
        kernel_kept.pop(name, None)
    # A convolution's backward comes when the block's activations made from
    # it on are freed: its buffers raise the block's moment by what they
    # exceed those by.
    buffers = 0
    for index, size in convolutions:
        later = sum(_bytes(cached[n]) for n in set(made[index:]) & inside)
        buffers = max(buffers, size - later)
    return {
        "cached": sum(_bytes(cached[n]) for n in inside),
        "kernel_cached": sum(_bytes(cached[n]) for n in inside if _kernel_output(cached[n])),
        "kernel_kept": sum(kernel_kept.values()),
        "inputs": sum(input_roots.values()),
        "flops": flops,
        "inside": inside,
        "input_roots": input_roots,
        "weights": weights,
        "largest": largest,
        "normalized": normalized,
        "workspace": buffers,
    }


# Ops whose gradient reads none of their inputs' values: a tensor they
# alone read is needed by a replay only where what they make is read on.
_PASSING = _ALIASES | {
    "AddV2", "Add", "AddN", "Sub", "Neg", "ConcatV2", "Transpose", "Cast", "Pad",
    "PadV2", "Slice", "StridedSlice", "Pack", "Split", "SplitV", "Tile",
}
# Ops that read their input's shape only.
_SHAPE_ONLY = {"Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike"}


def _read_on(tensor, own_ops, seen=None):
    """Whether a replay of the block whose ops are `own_ops` needs
    `tensor`: an op of the block reads it whose gradient reads its
    inputs, or one that passes it on (an add, a concatenation, a reshape)
    into something the block reads on; not a last projection before the
    block's residual add, nor a convolution's output the block's closing
    concatenation passes out (DenseNet's)."""
    seen = set() if seen is None else seen
    for consumer in tensor.consumers():
        if consumer.name not in own_ops or consumer.name in seen:
            continue
        seen.add(consumer.name)
        if consumer.type in _SHAPE_ONLY:
            continue
        if consumer.type not in _PASSING:
            return True
        passed = consumer.outputs
        if consumer.type == "IdentityN":  # the matching output only
            passed = [consumer.outputs[i] for i, t in enumerate(consumer.inputs) if t is tensor]
        if any(_read_on(t, own_ops, seen) for t in passed):
            return True
    return False


def _normalizes(op):
    """Whether `op` squares a tensor for a mean (`Square` or
    `SquaredDifference` into a `Mean`): a normalisation's variance or mean
    square (BatchNormalization's and LayerNormalization's moments, an RMS
    norm's), not a pooling's mean nor a squeeze-and-excitation's. Its
    backward sums several gradients of the tensor's size (the gradient
    times the scale, the mean's broadcast gradient, the variance's), alive
    together. (A synchronized BatchNormalization sums instead: missed.)"""
    if op.type not in ("Square", "SquaredDifference") or not op.inputs[0].dtype.is_floating:
        return False
    return any(c.type == "Mean" for c in op.outputs[0].consumers())


def plan_bytes(
    total, per_block, sizes, chosen, gradient_bytes=None, layout=None, alone=False
):
    """Estimated peak activation bytes when the `chosen` keys are recomputed
    (with `gradient_bytes`, the training peak: activations and gradients).

    The backward pass runs the blocks from the last (`per_block`'s order is
    the forward's) to the first: when it reaches a block, the blocks after
    it have freed what they kept, and this block's activations are all
    alive (kept, or rebuilt when it is recomputed; a chosen block nested
    in it holds only its inputs until its own replay, `_nested_moments`),
    with the activations made outside every block until its end
    (`outside_before`: its outputs among them; those made after it are
    freed; figures without it count them all at every moment). The peak
    is the largest of those moments and the end of the forward, on top of
    the recomputed blocks' inputs (a training peak: at least the forward's
    largest operation, `_forward_working`). So recomputing the last block saves at
    most what is made after it (a head's activations, freed before its
    replay): its rebuild comes first, while everything else is still kept.

    Gradients: TensorFlow's executor runs each variable's optimizer update
    as soon as its gradient exists, so gradients do not pile up (unless
    grappler's dependency optimizer is off, or the update waits for every
    gradient: `updates.gradients_pile_up`; then the updates run at the
    end, their buffers with every gradient, `updates.update_bytes`: in turn
    after GradBoostModel's check, each moment having the gradients made
    until it, `_gradients_until_checked`; else at once, every gradient
    counted at every moment). At the
    moment of a block, the gradients of the weights it reads are counted
    alive (or, if more, the largest one's with the buffers of its update,
    `updates.update_temporaries`, and the next weight's gradient, which the
    backward makes meanwhile), and the gradient flowing through it (as
    large as its largest tensor). Weights read outside every block have
    moments of their own: a head's (after a block) before that block's,
    with what the blocks before it keep; a stem's (before any block) last,
    alone. Weights not placed count throughout.

    Args:
        total: bytes of all cached activations (`estimate`).
        per_block: the blocks' figures, in the forward's order.
        sizes: the size of every cached tensor by name.
        chosen: the keys of the recomputed blocks.
        gradient_bytes: bytes of all the trainable variables' gradients, or
            None for the activations alone.
        layout: `plan_layout(per_block, gradient_bytes)`, where many plans
            of one layout are estimated (`budget.candidates`: the gradients'
            moments were 55% of a nested MobileNetV2's 3225 plans' time).
            Defaults to `None` (found here).
        alone: count each optimizer update alone: at each moment, the
            largest gradient with its buffers where it runs alone
            (`updates.update_temporaries`' `alone`), neither the next
            gradient beside it nor the sum of the moment's gradients (each
            freed by its own update first). TensorFlow's executor
            overlaps consecutive updates, or not, by how long the backward
            between their gradients takes against them; this is the low
            end, the default the high one. Defaults to `False`.

    Returns:
        An int, bytes.
    """
    if layout is None:
        layout = plan_layout(per_block, gradient_bytes)
    elif layout.per_block is not per_block:
        raise ValueError(
            "plan_bytes: `layout` was found for other figures than `per_block`; "
            "pass plan_layout(per_block, gradient_bytes)."
        )
    elif layout.gradient_bytes != gradient_bytes:
        raise ValueError(
            f"plan_bytes: `layout` was found for other gradient bytes "
            f"({layout.gradient_bytes}, here {gradient_bytes}); pass "
            "plan_layout(per_block, gradient_bytes)."
        )
    chosen = set(chosen)
    dropped = set()
    for key in chosen:
        dropped |= per_block[key]["inside"]
    kept = total - sum(sizes[name] for name in dropped)
    parent = layout.parent
    extra = {}
    for key in chosen:
        if _chosen_ancestor(key, parent, chosen):
            continue  # its inputs are among its ancestor's rebuilt activations
        for name, size in per_block[key]["input_roots"].items():
            if name not in sizes or name in dropped:
                extra[name] = size
    held, inside = _nested_moments(per_block, layout.children, chosen)
    top = layout.top
    kept_inside = {key: 0 if key in chosen else held[key] for key in top}
    outside_at = _outside(per_block, max(0, kept - sum(kept_inside.values())))
    gradients = _block_gradients(top, gradient_bytes, alone=True) if alone else layout.gradients
    worst, unplaced = _backward_peak(top, kept_inside, inside, outside_at, gradients)
    return _with_floor(sum(extra.values()) + worst + unplaced, per_block, gradient_bytes)


def plan_layout(per_block, gradient_bytes=None):
    """What `plan_bytes` reads of the figures `per_block` whatever is
    recomputed: the blocks' nesting, the top-level blocks, and the
    gradients alive at each moment of the backward (`_block_gradients`)."""
    parent = {key: per_block[key].get("parent") for key in per_block}
    top = {key: per_block[key] for key in per_block if parent[key] is None}
    return types.SimpleNamespace(
        per_block=per_block,
        gradient_bytes=gradient_bytes,
        parent=parent,
        children=_children(parent),
        top=top,
        gradients=_block_gradients(top, gradient_bytes),
    )


def _outside(per_block, outside):
    """`outside_at(key)`: the bytes made outside every block (of `outside`
    in all) until `key`'s end, alive then; all of them for None."""

    def outside_at(key):
        if key is None:
            return outside
        return min(outside, per_block[key].get("outside_before", outside))

    return outside_at


def _backward_peak(top, holds, moment, outside_at, gradients):
    """The largest moment of the backward (`plan_bytes`) over the top-level
    blocks `top` (their figures, in the forward's order): at the end of the
    forward, each block holds `holds[key]`; when the backward is inside a
    block, that block has `moment[key]` alive, with the blocks before it
    holding theirs and the gradients of that moment (`gradients`:
    `_block_gradients` of `top`).

    Returns:
        `(worst, unplaced)`: bytes, and those of the gradients not placed
        (alive throughout).
    """
    keys = list(top)
    grads, after, first, unplaced = gradients
    worst = max(
        outside_at(None) + sum(holds.values()),  # the end of the forward
        outside_at(keys[0] if keys else None) + first,
    )
    before = 0
    for i, key in enumerate(keys):
        worst = max(worst, outside_at(key) + before + moment[key] + grads[key])
        before += holds[key]
        following = keys[i + 1] if i + 1 < len(keys) else None
        worst = max(worst, outside_at(following) + before + after[key])
    return worst, unplaced


def _chosen_ancestor(key, parent, chosen):
    while parent.get(key) is not None:
        key = parent[key]
        if key in chosen:
            return True
    return False


def _children(parent):
    """Per key of `parent` (key -> the key of its parent block, or None),
    the keys whose parent it is, in `parent`'s order."""
    children = {key: [] for key in parent}
    for key, up in parent.items():
        if up is not None:
            children[up].append(key)
    return children


def _nested_moments(per_block, children, chosen):
    """Per block, `(held, moment)`: the bytes of its activations alive when
    the backward enters it (kept, or rebuilt when it is recomputed; its
    chosen nested blocks' own activations left out, their inputs in), and
    the most alive while the backward is inside it (a nested block's
    replay, or a nested block's own nested replays, on top). `children`:
    per block, its nested blocks (`_children`)."""
    held, moment = {}, {}

    def visit(key):
        if key in held:
            return
        base, mine = per_block[key]["cached"], {}
        for child in children[key]:
            visit(child)
            mine[child] = 0 if child in chosen else held[child]
            base -= per_block[child]["cached"] - mine[child]
        own = base - sum(mine.values())  # made in none of its nested blocks
        peak, earlier = base, 0
        for child in children[key]:  # in the forward's order
            # Inside it, what the block made from it afterwards is freed,
            # and its outputs when it replays (`_place_within_parent`;
            # without the figures: all the block's own, and the others').
            figures = per_block[child]
            before = figures.get("parent_before")
            if before is None:
                alive = base - mine[child]
            else:
                if child not in chosen:
                    before += figures["parent_outputs"]
                # Its siblings before it, and those after it not made from
                # it, whose backward may run alongside (parallel branches).
                beside = sum(mine[other] for other in figures.get("parallel", ()))
                alive = min(own, before) + earlier + beside
            peak = max(peak, alive + moment[child])
            earlier += mine[child]
        held[key], moment[key] = base, peak

    for key in per_block:
        visit(key)
    return held, moment


def with_pile_up(per_block, pile_up):
    """Copies of the figures with `gradients_pile_up` set to `pile_up`."""
    return {key: {**figures, "gradients_pile_up": pile_up} for key, figures in per_block.items()}


def _block_gradients(per_block, gradient_bytes, alone=False):
    """The gradients alive at each moment of the backward (`plan_bytes`),
    all zero when `gradient_bytes` is None; with `alone`, each update
    counted alone (`plan_bytes`' `alone`).

    Returns:
        `(grads, after, first, unplaced)`: per key, the bytes of the
        gradients alive at the block's moment (its weights', a weight read
        by several blocks counted with the first in the forward, and the
        gradient flowing through it, as large as its largest tensor); per
        key, those of the weights read after it, outside every block (their
        moment comes before the block's); those of the weights read before
        any block (the last moment); and those of the weights not placed
        (alive throughout).
    """
    keys = list(per_block)
    if gradient_bytes is None:
        return dict.fromkeys(keys, 0), dict.fromkeys(keys, 0), 0, 0
    # The working buffers of a convolution's backward (`_eigen_workspace`)
    # are alive at its moment too.
    buffers = {key: figures.get("workspace", 0) for key, figures in per_block.items()}
    after_buffers = {key: figures.get("after_workspace", 0) for key, figures in per_block.items()}
    first = max((figures.get("before_workspace", 0) for figures in per_block.values()), default=0)
    pile_up = {f.get("gradients_pile_up") for f in per_block.values()} - {None}
    if pile_up == {updates.CHECKED}:
        return _gradients_until_checked(per_block, gradient_bytes, buffers, after_buffers, first)
    if pile_up:
        # The updates run at once when the backward ends: their buffers on
        # top of every gradient (`updates.update_bytes`), counted at every
        # moment. Many updates' temporaries then overlap, which only the
        # largest's stand for; the activations counted with them made up
        # for it (ResNet50, "auto", grappler's dependency optimizer off:
        # 145.4 MiB requested, 145.5 estimated; by the moments, as below,
        # 126.3).
        update = max((f.get("update_bytes", 0) for f in per_block.values()), default=0)
        return buffers, after_buffers, first, gradient_bytes + update
    # Each update runs as its gradient arrives, with its buffers (Adam's
    # temporaries; a copy of the weight when the backward still reads it):
    # at a moment, its weights' gradients, or the largest one with its
    # update's buffers, whichever is more (a sum of both read 0.74x of the
    # peak measured on ResNet50, whose stage-5 blocks hold 23 MiB of them).
    # While that update runs, the backward goes on to the next weight's
    # gradient (`_following`): 8 Dense(1024) at batch 16 with Adam
    # requested 16.4 MiB, two gradients and two temporaries, where 12.6
    # was estimated without it (alive at the peak: one gradient with its
    # update's Square, the last part of the previous update). Alone: the
    # largest gradient with its buffers, nothing beside, not even the
    # moment's other gradients, each freed by its own update before
    # (ConvNeXtTiny's 9 MiB kernels, the backward of two 302 MFLOP matmuls
    # between them; ResNet50's stage 5 on an AVX2 CPU: one 9 MiB gradient
    # and its Square alive where a segment's gradients summed 34 MiB).
    field = "update_buffers_alone" if alone else "update_buffers"
    buffers_per_byte = max(
        (f.get(field, f.get("update_buffers", 0)) for f in per_block.values()), default=0
    )

    def with_update(weights, following):
        largest = max(weights.values(), default=0)
        if not largest or not buffers_per_byte:
            return sum(weights.values())
        if alone:
            return (1 + buffers_per_byte) * largest
        return max(sum(weights.values()), (1 + buffers_per_byte) * largest + following)

    placed, mine, stem = {}, {}, {}
    for key, figures in per_block.items():
        for field in ("weights", "after", "before"):
            new = {n: b for n, b in figures.get(field, {}).items() if n not in placed}
            if field == "before":
                stem.update(new)
            else:
                mine[key, field] = new
            placed.update(new)
    # The moments in the backward's order: a block's head, then the block.
    order = [(key, field) for key in reversed(list(per_block)) for field in ("after", "weights")]
    mine["stem"] = stem
    following = dict(zip(order + ["stem"], _following([mine[m] for m in order + ["stem"]])))
    grads, after = {}, {}
    for key in per_block:
        after[key] = with_update(mine[key, "after"], following[key, "after"]) + after_buffers[key]
        grads[key] = (with_update(mine[key, "weights"], following[key, "weights"])
                      + per_block[key].get("largest", 0) + buffers[key])
    first += with_update(stem, following["stem"])
    return grads, after, first, max(0, gradient_bytes - sum(placed.values()))


def _following(moments):
    """Per moment of the backward (`moments`: the weights' gradient bytes
    by name, in the backward's order), the largest gradient the backward
    may make while the update of the moment's largest weight runs: another
    weight's of that moment, or the largest of the next moment that has
    weights."""
    following, later = [], 0  # the largest of the next moment with weights
    for weights in reversed(moments):
        sizes = sorted(weights.values(), reverse=True)
        following.append(max(sizes[1:2] + [later]))
        later = sizes[0] if sizes else later
    return following[::-1]


def _gradients_until_checked(per_block, gradient_bytes, buffers, after_buffers, first):
    """`_block_gradients` where every gradient waits for a check and the
    updates then run in turn (`updates.CHECKED`, `step.updates_in_turn`):
    at each moment of the backward, the gradients made so far (those of the
    weights read after the block, its own, and the gradient flowing through
    it); at its end, all of them with the updates' buffers in turn
    (`updates.update_bytes`). Every gradient counted at every moment read
    high without recompute, where the activations are most before most
    gradients exist: ResNet50 (64x64, batch 16, Adam) under a NaNWatcher
    172.7-181.1 MiB requested, 194.9 estimated, 172.4 now (up to 1.05x
    low); under mixed_float16 169.8-178.1 requested, 231.8 estimated, 183.3
    now."""
    update = max((f.get("update_bytes_in_turn", 0) for f in per_block.values()), default=0)
    # In the backward's order: a weight read more than once has a gradient
    # from its last reader in the forward on (a tied embedding's from the
    # head's moment).
    seen, grads, after, so_far = set(), {}, {}, 0
    for key in reversed(list(per_block)):
        figures = per_block[key]
        for field, at in (("after", after), ("weights", grads)):
            new = {n: b for n, b in figures.get(field, {}).items() if n not in seen}
            seen.update(new)
            so_far += sum(new.values())
            at[key] = so_far
        after[key] += after_buffers[key]
        grads[key] += figures.get("largest", 0) + buffers[key]
    stem = {n: b for f in per_block.values() for n, b in f.get("before", {}).items()}
    every = so_far + sum(b for n, b in stem.items() if n not in seen)
    first = max(first + every, every + update)  # the stem's moment; the updates
    return grads, after, first, max(0, gradient_bytes - every)


def selective_plan_bytes(total, per_block, chosen, kept, gradient_bytes=None, alone=False):
    """Estimated peak bytes of a selective plan (with `gradient_bytes`, the
    training peak), by the moments of `plan_bytes`.

    A chosen block holds its kernel layers' outputs (`kernel_kept`: those
    it reads on, such as a Dense's before a gelu, which the backward
    without recompute does not read: the gelu's gradient reads its own
    intermediates) until the backward reaches it; there its replay rebuilds
    the rest from them, so at its moment it has all its activations alive,
    as without recompute (a kept output the rebuilt ones were made from is
    freed by then). ConvNeXtTiny's estimate read 0.75 of the requested
    bytes when only the step's trace (below) counted such outputs. The
    other blocks hold what they hold without recompute. Its moment comes
    after the backward of the blocks after it: their gradients and what
    they held are gone by then (a sum of each largest figure, the replay's
    and the gradients', read 1.39x the measured peak on ConvNeXtTiny, whose
    largest weight gradients come at the first blocks of the backward and
    its largest replays at the last). A normalisation replayed in it
    (`normalized`) adds two gradients of its input's size to that moment:
    its backward sums three (MobileNetV2 at 64x64, batch 16: 48.6-49.4 MiB
    requested, 40.9 estimated without them, 49.0 with them; measured
    alive at the peak, with all the first block's activations).

    `kept`, the bytes the selective step's own trace keeps for its backward
    (`kept_bytes`), can exceed what the figures say it keeps (a kernel
    layer's output the figures miss, a block's input kept for its replay):
    the excess is counted throughout, so such an output counts twice at
    its block's moment (the excess was 0 MiB of MobileNetV2's 39.7
    estimated, 12 of ResNet50's 105, 43 of ConvNeXtTiny's 118 and 120 of
    the residual MLP's 206, measured before the figures counted
    `kernel_kept`, the outputs no backward without recompute reads).
    Where it is smaller, the figures stand, which reads high.

    Args:
        total: bytes of all cached activations without recompute
            (`estimate`).
        per_block: the blocks' figures, in the forward's order.
        chosen: the keys of the recomputed blocks.
        kept: `kept_bytes` of the selective step.
        gradient_bytes: bytes of all the trainable variables' gradients, or
            None for the activations alone. Defaults to `None`.
        alone: as `plan_bytes`'. Defaults to `False`.

    Returns:
        An int, bytes.
    """
    top = {key: f for key, f in per_block.items() if f.get("parent") is None}
    # A nested block's activations are among its top-level block's: a
    # chosen parent's replay runs it plainly (selective does not nest).
    chosen = set(chosen) & set(top)
    everything = {key: top[key]["cached"] for key in top}
    # A replayed normalisation's backward ran while all its block's
    # activations were alive (MobileNetV2's first block): its gradients come
    # on top of them. Not counted for kept blocks nor full recompute's
    # replays, which had freed the activations after it by then (MobileNetV2
    # "auto": 29.5 MiB requested, 29.5 estimated without them; +12 with).
    moment = {
        key: everything[key] + (2 * top[key].get("normalized", 0) if key in chosen else 0)
        for key in top
    }
    holds = {
        key: top[key].get("kernel_kept", top[key].get("kernel_cached", 0)) if key in chosen
        else everything[key]
        for key in top
    }
    outside = max(0, total - sum(everything.values()))
    figured = outside + sum(holds.values())
    worst, unplaced = _backward_peak(
        top, holds, moment, _outside(per_block, outside),
        _block_gradients(top, gradient_bytes, alone),
    )
    return _with_floor(worst + unplaced + max(0, kept - figured), per_block, gradient_bytes)
