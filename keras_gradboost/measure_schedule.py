"""The schedule `jit_compile="measure"` and `precision="auto"` share: units
of two candidates, interleaved, the first ones untimed, a unit being whole
accumulation windows.

A unit runs one candidate for at least `calls_per_timing` train calls and
ends only where no micro-batch of an accumulation window is pending: after
a call that closed a window, or where an epoch's end flushed a partial one
(`EndsUnits`: at the epoch's end, after the flush, or before the next
call; an epoch shorter than a window closes none in its calls). So a
window never mixes candidates; a unit short of `calls_per_timing` calls at
an epoch's end goes on into the next epoch. Two reasons: both candidates
time as many updates (with one call per unit and 2 micro-batches per
window, one candidate would time only the calls that update); and a window
run half under XLA, half without, would draw its Dropout masks partly from
each random number generator, so it would be no large-batch step
(`window_dropout`).

`Schedule` is pure (no TensorFlow): the caller says how long a call took
and whether a window is pending after it and before the next.
"""

import dataclasses
import json
import math

# Untimed first units of each candidate (tracing, XLA compilation).
WARMUP_CALLS = 1
# Timed units of each candidate; the median decides.
TIMED_CALLS = 3
# Why a timed unit is left out of the medians: a call of it traced.
TRACED_NOTE = "they traced in a function made anew (after a load, or a callback's)"


def calls_per_timing(accumulate_steps, steps_per_execution):
    """Train calls that hold whole accumulation windows: each call runs
    `steps_per_execution` micro-batches, a window is `accumulate_steps`."""
    cycle = math.lcm(accumulate_steps, steps_per_execution)
    return cycle // steps_per_execution


class Schedule:
    """Units of two candidates: `warmup_calls` untimed units of each, then
    `timed_calls` timed units of each, interleaved (first, second, first,
    ...). Subclasses decide (`_decide`) when the last unit ends.

    Args:
        candidates: the two candidates, in the order they are run.
        warmup_calls: untimed first units of each candidate.
        timed_calls: timed units of each candidate.
        calls_per_timing: the fewest train calls in one unit (see
            `calls_per_timing`). Defaults to `1`.

    Raises:
        ValueError: if a count is not an int >= 1.
    """

    def __init__(self, candidates, warmup_calls, timed_calls, calls_per_timing=1):
        for name, value in (
            ("warmup_calls", warmup_calls),
            ("timed_calls", timed_calls),
            ("calls_per_timing", calls_per_timing),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Invalid value for argument `{name}`. Received: "
                    f"{name}={value!r}. Expected an int >= 1."
                )
        first, second = candidates
        self.candidates = (first, second)
        self.units = [(first, False), (second, False)] * warmup_calls + [
            (first, True),
            (second, True),
        ] * timed_calls
        self.warmup_calls = warmup_calls
        self.timed_calls = timed_calls
        self.calls_per_timing = calls_per_timing
        self.times = {first: [], second: []}  # ms per call of each timed unit
        # Timed units left out: a call of theirs traced (after a resume).
        self.dropped = {first: 0, second: 0}
        self.result = None
        self._total = len(self.units)
        self._calls = 0  # calls of the current unit so far
        self._seconds = 0.0  # and their time
        self._traced = False  # whether one of them traced

    def progress(self):
        """The measuring progress as plain values (for a checkpoint, as
        JSON: candidates that are not strings are keyed by their JSON;
        `resume` puts it back)."""
        return {
            "warmup_calls": self.warmup_calls,
            "timed_calls": self.timed_calls,
            "calls_per_timing": self.calls_per_timing,
            "units_done": self._total - len(self.units),
            "calls": self._calls,
            "seconds": self._seconds,
            "traced": self._traced,
            "times": {_key(c): list(ms) for c, ms in self.times.items()},
            "dropped": {_key(c): n for c, n in self.dropped.items()},
        }

    def resume(self, progress):
        """Goes on from `progress` (from `progress()`): the schedule's
        position, the timings and the current unit.

        Returns:
            None, or why it cannot (another schedule), with nothing changed.
        """
        theirs = tuple(progress[k] for k in ("warmup_calls", "timed_calls", "calls_per_timing"))
        ours = (self.warmup_calls, self.timed_calls, self.calls_per_timing)
        if theirs != ours:
            return (
                "it was saved with another schedule ((warm-up units, timed units, "
                f"calls per timing) {theirs}; this model's {ours}: other "
                "accumulate_steps or steps_per_execution)"
            )
        fresh = Schedule(self.candidates, *ours)
        done = int(progress["units_done"])
        self.units = fresh.units[done:]
        self.times = {c: [float(t) for t in progress["times"][_key(c)]] for c in self.candidates}
        self.dropped = {c: int(progress["dropped"][_key(c)]) for c in self.candidates}
        self._calls = int(progress["calls"])
        self._seconds = float(progress["seconds"])
        self._traced = bool(progress["traced"])
        self.result = None
        return None

    def restart(self):
        """Starts the schedule again from its first unit (a load of a file
        saved before any measuring)."""
        fresh = Schedule(self.candidates, self.warmup_calls, self.timed_calls, self.calls_per_timing)
        self.resume(fresh.progress())

    def in_unit(self, candidate):
        """Whether a unit of `candidate` has begun and not ended (its calls
        so far hold the pending window)."""
        return self.result is None and self._calls > 0 and self.units[0][0] == candidate

    def next_call(self):
        """`(candidate, timed)` of the next call."""
        return self.units[0]

    @property
    def started(self):
        """Whether a call was recorded."""
        return len(self.units) < self._total or self._calls > 0

    def record(self, seconds, traced=False, window_closed=True):
        """Records the call `next_call()` announced.

        Args:
            seconds: how long it took.
            traced: whether it traced its function (its timing says nothing
                of the step's speed: a timed unit holding it is left out).
            window_closed: whether no micro-batch is pending after it (an
                accumulation window closed with it, or there is none). The
                unit ends there if `due()`.
        """
        self._calls += 1
        self._seconds += seconds
        self._traced = self._traced or traced
        if window_closed and self.due():
            self.end_unit()

    def due(self):
        """Whether the current unit has its calls and ends where no window is
        pending (`end_unit`)."""
        return self._calls >= self.calls_per_timing

    def end_unit(self):
        """Ends the current unit (call where `due()` and no micro-batch is
        pending: after its last call, or before the next call where an
        epoch's end flushed a window); the decision after the last."""
        candidate, timed = self.units.pop(0)
        if timed and self._traced:
            self.dropped[candidate] += 1
        elif timed:
            self.times[candidate].append(self._seconds * 1000 / self._calls)
        self._calls, self._seconds, self._traced = 0, 0.0, False
        if not self.units:
            self.result = self._decide()

    def unit_note(self):
        """How long a unit is, for the decision's reason ("" for one call)."""
        if self.calls_per_timing == 1:
            return ""
        return f"{self.calls_per_timing} calls per timing, whole accumulation windows"

    def _decide(self):
        raise NotImplementedError


def _key(candidate):
    """A candidate as a JSON object key."""
    return candidate if isinstance(candidate, str) else json.dumps(candidate)


def saved_record(record, measurement, measured, measurer):
    """`record` (plain values) with the decision or the measuring progress,
    for a checkpoint: the decision `measurement` (a dataclass with a
    `restored` field) where it was `measured`; else the progress of
    `measurer` once started; None when there is neither."""
    if measurement is not None:
        if not measured:
            return None
        decision = dataclasses.asdict(measurement)
        decision.pop("restored")
        return {**record, "decision": decision}
    if measurer is None or not measurer.started:
        return None
    return {**record, "progress": measurer.progress()}


def encode_state(record):
    """`record` (plain values) as a uint8 array (JSON), storable in a Keras
    weights file."""
    import numpy as np

    return np.frombuffer(json.dumps(record).encode("utf-8"), dtype=np.uint8)


def decode_state(array):
    """The record `encode_state` stored."""
    import numpy as np

    return json.loads(np.asarray(array, dtype=np.uint8).tobytes().decode("utf-8"))


class EndsUnits:
    """What a measuring train function (with `measurer`, `window_closed`,
    `on_decided` and `chosen()`, the chosen candidate's function) does
    where a window may have closed between calls."""

    def end_unit_if_due(self):
        """Ends the current unit where it has its calls and no window is
        pending (before a call, or at an epoch's end after its flush), and
        calls `on_decided` if that decides."""
        measurer = self.measurer
        if measurer.result is None and measurer.due() and self.window_closed():
            measurer.end_unit()
            if measurer.result is not None:
                self.on_decided(measurer.result, self.chosen())
