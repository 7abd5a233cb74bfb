"""cpu_threads: TensorFlow's own setting first, then its environment
variable, then the CPUs this process may run on."""

import os

import tensorflow as tf

from keras_gradboost import cpu_threads


def test_setting_then_variable_then_cpus(monkeypatch):
    monkeypatch.setattr(tf.config.threading, "get_inter_op_parallelism_threads", lambda: 0)
    monkeypatch.setattr(tf.config.threading, "get_intra_op_parallelism_threads", lambda: 0)
    monkeypatch.delenv("TF_NUM_INTEROP_THREADS", raising=False)
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert cpu_threads.inter_op() == cpu_threads.intra_op() == cpus
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "3")
    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "not a number")
    assert (cpu_threads.inter_op(), cpu_threads.intra_op()) == (3, cpus)
    monkeypatch.setattr(tf.config.threading, "get_inter_op_parallelism_threads", lambda: 5)
    assert cpu_threads.inter_op() == 5
