"""A SIGTERM to any worker, turned into one step at which every worker saves.

A cluster manager that reclaims a machine sends its process SIGTERM and,
after a grace period, SIGKILL. Saving at once is not possible (the signal
arrives in the middle of a step, which the other workers are running too),
and saving at different steps on different workers would write a backup
that no worker's state matches. So the workers agree on a step first, the
way TensorFlow's `PreemptionCheckpointHandler` does for custom loops:

* the signal handler only sets a flag (a handler may run between any two
  Python bytecodes, so it does nothing else);
* at its next step end, the signalled worker proposes "the step after this
  one" in the cluster's coordination service, and waits until every
  worker has acknowledged it;
* every worker watches for that proposal in a background thread, which
  takes the value and acknowledges it. Workers step together (each step
  all-reduces), so when the signalled worker goes on, no worker has
  finished the proposed step yet: all of them reach it knowing it.

One process (one device or `MirroredStrategy`) needs no agreement: its
proposal is the next step end. `PreemptionNotice.due(steps_done)` is the
same test on every worker: True from the agreed step on.
"""

import itertools
import os
import signal
import threading
import warnings

from keras_gradboost import cluster
from keras_gradboost import hooks

# Bounds every wait for the other workers: a worker that died is not waited
# for forever (TensorFlow notices a dead peer in about 10 s).
ACK_TIMEOUT_SECONDS = 20.0
_STOP = "stop"
# The same sequence on every worker (each runs the same fit() calls): the
# keys of one fit() are never those of another.
_fits = itertools.count()


class PreemptionNotice:
    """Watches for SIGTERM during one `fit()` and agrees on the step at which
    every worker saves.

    Args:
        strategy: the model's `tf.distribute` strategy.
        running: called with the frame a signal interrupted, says whether
            the `fit()` is still running there. A SIGTERM that comes after
            a `fit()` that raised (so never reached its end, where the
            handler is put back) goes to the handler from before, as if
            this one had never been installed. Defaults to `None` (always
            running).
    """

    def __init__(self, strategy, running=None):
        self.strategy = strategy
        self._running = running
        self.workers = cluster.worker_count(strategy)
        self.index = cluster.worker_index(strategy)
        self.key = f"keras_gradboost/preemption/{next(_fits)}"
        self.signalled = False  # this process got SIGTERM
        self.step = None  # the agreed step (a count of step ends)
        self._proposed = False
        self._previous = None
        self._watcher = None

    def start(self):
        """Installs the SIGTERM handler (and the watcher thread when several
        workers train together).

        Raises:
            ValueError: when not called from the main thread (Python runs
                signal handlers there only).
        """
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "save_before_preemption=True needs fit() to run in the main "
                "thread: Python delivers SIGTERM to the main thread only. Run "
                "fit() in the main thread, or set save_before_preemption=False."
            )
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.workers > 1:
            self._watcher = threading.Thread(
                target=self._watch, name="keras_gradboost preemption watch", daemon=True
            )
            self._watcher.start()

    def _on_sigterm(self, signum, frame):
        if self._running is None or self._running(frame):
            self.signalled = True
            return
        previous, self._previous = self._previous, None
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # delivered again: the default ends the process

    def _watch(self):
        value = hooks.coordination_get(self.key)
        if value == _STOP:
            return
        self.step = int(value)  # before the acknowledgement, which lets the proposer go on
        hooks.coordination_set(f"{self.key}/ack/{self.index}", "1")

    def due(self, steps_done):
        """Whether the workers save now, after `steps_done` step ends of this
        `fit()` (the same count on every worker)."""
        if self.signalled and self.step is None and not self._proposed:
            self._propose(steps_done)
        return self.step is not None and steps_done >= self.step

    def _propose(self, steps_done):
        self._proposed = True  # once: a proposal that timed out is not repeated
        if self.workers == 1:
            self.step = steps_done
            return
        try:
            hooks.coordination_set(self.key, str(steps_done + 1))
        except hooks.CoordinationKeyExists:
            # Another worker proposed first (its step holds), or the fit()
            # ended (the chief's "stop"): the signal is acted on at its end.
            if hooks.coordination_get(self.key) == _STOP:
                return
        try:
            for i in range(self.workers):
                hooks.coordination_get(f"{self.key}/ack/{i}", ACK_TIMEOUT_SECONDS)
        except TimeoutError as e:
            warnings.warn(
                f"Preemption: not every worker acknowledged the step to save at "
                f"within {ACK_TIMEOUT_SECONDS:g} s ({e}); a worker may have "
                "died. Training goes on until TensorFlow notices it.",
                stacklevel=3,
            )

    def stop(self):
        """Puts the previous SIGTERM handler back and ends the watcher thread.

        Returns:
            Whether this process got SIGTERM during the `fit()` (and has not
            acted on it: the caller re-raises it).
        """
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._watcher is not None:
            if cluster.is_chief(self.strategy):
                try:  # wakes every worker's watcher that got no proposal
                    hooks.coordination_set(self.key, _STOP)
                except hooks.CoordinationKeyExists:
                    pass
            self._watcher = None  # a daemon: it never holds the process
        return self.signalled
