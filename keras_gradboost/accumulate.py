"""Exact gradient accumulation, weighted by sample count, distribution-aware.

With Keras' default loss reduction ("sum_over_batch_size") the loss of a batch
of N samples is the sum of per-sample losses over N, so the gradient of k
micro-batches concatenated is

    g = sum_j n_j * g_j / sum_j n_j

where micro-batch j has n_j samples and mean gradient g_j. Averaging the g_j
equally (as Keras' own `gradient_accumulation_steps` does) is wrong whenever
the n_j differ, e.g. for the last, smaller batch of an epoch. With a Keras
mask on the prediction, Keras divides each batch's loss by its valid entries
instead, and n_j is that count (`loss_normaliser`). Here each replica
keeps `sum_j n_j * g_j` and its own `sum_j n_j` in replica-local variables; at
update time the counts are summed over replicas and the optimizer's usual
all-reduce sums the accumulated gradients, once per update.

A variable with Keras' `overwrite_with_gradient` (a float8 layer's scales and
amax histories) takes its "gradient" as its new value. Its window keeps, as
Keras' `gradient_accumulation_steps` does, the elementwise maximum of the
unweighted values, starting from zeros: `max(0, g_1, ..., g_k)`.
"""

import functools

import keras
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost.state import replica_local_variable


def accumulate(acc, grads, n):
    """`acc + n * grads` per variable; `None` gradients leave `acc` alone.

    Pure: the reference formula the accumulator implements, used in tests.
    """
    return [a if g is None else a + n * g for a, g in zip(acc, grads)]


def overwrites_with_gradient(variable):
    """Whether `variable` takes its "gradient" as its new value (Keras'
    public `overwrite_with_gradient`; a `tf.Variable` has none)."""
    return getattr(variable, "overwrite_with_gradient", False)


# Reductions that divide a batch's loss by its samples (or valid entries).
EXACT_REDUCTIONS = ("sum_over_batch_size", "mean")


def reduces_like_keras(loss):
    """Whether a `keras.losses.Loss` goes through Keras' own `__call__` with
    a reduction in `EXACT_REDUCTIONS`: the losses weighting micro-batches by
    count is exact for."""
    return (
        type(loss).__call__ is keras.losses.Loss.__call__
        and loss.reduction in EXACT_REDUCTIONS
    )


def listed(names, limit):
    """`'a', 'b' and 3 more`: names in a message, at most `limit` shown."""
    shown = ", ".join(map(repr, names[:limit]))
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# The attributes that say how much a Keras layer draws: all 0, it draws
# nothing (Keras' RNN cells hold a SeedGenerator at dropout=0 too).
RANDOM_RATES = ("rate", "dropout", "recurrent_dropout", "stddev")


def held_generators(layer):
    """The `keras.random.SeedGenerator`s `layer` holds (in an attribute, or
    a list or dict there)."""
    held = []
    for value in vars(layer).values():
        if isinstance(value, dict):
            value = list(value.values())
        held.extend(value if isinstance(value, (list, tuple)) else [value])
    return [v for v in held if isinstance(v, keras.random.SeedGenerator)]


def random_layers(model):
    """The layers of `model` that draw random numbers of their own in
    training: those holding a `keras.random.SeedGenerator`
    (`held_generators`), but for those whose rates (`RANDOM_RATES`) are all
    0. Dropout with a rate above 0, GaussianNoise, an LSTM's cell with
    dropout, the random augmentation layers."""
    found = []
    for layer in hooks.flatten_layers(model):
        if not held_generators(layer):
            continue
        rates = [getattr(layer, name) for name in RANDOM_RATES if hasattr(layer, name)]
        if rates and all(isinstance(r, (int, float)) and r == 0 for r in rates):
            continue
        found.append(layer)
    return found


# Keras' own activity regularizers: sums of per-element terms.
_PER_ELEMENT_REGULARIZERS = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)


@functools.lru_cache(maxsize=None)
def activity_losses_are_means():
    """Whether this Keras divides an activity regularizer's loss by the
    batch size (newer Keras 3 does; Keras 3.8 adds its sum over the batch,
    which a window's weighted average of micro-batches divides by the
    window's micro-batches). Found once, eagerly (`compile` asks first)."""
    # Named: an unnamed layer would move Keras' count of default names.
    layer = keras.layers.Activation(
        "linear", activity_regularizer=keras.regularizers.L1(1.0), name="kgb_activity_probe"
    )
    with tf.init_scope(), hooks.collecting_losses() as added:
        layer(tf.ones((2, 1)))
    return abs(float(added[0][1]) - 1.0) < 1e-6


def mean_activity_loss(layer):
    """Whether the losses `layer` adds are its activity regularizer's, and
    that is a mean over samples (a per-element L1, L2 or L1L2, divided by
    the batch size): a window's weighted average of micro-batches gives
    the large batch's. A layer that also adds a loss of its own is not
    told apart (`accumulate_check` compares the two)."""
    return (
        type(layer.activity_regularizer) in _PER_ELEMENT_REGULARIZERS
        and activity_losses_are_means()
    )


def repeats_change_update(optimizer):
    """Why `optimizer`'s update from a sparse gradient (a `tf.IndexedSlices`,
    an Embedding's: a slice per token, a row repeated where its token
    repeats) differs from its update from the same gradient with each
    row's repeats summed, which is all an accumulation window keeps; or
    None when both are the same.

    Keras' optimizers transform the slices one by one: Adam's second moment
    gets the sum of the repeats' squares, not the square of their sum (the
    latter is Adam on the summed gradient, as on a dense one), and clipping
    measures or clips each repeat. Plain SGD, momentum and weight decay are
    linear in the gradient: repeats or their sum give the same update.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
    for clip in ("clipnorm", "clipvalue", "global_clipnorm"):
        if getattr(inner, clip, None):
            return f"its {clip} clips each repeated row's slice separately"
    if type(inner) is keras.optimizers.SGD:
        return None
    return (
        f"{type(inner).__name__}'s update is not linear in the gradient: "
        "Keras transforms each repeated row's slice separately (Adam: the "
        "sum of the repeats' squares; summed first: the square of their sum)"
    )


def loss_normaliser(y_pred, n):
    """What Keras divides a batch's loss by (reduction
    `"sum_over_batch_size"`): the `n` samples, or the valid entries of the
    prediction's Keras mask (`Embedding(mask_zero=True)`, `Masking`, a
    `compute_mask`). Weighting micro-batches by it makes the window equal
    one large batch: sum_j V_j * (S_j / V_j) / sum_j V_j = sum_j S_j / sum_j V_j.

    Returns:
        `(normaliser, exact)`: a float32 scalar, and False when the loss is
        a sum over several outputs of which one is masked (each output is
        normalised by its own count, which no one weight per micro-batch
        undoes).
    """
    outputs = tf.nest.flatten(y_pred)
    masks = [hooks.keras_mask(t) for t in outputs]
    masked = [m for m in masks if m is not None]
    if not masked:
        return n, True
    if len(outputs) > 1:
        return n, False
    return tf.reduce_sum(tf.cast(masked[0], tf.float32)), True


def sample_count(x):
    """The number of samples in a batch: the leading dim of its first input."""
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    return tf.cast(tf.shape(first)[0], tf.float32)


class GradientAccumulator:
    """Replica-local accumulators for a fixed list of trainable variables.

    Args:
        variables: the trainable variables whose gradients are accumulated.
        steps: micro-batches per optimizer update.
    """

    def __init__(self, variables, steps):
        self.steps = steps
        self.variable_ids = tuple(id(v) for v in variables)
        self.dtypes = [v.dtype for v in variables]
        # Which variables' windows keep the maximum (`overwrites_with_gradient`).
        self.keeps_max = [overwrites_with_gradient(v) for v in variables]
        # Which variables get a gradient; set when the train step is traced.
        self.grad_mask = [True] * len(variables)
        self.sums = [
            replica_local_variable(
                tf.zeros(v.shape, dtype=tf.float32), f"accumulated_{i}"
            )
            for i, v in enumerate(variables)
        ]
        # Samples accumulated on this replica, and micro-batches seen (finite
        # or not) since the last update.
        self.count = replica_local_variable(0.0, "accumulated_samples")
        self.micro_step = replica_local_variable(0, "accumulated_micro_batches", tf.int64)
        # Rows (samples) of the micro-batches added since the last update:
        # where the next one's Dropout rows start (`window_dropout`). The
        # train step sets `next_rows`, the rows its micro-batch adds.
        self.rows = replica_local_variable(0, "accumulated_rows", tf.int64)
        self.next_rows = None

    def matches(self, variables):
        return self.variable_ids == tuple(id(v) for v in variables)

    def add(self, weighted_grads, n):
        """Adds one micro-batch of `n` samples on this replica.

        `weighted_grads` are already `n` times the replica's mean gradient (the
        train step puts the weight on the scalar loss, where it is free),
        except for the `keeps_max` variables, whose values come unweighted.
        """
        triples = [
            (acc, tf.cast(g, tf.float32), keeps_max)
            for acc, g, keeps_max in zip(self.sums, weighted_grads, self.keeps_max)
            if g is not None
        ]

        # The first micro-batch overwrites, so a reset needs no pass of zeros.
        def overwrite():
            for acc, g, keeps_max in triples:
                acc.assign(tf.maximum(g, 0.0) if keeps_max else g)

        def add():
            for acc, g, keeps_max in triples:
                if keeps_max:
                    acc.assign(tf.maximum(acc, g))
                else:
                    acc.assign_add(g)

        tf.cond(self.count > 0.0, add, overwrite)
        self.count.assign_add(n)
        if self.next_rows is not None:  # a micro-batch dropped adds no rows
            self.rows.assign_add(self.next_rows)

    def pending(self, strategy):
        """The micro-batches added since the last update, read on the host
        (the first local replica's count: every replica counts the same)."""
        return int(strategy.experimental_local_results(self.micro_step)[0].numpy())

    def tick(self):
        """Counts a micro-batch; returns whether an update is due."""
        return self.micro_step.assign_add(1) >= self.steps

    def mean_gradients(self, total_count):
        """The accumulated gradients divided by the global sample count (the
        maxima of the `keeps_max` variables as they are), with `None` for
        variables that get no gradient."""
        # A replica that added nothing since the last reset holds stale sums.
        added = tf.cast(self.count > 0.0, tf.float32)
        factor = added / total_count
        return [
            tf.cast(acc * (added if keeps_max else factor), dtype) if has_grad else None
            for acc, dtype, has_grad, keeps_max in zip(
                self.sums, self.dtypes, self.grad_mask, self.keeps_max
            )
        ]

    def reset(self):
        """Starts a new window (the sums are overwritten by the next add)."""
        self.count.assign(0.0)
        self.micro_step.assign(0)
        self.rows.assign(0)
