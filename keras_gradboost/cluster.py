"""Where this process stands in a `tf.distribute` cluster: how many worker
processes train together, which one this is, and whether it is the one
that writes shared files.

One process (no strategy, one device, `MirroredStrategy`) is a cluster of
one worker, its chief. Under `MultiWorkerMirroredStrategy` the numbers come
from the strategy's public `cluster_resolver` (the `TF_CONFIG` the cluster
manager, or `keras_gradboost.launch`, set) and the chief is the worker
`strategy.extended.should_checkpoint` names (worker 0, or the `"chief"`
task).
"""

import tensorflow as tf


def _resolver(strategy):
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    return strategy.cluster_resolver


def worker_count(strategy):
    """The number of worker processes training together (1 for one process)."""
    resolver = _resolver(strategy)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec().as_dict()
    return max(1, len(spec.get("chief", [])) + len(spec.get("worker", [])))


def worker_index(strategy):
    """This process's index among the `worker_count(strategy)` workers: the
    chief task is 0 and the workers follow it; without a chief task, the
    worker's own index."""
    resolver = _resolver(strategy)
    if resolver is None or worker_count(strategy) == 1:
        return 0
    spec = resolver.cluster_spec().as_dict()
    if resolver.task_type == "chief":
        return 0
    return int(resolver.task_id) + len(spec.get("chief", []))


def is_multi_worker(strategy):
    """Whether several worker processes train together."""
    return worker_count(strategy) > 1


def is_chief(strategy):
    """Whether this process writes the files all workers share (always true
    for one process)."""
    return not is_multi_worker(strategy) or bool(strategy.extended.should_checkpoint)
