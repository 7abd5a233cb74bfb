"""How many threads TensorFlow's CPU runtime uses, as it chooses them: its
setting (`tf.config.threading`), else its environment variable, else the
CPUs this process may run on."""

import os

import tensorflow as tf


def intra_op():
    """The threads TensorFlow's CPU kernels share a batch among."""
    return _threads(tf.config.threading.get_intra_op_parallelism_threads(),
                    "TF_NUM_INTRAOP_THREADS")


def inter_op():
    """The independent ops TensorFlow's executor runs at once on the CPU."""
    return _threads(tf.config.threading.get_inter_op_parallelism_threads(),
                    "TF_NUM_INTEROP_THREADS")


def _threads(configured, variable):
    if configured:
        return configured
    try:
        configured = int(os.environ.get(variable, "0"))
    except ValueError:
        configured = 0
    if configured > 0:
        return configured
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
