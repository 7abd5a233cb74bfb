"""Shared by the fit-based callback benchmarks: the MLP, its data, and the
paired rounds that time `model.fit` with and without callbacks.

Every configuration is warmed up, then each pair (A, B) is timed back to
back once per round, all in one process; a ratio B/A is the median over all
pairs of B's time over A's time, given with a bootstrap 95% confidence
interval.
"""

import random
import statistics
import time
import warnings

import tensorflow as tf

import keras
from keras_gradboost import zoo

BATCH = 256


def make(kind, steps_per_execution=1, keras_guard=False):
    """The MLP 784-1024-1024-10 as `keras.Model` ("keras") or GradBoostModel.

    With `keras_guard`, its Adam is wrapped in Keras' own
    `LossScaleOptimizer` with a scale of 1 that never grows: only Keras'
    finiteness guard acts (it skips a non-finite update), the anchor the
    NaNWatcher's cost is measured against.
    """
    model = zoo.mlp(cls=keras.Model if kind == "keras" else None)
    optimizer = keras.optimizers.Adam(1e-3)
    if keras_guard:
        optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=1.0, dynamic_growth_steps=2**30
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            steps_per_execution=steps_per_execution,
        )
    return model


def dataset():
    """The MLP's data, repeated, with tf.data autotuning off.

    Each `fit` makes a new iterator and deletes it at the end. With
    autotuning on, that delete can wait for the autotune thread's next
    wake-up (it sleeps 10, 20, 40, ... ms, so at about 0.63 s and 1.27 s
    after the iterator was made): a 32-step fit of this MLP ends in that
    window and took 1.27 s or 0.75 s at random, which is where the "39.6 ms
    or 26 ms per step" modes came from. It is the same for every
    configuration and is no part of what is measured.
    """
    x, y = zoo.classification_data(BATCH * 8)
    options = tf.data.Options()
    options.autotune.enabled = False
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat().prefetch(2)
    return data.with_options(options)


def time_fit(model, ds, steps, callbacks):
    """Seconds per step of one `fit` of `steps` steps."""
    start = time.perf_counter()
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks)
    return (time.perf_counter() - start) / steps


def paired(pairs, ds, steps, rounds, warmup_steps=4, seed=0):
    """Times pairs of `fit`s back to back, many times.

    On this machine the time of a 16-step window varies by about 7% from one
    window to the next, callbacks or not. A 2% overhead shows only in the
    median of many ratios, each taken between two fits run back to back
    (what drifts slowly cancels in the ratio). The two fits of a pair run in
    alternating order, so neither side always runs first.

    Args:
        pairs: `{name: [(a, b), ...]}`, where `a` and `b` are
            `(model, callbacks)`; a name may list several model instances,
            whose pairs are pooled (any per-instance luck averages out).
        ds: the dataset to fit on.
        steps: steps per timed fit.
        rounds: each round times every pair once, in a shuffled order.
        warmup_steps: steps of the untimed fit of every configuration first
            (traces, compiles).
        seed: seeds the shuffle.

    Returns:
        `{name: [(a seconds per step, b seconds per step), ...]}`.
    """

    def timed(side, steps=steps):
        model, callbacks = side
        return time_fit(model, ds, steps, callbacks)

    for instances in pairs.values():
        for a, b in instances:
            timed(a, warmup_steps)
            timed(b, warmup_steps)
    times = {name: [] for name in pairs}
    jobs = [(name, i) for name, instances in pairs.items() for i in range(len(instances))]
    rng = random.Random(seed)
    for round_ in range(rounds):
        rng.shuffle(jobs)
        for name, i in jobs:
            a, b = pairs[name][i]
            if round_ % 2:
                tb, ta = timed(b), timed(a)
            else:
                ta, tb = timed(a), timed(b)
            times[name].append((ta, tb))
    return times


def ratio(times):
    """Median of b/a over the pairs of `paired`, and a bootstrap 95%
    confidence interval of that median."""
    values = [b / a for a, b in times]
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(2000)
    )
    return statistics.median(values), (medians[50], medians[1949])


def step_ms(times):
    """Median milliseconds per step of each side of the pairs."""
    a, b = zip(*times)
    return 1000 * statistics.median(a), 1000 * statistics.median(b)
