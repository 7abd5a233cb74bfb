"""Which `kgb.ops` a layer at fault could use, from the ops its call runs.

`layer_op_types(layer, inputs)` traces the layer's call once (a graph, not
run: no variable or seed changes) and lists the TensorFlow op types in it,
those of the functions it calls included. `advice(op_types)` turns the ones
that commonly produce inf/NaN (log, sqrt, norm, division, exp) into
sentences naming the stable op for each.
"""

import tensorflow as tf

# (op types that suggest it, the sentence). Checked in this order; a norm
# (Sqrt of a Sum of squares) is named instead of a bare sqrt.
_RULES = (
    (
        {"EuclideanNorm"},
        "kgb.ops.safe_norm(x, axis) for a Euclidean norm (finite gradient at the zero vector)",
    ),
    (
        {"Log"},
        "kgb.ops.safe_log(x, eps) for log(x) (finite at 0)",
    ),
    (
        {"Exp"},
        "kgb.ops.log1pexp(x) for log(1 + exp(x)) and kgb.ops.logsumexp(x, axis) "
        "for log(sum(exp(x))) (no overflow, rows of -inf handled)",
    ),
    (
        {"Sqrt", "Rsqrt"},
        "kgb.ops.safe_sqrt(x) for sqrt(x) (finite gradient at 0), "
        "kgb.ops.safe_norm(x, axis) for sqrt(sum(x**2))",
    ),
    (
        {"RealDiv", "Div", "Reciprocal", "Inv", "FloorDiv", "Xdivy"},
        "kgb.ops.safe_divide(x, y) for x / y (0 where y = 0, values and gradients)",
    ),
)


def layer_op_types(layer, inputs):
    """The op types of `layer(*inputs)`, traced once (empty if the layer
    cannot be traced on these inputs alone)."""
    specs = [tf.TensorSpec(x.shape, x.dtype) for x in inputs]
    try:
        concrete = tf.function(lambda *xs: layer(*xs)).get_concrete_function(*specs)
    except Exception:  # a layer that needs other arguments, or is not traceable
        return frozenset()
    graph_def = concrete.graph.as_graph_def()
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types.update(node.op for node in function.node_def)
    return frozenset(types)


def advice(op_types):
    """Sentences naming a stable op for each risky op in `op_types`, and the
    op types that suggested them: `(sentences, found)`."""
    sentences, found = [], []
    for suggest, sentence in _RULES:
        hit = sorted(suggest & set(op_types))
        if hit:
            sentences.append(sentence)
            found.extend(hit)
    return sentences, found


def layer_advice(layer, inputs):
    """One sentence for the layer at fault, or "" when none applies."""
    sentences, found = advice(layer_op_types(layer, inputs))
    if not sentences:
        return ""
    return (
        f"layer '{layer.name}' computes {', '.join(found)}; consider "
        + "; ".join(sentences)
        + " (kgb.gradcheck checks a hand-written replacement)"
    )
