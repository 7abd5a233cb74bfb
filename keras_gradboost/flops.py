"""FLOPs of one training step, and this machine's matmul peak.

`step_flops` counts the matrix multiplications and convolutions of one
traced training step (forward, backward and whatever else the step runs,
such as recompute's extra forward), 2 FLOPs per multiply-add, by dtype.
`measure_peak` times a large matmul per dtype: the throughput those
operations can reach here. `peak_share` relates the two to a step time.

How the count is made, and what it leaves out:
- The step is `model.train_step` traced once more, by
  `tf.function(model.train_step).get_concrete_function(batch spec)`: the
  graph TensorFlow runs before XLA or grappler rewrite it, so the count is
  the same with and without XLA. It holds the gradient operations: the
  backward of a MatMul is two MatMuls (one for the weights, one for the
  input, left out where nothing needs it, e.g. the first layer's), that of
  a Conv2D a Conv2DBackpropFilter and a Conv2DBackpropInput; recompute's
  recomputed forward shows up as forward operations again. Only the
  operations the step's outputs and updates depend on count: a Conv2D's
  gradient also makes the input gradient of the first layer, which nothing
  reads and TensorFlow prunes when the function runs.
- Each contraction is counted from its shapes: 2 x (elements of its output,
  or of the gradient flowing into a convolution's backprop) x (the size
  summed over per element: the inner dimension of a matmul, the kernel
  window x input channels of a convolution, all of an einsum's contracted
  indices). Types: MatMul, BatchMatMul(V2/V3), Einsum (`EinsumDense`,
  `MultiHeadAttention`), Conv2D, Conv3D, DepthwiseConv2dNative and their
  backprops. A "same"-padded convolution's taps on the padding count.
- Not TensorFlow's graph profiler (`tf.compat.v1.profiler.profile(graph,
  options=ProfileOptionBuilder.float_operation())`), though it agrees on
  MatMul and Conv2D: it has no statistics for Einsum (the attention of the
  built-in transformer), reads BatchMatMulV2's transpose from an attribute
  that op does not have (`transpose_a`, not `adj_x`: twice the FLOPs of a
  Dense weight gradient on 3-D inputs), and counts a convolution's
  backprops from the input's size instead of the output's (too many for
  "valid" padding). Nor an analytic count from the layers: it would not see
  what the step really runs (recompute, the input gradient nothing needs,
  a custom layer's ops). XLA's cost analysis has no public API in
  TensorFlow (`experimental_get_compiler_ir` gives HLO text only).
- Elementwise operations (activations, normalisation, the loss, the
  optimizer update) are left out on purpose: they are memory-bound, few
  FLOPs next to the contractions of a dense or convolutional model (about
  5% more on the built-in MLP, counting 1 per element), and the peak they
  would be compared with is a matmul's.
- Not counted, and flagged (`exact` is False; `uncounted` says what): a
  contraction whose shapes are not fully known, an operation type that
  looks like one (`*MatMul*`, `*Conv2D*`-like, `Einsum`) but is not in the
  list above, and contractions inside the body of a `tf.cond`,
  `tf.while_loop` or nested `tf.function` (only the top-level graph is
  counted; a branch may run or not). The count is then a lower bound.

Under `accumulate_steps=k` the step is one micro-batch: its forward and
backward (and the accumulation), not 1/k of the update (an elementwise
update, under a `tf.cond`).
"""

import dataclasses
import re
import statistics
import time

MATMULS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
CONVOLUTIONS = ("Conv2D", "Conv3D", "DepthwiseConv2dNative")
# Their gradients: (input sizes or input, filter, incoming gradient) and
# (input, filter sizes or filter, incoming gradient).
CONVOLUTION_GRADIENTS = (
    "Conv2DBackpropInput",
    "Conv2DBackpropInputV2",
    "Conv2DBackpropFilter",
    "Conv2DBackpropFilterV2",
    "Conv3DBackpropInput",
    "Conv3DBackpropInputV2",
    "Conv3DBackpropFilter",
    "Conv3DBackpropFilterV2",
    "DepthwiseConv2dNativeBackpropInput",
    "DepthwiseConv2dNativeBackpropFilter",
)
# The size of the matmul `measure_peak` times, and how often.
PEAK_SIZE = 2048
PEAK_WARMUP = 2
PEAK_REPS = 5


_CONTRACTION = re.compile(r"MatMul|Conv\d[dD]|^Einsum$")


def _looks_like_contraction(op_type):
    return bool(_CONTRACTION.search(op_type))


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """The contraction FLOPs of one training step.

    Attributes:
        by_dtype: dtype name -> FLOPs of the contractions computing in it.
        exact: False when some contraction could not be counted (then the
            total is a lower bound).
        uncounted: what was not counted, one phrase each.
    """

    by_dtype: dict
    exact: bool
    uncounted: tuple

    @property
    def total(self):
        return float(sum(self.by_dtype.values()))


def _known(*shapes):
    return all(s.rank is not None and s.is_fully_defined() for s in shapes)


def einsum_flops(equation, shapes):
    """2 x the product of the sizes of all indices of a two-operand einsum
    (None for other einsums: a one-operand one contracts nothing).

    Args:
        equation: e.g. `"abc,cd->abd"`; `...` stands for broadcast dims.
        shapes: the operands' shapes (sequences of ints).
    """
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if len(inputs) != 2:
        return None
    sizes, ellipses = {}, []
    for spec, shape in zip(inputs, shapes):
        shape = list(shape)
        if "..." in spec:
            before, after = spec.split("...")
            n = len(shape) - len(before) - len(after)
            ellipses.append(shape[len(before) : len(before) + n])
            shape = shape[: len(before)] + shape[len(before) + n :]
            spec = before + after
        for letter, size in zip(spec, shape):
            sizes[letter] = max(sizes.get(letter, 1), size)
    flops = 2.0
    for size in sizes.values():
        flops *= size
    width = max((len(e) for e in ellipses), default=0)
    for i in range(1, width + 1):
        flops *= max((e[-i] for e in ellipses if len(e) >= i), default=1)
    return flops


def op_flops(op):
    """The FLOPs of one contraction operation, from its shapes.

    Args:
        op: a `tf.Operation` of a type in `MATMULS`, `CONVOLUTIONS`,
            `CONVOLUTION_GRADIENTS` or an Einsum.

    Returns:
        The FLOPs (2 per multiply-add), 0.0 for an einsum of one operand,
        or None when a shape it needs is not fully known.
    """
    out = op.outputs[0].shape
    if op.type == "Einsum":
        shapes = [t.shape for t in op.inputs]
        if len(shapes) != 2:
            return 0.0
        if not _known(*shapes):
            return None
        return einsum_flops(op.get_attr("equation").decode(), [s.as_list() for s in shapes])
    if op.type in MATMULS:
        a = op.inputs[0].shape
        if not _known(a, out):
            return None
        if op.type == "MatMul":
            inner = a[0] if op.get_attr("transpose_a") else a[1]
        else:
            inner = a[-2] if op.get_attr("adj_x") else a[-1]
        return 2.0 * out.num_elements() * inner
    # A convolution: each element of the larger activation (the forward
    # output, or the gradient flowing back into a backprop) is a sum over
    # the kernel window and the input channels of its group (a depthwise
    # kernel (h, w, in, multiplier) sums over the window alone).
    if op.type in CONVOLUTIONS:
        activation, kernel = out, op.inputs[1].shape
    elif "BackpropInput" in op.type:
        activation, kernel = op.inputs[2].shape, op.inputs[1].shape
    else:  # a filter backprop: its output has the kernel's shape
        activation, kernel = op.inputs[2].shape, out
    if not _known(activation, kernel):
        return None
    window = kernel[:-2] if op.type.startswith("Depthwise") else kernel[:-1]
    return 2.0 * activation.num_elements() * window.num_elements()


def _bodies_with_contractions(library, op):
    """The contraction types inside the functions an op calls (its
    `tf.cond`/`tf.while_loop` bodies, a nested `tf.function`), recursively;
    `library` maps function names to their `FunctionDef`s."""
    names = [
        value.func.name
        for value in op.node_def.attr.values()
        if value.HasField("func")
    ] + [
        f.name for value in op.node_def.attr.values() if value.HasField("list") for f in value.list.func
    ]
    found, seen = set(), set()
    while names:
        name = names.pop()
        if name in seen or name not in library:
            continue
        seen.add(name)
        for node in library[name].node_def:
            if _looks_like_contraction(node.op):
                found.add(node.op)
            for value in node.attr.values():
                if value.HasField("func"):
                    names.append(value.func.name)
                if value.HasField("list"):
                    names.extend(f.name for f in value.list.func)
    return found


def graph_flops(graph):
    """The contraction FLOPs of a traced graph (see the module docstring).

    Args:
        graph: a `tf.Graph` or a concrete function's `FuncGraph`.

    Returns:
        A `StepFlops`.
    """
    by_dtype, uncounted, library = {}, [], None
    counted = (*MATMULS, *CONVOLUTIONS, *CONVOLUTION_GRADIENTS, "Einsum")
    for op in _live_operations(graph):
        if op.type in counted:
            flops = op_flops(op)
            if flops is None:
                uncounted.append(f"{op.type} {op.name!r} (shapes not fully known)")
            elif flops:
                dtype = op.outputs[0].dtype.name
                by_dtype[dtype] = by_dtype.get(dtype, 0.0) + flops
        elif _looks_like_contraction(op.type):
            uncounted.append(f"{op.type} {op.name!r} (no FLOP count for this type)")
        elif _calls_functions(op):
            if library is None:
                functions = graph.as_graph_def().library.function
                library = {f.signature.name: f for f in functions}
            inside = _bodies_with_contractions(library, op)
            if inside:
                uncounted.append(f"{', '.join(sorted(inside))} inside {op.type} {op.name!r}")
    return StepFlops(by_dtype=by_dtype, exact=not uncounted, uncounted=tuple(uncounted))


def _live_operations(graph):
    """The operations a call of the function runs: those its outputs and
    control outputs (the stateful updates) depend on, in graph order; the
    others are pruned when it runs (e.g. a Conv2D gradient's input gradient
    for the first layer, which TensorFlow's gradient makes but nothing
    reads). A plain `tf.Graph`: all its operations."""
    operations = graph.get_operations()
    outputs = getattr(graph, "outputs", None)
    if outputs is None:
        return operations
    stack = [t.op for t in outputs if t is not None]
    stack += list(getattr(graph, "control_outputs", ()))
    live = set()
    while stack:
        op = stack.pop()
        if op.name in live:
            continue
        live.add(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return [op for op in operations if op.name in live]


def _calls_functions(op):
    return any(
        value.HasField("func") or (value.HasField("list") and value.list.func)
        for value in op.node_def.attr.values()
    )


def step_flops(model, batch):
    """The contraction FLOPs of one `model.train_step` on a batch's shapes.

    Traces the step once more (nothing runs; the optimizer is built first
    if it is not yet), in a `tf.function` of its own without XLA.

    Args:
        model: a compiled Keras model.
        batch: a batch as `fit` passes it to `train_step` (tensors or
            arrays), or matching `tf.TensorSpec`s.

    Returns:
        A `StepFlops`.

    Example:

    ```python
    import numpy as np
    import keras
    from keras_gradboost import flops

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
    batch = (np.zeros((2, 8), "float32"), np.zeros((2, 4), "float32"))
    counted = flops.step_flops(model, batch)
    assert counted.total == 2 * 2 * 8 * 4 * 2  # forward, weight gradient
    ```
    """
    import tensorflow as tf

    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)

    def spec(t):
        if isinstance(t, tf.TensorSpec):
            return t
        t = tf.convert_to_tensor(t)
        return tf.TensorSpec(t.shape, t.dtype)

    specs = tf.nest.map_structure(spec, batch)
    step = tf.function(model.train_step, autograph=False)
    graph = step.get_concrete_function(specs).graph
    return graph_flops(graph)


def measure_peak(dtypes, size=PEAK_SIZE, reps=PEAK_REPS, warmup=PEAK_WARMUP):
    """This machine's matmul throughput per dtype, in FLOP/s.

    Per dtype: a `size x size` by `size x size` matmul in a `tf.function`,
    called `warmup` times, then the fastest of `reps` timed calls (each
    synchronised by reading one element back: a peak, so the call least
    disturbed by anything else on the machine), `2 * size**3` FLOPs each.

    Args:
        dtypes: dtype names, e.g. `["float32", "bfloat16"]`.
        size: the matrices' side. Defaults to `PEAK_SIZE`.
        reps: timed calls per dtype. Defaults to `PEAK_REPS`.
        warmup: untimed calls first. Defaults to `PEAK_WARMUP`.

    Returns:
        dict dtype name -> FLOP/s, or None where the matmul failed.
    """
    import tensorflow as tf

    peaks = {}
    for dtype in dtypes:
        try:
            a = tf.random.stateless_normal((size, size), (1, 2), dtype="float32")
            a, b = tf.cast(a, dtype), tf.cast(tf.transpose(a), dtype)
            matmul = tf.function(lambda a, b: tf.matmul(a, b)[0, 0])
            for _ in range(warmup):
                matmul(a, b).numpy()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                matmul(a, b).numpy()
                times.append(time.perf_counter() - start)
            peaks[dtype] = 2.0 * size**3 / min(times)
        except Exception:  # noqa: BLE001 - no such kernel here: no peak
            peaks[dtype] = None
    return peaks


def peak_share(by_dtype, step_s, peaks):
    """The share of the peak one step reached: the time the step's FLOPs
    would take at each dtype's peak, over the step's time (for one dtype:
    achieved FLOP/s over the peak). None when a dtype has no peak.

    Args:
        by_dtype: dtype name -> FLOPs of one step.
        step_s: the step's time in seconds.
        peaks: dtype name -> peak FLOP/s.
    """
    ideal = 0.0
    for dtype, flops in by_dtype.items():
        if not flops:
            continue
        if not peaks.get(dtype):
            return None
        ideal += flops / peaks[dtype]
    return ideal / step_s if step_s > 0 else None
