"""`precision="auto"` (and `"measure"`): time the first training calls of
`fit` in float32 and in the device's mixed policy, then keep the faster.

The candidates are float32 and mixed_bfloat16 on a CPU, float32 and
mixed_float16 on a GPU (`precision.measure_candidates`). Every measured call
is a real training call on the batches `fit` draws: nothing is run twice and
nothing is skipped. Both candidates are train functions of the same model,
traced with the layers set to their policy (`precision.apply_policy`, set
before each of their calls: a layer's policy is read when a function
traces). Variables stay float32 under the mixed policies, so both update the
same variables, optimizer state, loss scale and accumulation window: a
measured fit equals one whose calls take the candidates' policies in the
measured order.

The schedule is `measure_schedule`'s, shared with `jit_measure`: the first
unit of each candidate traces and is not timed; then `TIMED_CALLS` of each
are timed, interleaved (float32, mixed, float32, ...), each call
synchronised with the host by reading one value of its logs. With
`accumulate_steps > 1` a unit is whole accumulation windows: at least
`calls_per_timing` calls, ending only where no window is pending (a unit
short of its calls at an epoch's end goes on into the next epoch), so each
candidate times as many
updates as the other and no window mixes policies. The mixed policy wins only with a lower
median (a tie keeps float32). From then on only the winner runs, and the
layers hold its policy (so `evaluate` and `predict` use it).

Before the first call the layers hold the static rule's pick
(`precision.resolve_precision`); while measuring, the policy of the last
call (a validation in between runs in it; the test and predict functions
are made again after the decision). The static rule stays, decided at `compile()` with a warning and
a `PrecisionMeasurement` whose `measured` is False, under `run_eagerly=True`
and under MultiWorkerMirroredStrategy, ParameterServerStrategy and
TPUStrategy (each worker would time its own steps and might choose another
policy), and under `jit_compile="measure"` (precision is measured under a
fixed jit setting; `"measure"` is refused with it instead,
`plan.check_measure_conflicts`). One process's MirroredStrategy is
measured (its replicas trace under the same layers). With a float16
candidate (on a GPU) `loss_scale="auto"` scales both candidates' loss with
the one `LossScaler` they share, and keeps scaling if float32 wins (exact:
the scale is a power of two).

The choice is saved with the weights (`saved_state`, in the model's
training state: `keras_gradboost.checkpoint`), so a loaded model, or a
BackupAndRestore resume, trains on in the policy the saved run chose,
without measuring again (`PrecisionMeasurement.restored`). A file saved
while still measuring holds the measuring progress: the schedule's
position, the timings so far and the current unit's calls; the loaded model
goes on with the same schedule, call for call, as the saved run would have.
A timed call that traces in the new process (the first call of each
candidate there) is not timed: it stays in the schedule, its timing is left
out of the median (the reason says how many). A decision or progress saved
among other candidates (another device: mixed_float16 on a GPU,
mixed_bfloat16 on a CPU), or progress of another schedule
(`calls_per_timing`: other `accumulate_steps` or `steps_per_execution`), is
not adopted: a warning names both, and the model measures again.

`Measurer` is the pure part (schedule, medians, decision) with an injectable
clock; `MeasuringTrainFunction` adapts it to Keras' train function.
"""

import dataclasses
import math
import statistics
import time

from keras_gradboost import jit_measure
from keras_gradboost import measure_schedule
from keras_gradboost import wrappers

WARMUP_CALLS = measure_schedule.WARMUP_CALLS
TIMED_CALLS = measure_schedule.TIMED_CALLS


@dataclasses.dataclass(frozen=True)
class PrecisionMeasurement:
    """What `precision="auto"` (or `"measure"`) found and chose.

    Attributes:
        policy: the choice: a dtype policy name.
        mixed_policy: the mixed candidate timed against float32
            (`"mixed_bfloat16"` on a CPU, `"mixed_float16"` on a GPU).
        float32_ms: median time of a timed float32 train call, in ms (None
            when not measured).
        mixed_ms: median time of a timed `mixed_policy` train call, in ms
            (None when not measured).
        timed_calls: timed units of each candidate.
        calls_per_timing: train calls in one timed unit (whole accumulation
            windows); the medians are per call.
        reason: one line saying why this choice was made.
        restored: whether it was loaded with the weights (measured by the
            run that saved them) rather than measured by this model.
    """

    policy: str
    mixed_policy: str = "mixed_bfloat16"
    float32_ms: object = None
    mixed_ms: object = None
    timed_calls: int = 0
    calls_per_timing: int = 1
    reason: str = ""
    restored: bool = False

    @property
    def measured(self):
        """Whether the choice comes from timing (False: the static rule)."""
        return self.float32_ms is not None

    def message(self, precision="auto"):
        """The one-line report printed when the choice is made, for the
        `precision` compile argument that measured."""
        restored = " (restored with the weights, not measured again)" if self.restored else ""
        return f'precision="{precision}": {self.policy}; {self.reason}{restored}.'


class Measurer(measure_schedule.Schedule):
    """The schedule and the decision of `precision="auto"`.

    Args:
        candidates: `(float32 policy, mixed policy)`, timed in this order.
        warmup_calls: untimed first units of each candidate. Defaults to
            `WARMUP_CALLS`.
        timed_calls: timed units of each candidate. Defaults to
            `TIMED_CALLS`.
        calls_per_timing: the fewest train calls in one unit (see
            `measure_schedule`: a unit is whole accumulation windows).
            Defaults to `1`.

    Raises:
        ValueError: if a count is not an int >= 1, or `candidates` is not
            two different policies starting with `"float32"`.
    """

    def __init__(
        self,
        candidates,
        warmup_calls=WARMUP_CALLS,
        timed_calls=TIMED_CALLS,
        calls_per_timing=1,
    ):
        candidates = tuple(candidates)
        if len(candidates) != 2 or candidates[0] != "float32" or candidates[1] == "float32":
            raise ValueError(
                "Invalid value for argument `candidates`. Received: "
                f"candidates={candidates!r}. Expected (\"float32\", a mixed "
                "policy)."
            )
        super().__init__(candidates, warmup_calls, timed_calls, calls_per_timing)

    def _decide(self):
        float32, mixed = self.candidates
        left_out = ""
        if any(self.dropped.values()):
            counts = " and ".join(f"{n} {p}" for p, n in self.dropped.items() if n)
            left_out = f"; {counts} timing(s) left out: {measure_schedule.TRACED_NOTE}"
        unit = "; " + self.unit_note() if self.calls_per_timing > 1 else ""
        missing = [p for p in self.candidates if not self.times[p]]
        if missing:
            plain = statistics.median(self.times[float32]) if self.times[float32] else None
            half = statistics.median(self.times[mixed]) if self.times[mixed] else None
            return PrecisionMeasurement(
                policy=float32,
                mixed_policy=mixed,
                float32_ms=plain if plain is not None else math.nan,
                mixed_ms=half,
                timed_calls=self.timed_calls,
                calls_per_timing=self.calls_per_timing,
                reason=(
                    f"no timing of {' and '.join(missing)} is left (every timed call "
                    f"of it traced: {measure_schedule.TRACED_NOTE}): float32 kept{left_out}"
                ),
            )
        plain = statistics.median(self.times[float32])
        half = statistics.median(self.times[mixed])
        faster = half < plain
        winner, loser = (mixed, float32) if faster else (float32, mixed)
        return PrecisionMeasurement(
            policy=winner,
            mixed_policy=mixed,
            float32_ms=plain,
            mixed_ms=half,
            timed_calls=self.timed_calls,
            calls_per_timing=self.calls_per_timing,
            reason=(
                f"median {min(plain, half):.2f} ms per train call vs "
                f"{max(plain, half):.2f} ms in {loser} ({self.timed_calls} "
                f"timed calls each{unit}{left_out})"
            ),
        )


def perf_counter():
    """The clock `MeasuringTrainFunction` reads by default (looked up at each
    call, so a test can replace it)."""
    return time.perf_counter()


class MeasuringTrainFunction(measure_schedule.EndsUnits):
    """A train function that runs the float32 or the mixed one, unit by
    unit (`measure_schedule`), as a `Measurer` says, until it decides.

    Args:
        model: the compiled model.
        functions: `{policy: train function}` for both candidates, made by
            Keras for the same model and optimizer (traced at their first
            call, under the layers' policy then).
        set_policy: callable `(policy)` that sets `policy` on the model's
            layers; called before each call of a candidate.
        on_decided: callable `(measurement, function)` called once, with the
            `PrecisionMeasurement` and the chosen function.
        clock: callable returning seconds. Defaults to `None`: this
            module's `perf_counter`.
        measurer: the `Measurer`. Defaults to a new one over `functions`'
            policies with the default schedule.
        window_closed: callable telling whether no micro-batch of an
            accumulation window is pending (a host read, after each
            measured call and where a unit has its calls: a unit ends only
            then). Defaults to `None`: always.
    """

    def __init__(
        self, model, functions, set_policy, on_decided, clock=None, measurer=None,
        window_closed=None,
    ):
        self.model = model
        self.functions = functions
        self.set_policy = set_policy
        self.on_decided = on_decided
        self.clock = clock
        self.measurer = measurer or Measurer(tuple(functions))
        self.window_closed = window_closed or (lambda: True)
        self._called = set()  # the candidates called (so traced) already
        wrappers.runs_batches(self)

    @property
    def result(self):
        return self.measurer.result

    def chosen(self):
        """The chosen candidate's train function (once decided)."""
        return self.functions[self.result.policy]

    def __call__(self, iterator):
        batches = wrappers.draw_batches(self.model, iterator)
        if not batches:
            raise StopIteration
        self.end_unit_if_due()  # where an epoch's end flushed its window
        if self.result is not None:  # decided, or a stale reference: the choice
            return wrappers.run_batches(self.model, self.chosen(), batches)
        policy, _ = self.measurer.next_call()
        # Read when the candidate's function traces (its first call, or a
        # retrace for a new chunk length): the layers must hold its policy.
        self.set_policy(policy)
        clock = self.clock or perf_counter
        start = clock()
        logs = wrappers.run_batches(self.model, self.functions[policy], batches)
        jit_measure.sync_logs(logs)
        traced = policy not in self._called
        self._called.add(policy)
        self.measurer.record(
            clock() - start, traced=traced, window_closed=self.window_closed()
        )
        if self.result is not None:
            self.on_decided(self.result, self.chosen())
        return logs


# ------------------------------------------------------------ checkpoints

STATE_FORMAT = 1


def saved_state(candidates, measurement, measurer):
    """What a checkpoint keeps of `precision="auto"`, as plain values:
    the candidates and either the decision (when measured) or the measuring
    progress (`Measurer.progress`); None when there is neither (not
    started, or the static rule's pick: nothing was measured)."""
    return measure_schedule.saved_record(
        {"format": STATE_FORMAT, "candidates": list(candidates)},
        measurement,
        measurement is not None and measurement.measured,
        measurer,
    )


encode_state = measure_schedule.encode_state
decode_state = measure_schedule.decode_state


def restored_measurement(decision):
    """The `PrecisionMeasurement` of a saved decision, marked restored."""
    return PrecisionMeasurement(**decision, restored=True)


def describe(record):
    """A saved record in a few words, for warnings."""
    if "decision" in record:
        return f'a measured precision decision ({record["decision"]["policy"]})'
    progress = record["progress"]
    total = 2 * (progress["warmup_calls"] + progress["timed_calls"])
    return (
        f'precision measuring progress ({progress["units_done"]} of {total} timings '
        f'done, {progress["calls"]} call(s) into the next)'
    )
