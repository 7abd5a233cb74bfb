"""`precision="measure"`: time the first training calls of `fit` in float32
and in the device's mixed policy, then keep the faster.

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

The schedule is `jit_measure`'s: the first call of each candidate traces and
is not timed; then `TIMED_CALLS` of each are timed, interleaved (float32,
mixed, float32, ...), each synchronised with the host by reading one value
of its logs. With `accumulate_steps > 1` a timed unit is as many calls as
make whole accumulation windows (`calls_per_timing`), so each candidate
times as many updates as the other. The mixed policy wins only with a lower
median (a tie keeps float32). From then on only the winner runs, and the
layers hold its policy (so `evaluate` and `predict` use it).

Before the first call the layers hold the static `precision="auto"` rule's
pick; while measuring, the policy of the last call (a validation in between
runs in it; the test and predict functions are made again after the
decision). The static rule stays, decided at `compile()` with a warning and
a `PrecisionMeasurement` whose `measured` is False, under `run_eagerly=True`
and under MultiWorkerMirroredStrategy, ParameterServerStrategy and
TPUStrategy (each worker would time its own steps and might choose another
policy). One process's MirroredStrategy is measured (its replicas trace
under the same layers). `jit_compile="measure"` together with it is refused
(`plan.check_measure_conflicts`): precision is measured under a fixed jit
setting. The choice is not saved: a loaded model, or a BackupAndRestore
resumed in a new process, measures again, so its first steps may take other
policies than the uninterrupted run's (exact resumption needs a fixed
precision). With a float16 candidate (on a GPU) `loss_scale="auto"` scales
both candidates' loss with the one `LossScaler` they share, and keeps
scaling if float32 wins (exact: the scale is a power of two).

`Measurer` is the pure part (schedule, medians, decision) with an injectable
clock; `MeasuringTrainFunction` adapts it to Keras' train function.
"""

import dataclasses
import math
import statistics
import time

from keras_gradboost import jit_measure
from keras_gradboost import wrappers

# Untimed first units of each candidate (tracing).
WARMUP_CALLS = jit_measure.WARMUP_CALLS
# Timed units of each candidate; the median decides.
TIMED_CALLS = jit_measure.TIMED_CALLS


@dataclasses.dataclass(frozen=True)
class PrecisionMeasurement:
    """What `precision="measure"` found and chose.

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
    """

    policy: str
    mixed_policy: str = "mixed_bfloat16"
    float32_ms: object = None
    mixed_ms: object = None
    timed_calls: int = 0
    calls_per_timing: int = 1
    reason: str = ""

    @property
    def measured(self):
        """Whether the choice comes from timing (False: the static rule)."""
        return self.float32_ms is not None

    def message(self):
        """The one-line report printed when the choice is made."""
        return f'precision="measure": {self.policy}; {self.reason}.'


def calls_per_timing(accumulate_steps, steps_per_execution):
    """Train calls that hold whole accumulation windows: each call runs
    `steps_per_execution` micro-batches, a window is `accumulate_steps`."""
    cycle = math.lcm(accumulate_steps, steps_per_execution)
    return cycle // steps_per_execution


class Measurer:
    """The schedule and the decision of `precision="measure"`.

    Args:
        candidates: `(float32 policy, mixed policy)`, timed in this order.
        warmup_calls: untimed first units of each candidate. Defaults to
            `WARMUP_CALLS`.
        timed_calls: timed units of each candidate. Defaults to
            `TIMED_CALLS`.
        calls_per_timing: train calls in one unit (see
            `calls_per_timing`). Defaults to `1`.

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
        candidates = tuple(candidates)
        if len(candidates) != 2 or candidates[0] != "float32" or candidates[1] == "float32":
            raise ValueError(
                "Invalid value for argument `candidates`. Received: "
                f"candidates={candidates!r}. Expected (\"float32\", a mixed "
                "policy)."
            )
        self.candidates = candidates
        float32, mixed = candidates
        self.units = [(float32, False), (mixed, False)] * warmup_calls + [
            (float32, True),
            (mixed, True),
        ] * timed_calls
        self.timed_calls = timed_calls
        self.calls_per_timing = calls_per_timing
        self.times = {float32: [], mixed: []}
        self.result = None
        self._calls = 0  # calls of the current unit so far
        self._seconds = 0.0  # and their time

    def next_call(self):
        """`(policy, timed)` of the next call."""
        return self.units[0]

    def record(self, seconds):
        """Records the duration of the call `next_call()` announced."""
        self._calls += 1
        self._seconds += seconds
        if self._calls < self.calls_per_timing:
            return
        policy, timed = self.units.pop(0)
        if timed:
            self.times[policy].append(self._seconds * 1000 / self._calls)
        self._calls, self._seconds = 0, 0.0
        if not self.units:
            self.result = self._decide()

    def _decide(self):
        float32, mixed = self.candidates
        plain = statistics.median(self.times[float32])
        half = statistics.median(self.times[mixed])
        faster = half < plain
        winner, loser = (mixed, float32) if faster else (float32, mixed)
        unit = (
            f"; {self.calls_per_timing} calls per timing, whole accumulation windows"
            if self.calls_per_timing > 1
            else ""
        )
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
                f"timed calls each{unit})"
            ),
        )


def perf_counter():
    """The clock `MeasuringTrainFunction` reads by default (looked up at each
    call, so a test can replace it)."""
    return time.perf_counter()


class MeasuringTrainFunction:
    """A train function that runs the float32 or the mixed one, call by
    call, as a `Measurer` says, until it decides.

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
    """

    def __init__(self, model, functions, set_policy, on_decided, clock=None, measurer=None):
        self.model = model
        self.functions = functions
        self.set_policy = set_policy
        self.on_decided = on_decided
        self.clock = clock
        self.measurer = measurer or Measurer(tuple(functions))
        wrappers.runs_batches(self)

    @property
    def result(self):
        return self.measurer.result

    def __call__(self, iterator):
        batches = wrappers.draw_batches(self.model, iterator)
        if not batches:
            raise StopIteration
        if self.result is not None:  # a stale reference: run the choice
            chosen = self.functions[self.result.policy]
            return wrappers.run_batches(self.model, chosen, batches)
        policy, _ = self.measurer.next_call()
        # Read when the candidate's function traces (its first call, or a
        # retrace for a new chunk length): the layers must hold its policy.
        self.set_policy(policy)
        clock = self.clock or perf_counter
        start = clock()
        logs = wrappers.run_batches(self.model, self.functions[policy], batches)
        jit_measure.sync_logs(logs)
        self.measurer.record(clock() - start)
        if self.result is not None:
            self.on_decided(self.result, self.functions[self.result.policy])
        return logs
