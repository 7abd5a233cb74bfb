"""Shared by the fit-based callback benchmarks: the MLP, its data, and the
interleaved rounds that time `model.fit` per configuration.

Every configuration is warmed up, then timed once per round in a shuffled
order, all in one process; a ratio A/B is the median over rounds of A's time
over B's time in the same round.
"""

import random
import statistics
import time
import warnings

import tensorflow as tf

import keras
from keras_gradboost import zoo

BATCH = 256


def make(kind, steps_per_execution=1):
    """The MLP 784-1024-1024-10 as `keras.Model` ("keras") or GradBoostModel."""
    model = zoo.mlp(cls=keras.Model if kind == "keras" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss="sparse_categorical_crossentropy",
            steps_per_execution=steps_per_execution,
        )
    return model


def dataset():
    x, y = zoo.classification_data(BATCH * 8)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat().prefetch(2)


def time_fit(model, ds, steps, callbacks):
    """Seconds per step of one `fit` of `steps` steps."""
    start = time.perf_counter()
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks)
    return (time.perf_counter() - start) / steps


def interleaved(configs, ds, steps, rounds, warmup_steps=4):
    """Times `{name: (model, callbacks)}` in shuffled rounds after a warm-up.

    Returns:
        `{name: [seconds per step, one per round]}`.
    """
    for model, callbacks in configs.values():  # warm-up (traces, compiles)
        time_fit(model, ds, warmup_steps, callbacks)
    samples = {name: [] for name in configs}
    order = list(configs)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            model, callbacks = configs[name]
            samples[name].append(time_fit(model, ds, steps, callbacks))
    return samples


def ratios(samples, a, b):
    return [p / q for p, q in zip(samples[a], samples[b])]


def ratio(samples, a, b):
    """Median over rounds of a's time over b's time in the same round."""
    return statistics.median(ratios(samples, a, b))
