"""What the optimizer's update holds during a training step: whether every
gradient waits for it (`gradients_pile_up`), and how many temporaries of a
variable's size its update of one variable holds at once
(`update_temporaries`). The training peak estimates (`estimates.plan_bytes`)
count both."""

import warnings

import keras
import numpy as np
import tensorflow as tf


# The Keras optimizer options whose update waits for every gradient
# (`gradients_pile_up`), and why.
_HOLDING_OPTIONS = (
    ("global_clipnorm", "needs the norm of every gradient before the first update"),
    ("gradient_accumulation_steps", "adds or applies every gradient in one tf.cond"),
    ("use_ema", "updates its moving averages after every update (measured)"),
)


# `gradients_pile_up` of a step checked before its update, whose updates
# then run in turn (`step.updates_in_turn`); and of one whose updates start
# at once (XLA, an accumulation window's update).
CHECKED = (
    "each step's gradients are checked for finiteness before its update "
    "(a loss scale, or a NaNWatcher)"
)
CHECKED_AT_ONCE = CHECKED + ", then all updated at once"


def gradients_pile_up(optimizer=None, checked=False, in_turn=True):
    """Why every gradient of a training step is alive at the end of its
    backward, or None when TensorFlow's executor applies each variable's
    update as soon as its gradient exists.

    They pile up when grappler's dependency optimizer is off
    (`tf.config.optimizer` options `dependency_optimization=False` or
    `disable_meta_optimizer`): the updates wait for the whole backward.
    Measured on ResNet50 (64x64, batch 16) with `recompute="auto"`: the
    steps requested 145.4 MiB with the dependency optimizer off, against
    51.4 with it on; the estimate with every gradient alive read 145.5, the
    one by moments 50.1.

    When the step checks its gradients before its update (`checked`: a
    GradBoostModel's loss scale or `NaNWatcher`, which never apply a bad
    update), and when the optimizer's update needs every gradient first.
    ResNet50, "auto", Adam (`bench_recompute.py --update`): such steps
    requested 140-189 MiB where the estimate by moments read 50.1.

    The optimizers that do: a Keras optimizer with `global_clipnorm` (the
    norm is over all of them), with its own `gradient_accumulation_steps`
    (one `tf.cond` takes them all), or with `use_ema` (measured), and a
    `keras.optimizers.LossScaleOptimizer` (one finiteness check over them
    all). Not `clipnorm`, which clips each gradient on its own, nor
    GradBoostModel's `accumulate_steps`, which adds each as it comes
    (measured: as plain Adam). Keras' accumulation may read high: 141.0
    MiB requested through `fit`, 50.3 by train-function calls.

    Args:
        optimizer: the model's optimizer, or None.
        checked: whether the step checks every gradient's finiteness before
            its update.
        in_turn: whether a checked update then runs in turn
            (`step.updates_in_turn`: not under XLA, nor for an accumulation
            window's update). Defaults to `True`.

    Returns:
        A str, or None.
    """
    options = tf.config.optimizer.get_experimental_options()
    if options.get("disable_meta_optimizer") or options.get("dependency_optimization", True) is False:
        return (
            "grappler's dependency optimizer is off in tf.config.optimizer, so "
            "the optimizer's updates wait for the whole backward"
        )
    if checked:
        return CHECKED if in_turn else CHECKED_AT_ONCE
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return (
            "keras.optimizers.LossScaleOptimizer checks every gradient is finite "
            "before the first update"
        )
    for attribute, why in _HOLDING_OPTIONS:
        if getattr(optimizer, attribute, None):
            return f"the optimizer's {attribute} {why}"
    return None


def step_gradients_pile_up(model, watcher=False):
    """`gradients_pile_up` of `model`'s training step: whether it checks its
    gradients (a loss scale, `step_facts.checks_gradients` set; and when
    `watcher`, a NaNWatcher: the `fit` has one) or its optimizer waits.
    A watch attached only for the current `fit` counts through `watcher`
    alone, so the same model gives the same answer before and during a
    `fit` without one. A checked step's updates run in turn
    (`CHECKED`), except under XLA (a `jit_compile` other than False) and
    with `accumulate_steps` > 1 (`CHECKED_AT_ONCE`)."""
    checks = getattr(model, "_checks_steps", None)  # GradBoostModel's
    checked = watcher or bool(checks and checks(watches=False))
    config = getattr(model, "gradboost_config", None)
    in_turn = getattr(model, "jit_compile", False) in (False, None) and (
        getattr(config, "accumulate_steps", 1) == 1
    )
    return gradients_pile_up(getattr(model, "optimizer", None), checked, in_turn)


def update_bytes(sizes, buffers, in_turn):
    """The bytes the updates hold beyond the gradients, where every gradient
    is alive at the end of the backward (`gradients_pile_up`).

    Args:
        sizes: the trainable variables' bytes, in the order the optimizer
            updates them.
        buffers: `update_temporaries` of the optimizer.
        in_turn: whether the updates run in turn (`step.updates_in_turn`):
            each frees its gradient before the next starts, so the buffers
            of the update of variable i come with the gradients from i on
            (ResNet50, NaNWatcher, "auto", Adam: 93.0 MiB requested at
            32x32 and batch 8, where the largest weight's buffers on top of
            every gradient gave 113.5). Otherwise those of the largest one,
            on top of every gradient.

    Returns:
        An int.
    """
    if not in_turn:
        return buffers * max(sizes, default=0)
    freed, extra = 0, 0
    for size in sizes:
        extra = max(extra, buffers * size - freed)
        freed += size
    return extra


def update_temporaries(optimizer, alone=False):
    """How many buffers of a variable's size the optimizer's update of one
    variable holds at once, its gradient aside (SGD: 1, the scaled
    gradient; Adam: 2). The training peak estimates count them
    (`estimates.plan_bytes`).

    Where the gradients pile up (`gradients_pile_up`), the updates run
    once the backward ends (`update_bytes`). A checked step runs them in
    turn (`step.updates_in_turn`): ResNet50 (64x64, batch 16, "auto", Adam)
    with a NaNWatcher requested 139.9-148.8 MiB, estimated 142.4 with
    them and the gradients made until each moment (at 32x32, batch 8, a
    test holds it within 15%). Started all at once, as TensorFlow does when
    every gradient is ready, many updates' temporaries are alive together
    (at one peak, the `Square`s of at least 15 of them, 68 MiB):
    167.0-190.0 MiB requested there; the estimate counts the largest
    weight's alone.

    Where each update runs as its gradient arrives, at its weight's moment
    of the backward: 8 Dense(1024) layers at batch 16, where the weights
    dwarf the activations, requested 8.0-12.5 MiB with SGD (a copy of the
    weight the backward still reads) and 16.4 with Adam, where the
    estimate without them read 4.6. With them, and the next weight's
    gradient that the backward makes while an update still runs, it reads
    12.6 and 16.6 (8.6 and 12.6 without that gradient: Adam's 1.31x low).
    ResNet50's "auto": 50.7 MiB requested, 52.8 estimated.

    Traced on a copy of the optimizer (a `LossScaleOptimizer`'s inner one)
    and a scratch variable, in a graph of their own that nothing runs (the
    model's optimizer and a distribution strategy's scope are left alone),
    each tensor alive from the operation that makes it to its last reader
    in the order traced. Operations inside a `tf.cond` (Keras'
    `gradient_accumulation_steps`) are not seen. 0 with a warning when the
    optimizer cannot be copied from its config, or its copy traced.

    With `alone`: the buffers beyond its gradient when the update runs on
    its own, its operations in the order traced: the gradient is freed at
    its last reader (Adam's `Square` writes into it), and the weight's
    first assignment copies it (copy-on-write: the backward may still read
    the old value); at most the overlapping count. Adam: 1 (where the
    overlapping count is 2), SGD: 1.
    TensorFlow's executor runs them so when the backward between two large
    gradients outlasts an update: ConvNeXtTiny (64x64, batch 16, "auto",
    `depthwise="native"`) held one 9 MiB kernel's gradient and its
    `Square` at its peak, and nothing of the next kernel's (allocations
    alive at the profiler's peak); 8 Dense(1024) at batch 16 held two
    updates' (`estimates.plan_bytes` counts both ways).

    Args:
        optimizer: a Keras optimizer, or anything else (0).
        alone: whether to count the update alone, as above. Defaults to
            `False`.

    Returns:
        An int.
    """
    return update_temporary_counts(optimizer)[1 if alone else 0]


def update_temporary_counts(optimizer):
    """`(update_temporaries(optimizer), update_temporaries(optimizer,
    alone=True))` from one trace of its update (`(0, 0)` with its warning
    where it cannot be traced)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not isinstance(inner, keras.optimizers.Optimizer):
        return 0, 0
    with tf.init_scope():  # eager, also during a trace: the config reads values
        config = inner.get_config()
    with tf.Graph().as_default() as graph:
        try:
            copy = type(inner).from_config(config)
        except (TypeError, ValueError, KeyError) as error:  # an optimizer of the user's
            warnings.warn(
                f"The training peak estimates leave out the buffers of "
                f"{type(inner).__name__}'s update: it could not be copied from "
                f"its config ({type(error).__name__}: {error}).",
                stacklevel=2,
            )
            return 0, 0
        try:
            variable = keras.Variable(np.zeros(_SCRATCH_SHAPE, "float32"), name="scratch")
            copy.build([variable])
            gradient = tf.compat.v1.placeholder(tf.float32, _SCRATCH_SHAPE)
            start = len(graph.get_operations())
            copy.apply([gradient], [variable])
            operations = graph.get_operations()[start:]
        except Exception as error:  # noqa: BLE001 - an estimate short of it, said
            warnings.warn(
                f"The training peak estimates leave out the buffers of "
                f"{type(inner).__name__}'s update: its copy could not be traced "
                f"({type(error).__name__}: {error}).",
                stacklevel=2,
            )
            return 0, 0
    size = 4 * np.prod(_SCRATCH_SHAPE)
    overlapping = round(_peak_bytes(operations) / size)
    # The weight's resource handle (the TensorFlow variable under Keras').
    handle = getattr(getattr(variable, "value", None), "handle", None)
    if handle is None:
        warnings.warn(
            f"The low end of the training peak estimates leaves out the copy of "
            f"the weight {type(inner).__name__}'s update may make: this Keras "
            f"backend's variable has no TensorFlow handle "
            f"({type(getattr(variable, 'value', None)).__name__}).",
            stacklevel=2,
        )
    copied = {handle.op.name: size} if handle is not None else None
    peak = _peak_bytes(operations, {gradient.name: size}, copied)
    # At most the overlapping count: the low end (an update that only
    # assigns its gradient counts the copy alone).
    return overlapping, min(overlapping, max(0, round(peak / size) - 1))


_SCRATCH_SHAPE = (64, 64)

# Operations whose output is no buffer of its own: a variable's value, or
# its input's buffer.
_NO_BUFFER = {"ReadVariableOp", "Identity", "IdentityN", "Reshape", "Const", "Placeholder"}


# TensorFlow's element-wise kernels that write into an input's buffer when
# nothing else reads it.
_ELEMENTWISE = {
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum",
    "Sqrt", "Rsqrt", "Square", "Neg", "Abs", "Sign", "Exp", "Log", "Pow",
    "SquaredDifference", "Reciprocal", "Cast", "Select", "SelectV2",
}


def _peak_bytes(operations, held=None, copied=None):
    """The most bytes of float tensors alive at once, each from the
    operation that makes it to its last reader, in `operations`' order.

    An element-wise operation that is the last reader of an input of its
    output's shape and dtype writes into that input's buffer, as
    TensorFlow's kernels do (`forward_input_or_allocate_output`): a
    variable's value is never such an input (the variable holds it too).

    Args:
        operations: the operations, in order.
        held: tensor name -> bytes of tensors alive from the start that are
            freed at their last reader and may be written into (read
            through `Identity`, `IdentityN` or `Reshape` too), or None.
        copied: resource handle operation name -> bytes of a copy its first
            assignment makes (alive at that operation), or None.
    """
    root = {}  # an alias's tensor name -> the tensor whose buffer it is
    for op in operations:
        if op.type in ("Identity", "IdentityN", "Reshape"):
            for t, source in zip(op.outputs, op.inputs):
                root[t.name] = root.get(source.name, source.name)
    last = {}
    for i, op in enumerate(operations):
        for t in op.inputs:
            last[root.get(t.name, t.name)] = i
    alive, peak = dict(held or {}), 0
    copies = dict(copied or {})
    for i, op in enumerate(operations):
        if op.type not in _NO_BUFFER:
            for t in op.outputs:
                if t.name in last and t.dtype.is_floating and t.shape.is_fully_defined():
                    alive[t.name] = t.shape.num_elements() * t.dtype.size
                    forwarded = next(
                        (
                            root.get(u.name, u.name)
                            for u in op.inputs
                            if root.get(u.name, u.name) in alive
                            and last[root.get(u.name, u.name)] == i
                            and u.dtype == t.dtype
                            and u.shape == t.shape
                        ),
                        None,
                    )
                    if forwarded is not None and op.type in _ELEMENTWISE:
                        alive.pop(forwarded)  # its buffer is now the output's
        copy = copies.pop(op.inputs[0].op.name, 0) if op.type in _ASSIGNS else 0
        peak = max(peak, sum(alive.values()) + copy)
        for t in op.inputs:
            if last.get(root.get(t.name, t.name)) == i:
                alive.pop(root.get(t.name, t.name), None)
    return peak


# The assignments to a resource variable (copy-on-write when its old value
# is still read).
_ASSIGNS = {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"}
