"""The interaction matrix: compile features x callbacks x NaNWatcher actions.

Every cell is one `GradBoostModel.fit` (2 epochs of 8 batches of 4 on a tiny
model) checked against an independent reference: a plain `keras.Model` of the
same architecture and initial weights, run eagerly with `train_on_batch` on
the large batches the documented behaviour asks for (see `epoch_schedule`).
A cell either equals its reference (weights within a tolerance relative to
how far a clean run moves them, the same number of optimizer updates, the
same NaNWatcher events and learning rate, `recompute_plan()` unchanged by
the fit, the callbacks changing nothing, the logged loss finite) or refuses at compile/fit with a
ValueError/TypeError whose message names the conflicting options (see
`REFUSALS`).

The factors are in `FACTORS`, one device or MirroredStrategy over two
logical CPUs among them. Their full product (60,480 valid cells) is too
slow here, so `all_pairs` generates a seeded greedy pairwise design: every
allowed pair of values of any two factors appears in at least one cell
(20 cells: of the seeds 0-299, the fewest cells and among the cheapest to
run; seed 12's 24 took about 25 s more of CI). `benchmarks/interaction_matrix.py` runs the full product, or a
seeded sample of it, with these same checks. `SPECIFIC` adds the known-risky cells the design reaches only by
chance. A cell that runs into a known defect of the recovery issue (issue
14's numbers, `DEFECTS`) is marked `xfail(strict=True, raises=KnownDefect)`:
it xfails only when every failed check is one its defects explain and each
of its defects still shows; any other failed check fails the test, and so
does a defect that no longer shows (the day it is fixed the test says so).

`pytest -s tests/test_interactions.py` prints the matrix as a table at the
end of the module (also without `-s`, through the terminal reporter).
"""

import contextlib
import dataclasses
import itertools
import json
import random
import tempfile
import warnings

from unittest import mock

import numpy as np
import pytest

import keras
from conftest import InterruptAt
from conftest import shared_mirrored_strategy
from test_depthwise_chunked import slices_recorder
from keras_gradboost import GradBoostModel
from keras_gradboost import depthwise
from keras_gradboost import jit_measure
from keras_gradboost import precision_measure
from keras_gradboost import wrappers
from keras_gradboost.callbacks import BackupAndRestore
from keras_gradboost.callbacks import GradientAuditor
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import NonFiniteError
from keras_gradboost.callbacks import RetraceCounter
from keras_gradboost.callbacks import StepTimeMonitor

BATCH = 4  # samples per batch (micro-batch under accumulation)
BATCHES = 8  # batches per epoch
EPOCHS = 2
K = 4  # accumulate_steps when on: windows (0-3), (4-7)
LR = 0.1
LR_FACTOR = 0.5  # NaNWatcher's default
SEED = 49  # of the pairwise design

# Tolerance on max |w - w_ref|, relative to how far a clean run (no NaN, no
# watcher) moves the weights: one update is several percent of that.
# precision="measure" ("bfloat16"): some of the steps (all of them once it
# keeps mixed_bfloat16) compute in bfloat16 (8 significant bits).
RTOL = {"float32": 2e-5, "xla": 2e-4, "float16": 1e-2, "bfloat16": 1e-2}
# The nested model's tower (8 Dense layers over 64 positions) in bfloat16
# ends 6.5% of a clean run's movement from the float32 reference, with
# recompute or without; a measured cell with recompute is also compared
# with the same cell without it, exactly.
RTOL_NESTED_BFLOAT16 = 1e-1
# Callbacks must not change training, nor recompute a measured cell's: the
# same cell without them, exactly (the same traced step), or at float32
# round-off.
SAME_CELL_ATOL = 1e-6

FACTORS = {
    "model": ("mlp", "residual"),
    "optimizer": ("sgd", "momentum"),
    "accumulate_steps": (1, K),
    "steps_per_execution": (1, 3),
    "jit_compile": (False, True),
    # none: float32, loss_scale=None; fixed: float32, loss_scale=128.0 (a
    # power of two: exact); dynamic16: precision="mixed_float16",
    # loss_scale="dynamic".
    "scaling": ("none", "fixed", "dynamic16"),
    "recompute": (None, "auto", ("block_*",)),
    "callbacks": ("none", "StepTimeMonitor", "RetraceCounter", "GradientAuditor", "all"),
    "watcher": ("none", "skip", "stop", "restore"),
    # The batch that holds a NaN (in both epochs: shuffle=False), with a
    # watcher only. Chunks of 3: (0, 1, 2), (3, 4, 5), (6, 7); windows of 4:
    # (0-3), (4-7). At both positions the two readings of the window after a
    # restore (see `epoch_schedule`) give the same result.
    "bad": (None, 2, 5),
    # One device, or MirroredStrategy over the two logical CPUs (conftest):
    # each batch of 4 is split into 2 per replica.
    "devices": ("one", "mirrored"),
    # The model's train_step: GradBoostModel's; a class's own that calls
    # super().train_step(data) (keras.io's pattern); a class's own that
    # computes the loss itself and updates through minimize().
    "step": ("builtin", "super", "minimize"),
    # compile(accumulate_check=True), with accumulation only: the first
    # window is compared with the large batch before its update.
    "accumulate_check": (False, True),
}


def allowed(row):
    """Whether a (partial) cell is meaningful: recompute needs blocks; a
    planted NaN needs a watcher (without one it would ruin the weights)."""
    if row.get("recompute") is not None and row.get("model") == "mlp":
        return False
    if row.get("accumulate_check") and row.get("accumulate_steps") == 1:
        return False
    if "watcher" in row and "bad" in row:
        return (row["watcher"] == "none") == (row["bad"] is None)
    return True


# ------------------------------------------------------------ pairwise design


def _pair(a, va, b, vb):
    """A pair of (factor, value)s, in the factor names' alphabetical order."""
    if a > b:
        a, va, b, vb = b, vb, a, va
    return ((a, va), (b, vb))


def _pairs_of(row):
    return {_pair(a, row[a], b, row[b]) for a, b in itertools.combinations(row, 2)}


def all_pairs(factors, allowed, seed, candidates=30):
    """A greedy pairwise (all-pairs) design, deterministic for a `seed`.

    AETG-style: each new row starts from one still-uncovered pair, fills the
    other factors in a random order, each with the value that covers the most
    uncovered pairs together with the values chosen so far (ties broken at
    random), skipping values `allowed` refuses; of `candidates` such rows the
    one covering the most new pairs is kept. Stops when every allowed pair of
    values of two factors is in some row.

    Returns:
        A list of dicts, factor name -> value.
    """
    rng = random.Random(seed)
    names = list(factors)
    uncovered = {
        _pair(a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
        if allowed({a: va, b: vb})
    }
    rows = []
    while uncovered:
        best, best_new = None, set()
        for _ in range(candidates):
            (a, va), (b, vb) = rng.choice(sorted(uncovered, key=repr))
            row = {a: va, b: vb}
            rest = [n for n in names if n not in row]
            rng.shuffle(rest)
            for n in rest:
                options = [v for v in factors[n] if allowed({**row, n: v})]
                gains = [
                    sum(_pair(m, row[m], n, v) in uncovered for m in row) for v in options
                ]
                top = max(gains)
                row[n] = rng.choice([v for v, g in zip(options, gains) if g == top])
            new = _pairs_of(row) & uncovered
            if len(new) > len(best_new):
                best, best_new = row, new
        rows.append({n: best[n] for n in names})
        uncovered -= best_new
    return rows


# ------------------------------------------------------------------- cells


@dataclasses.dataclass(frozen=True)
class Cell:
    """One combination: a value of each factor (see `FACTORS`), plus the
    extras of the refusal cells."""

    model: str = "mlp"
    optimizer: str = "sgd"
    accumulate_steps: int = 1
    steps_per_execution: int = 1
    jit_compile: object = False  # or "measure"
    scaling: str = "none"
    recompute: object = None
    callbacks: str = "none"
    watcher: str = "none"
    bad: object = None  # index of the batch with a NaN (with a watcher)
    lr_schedule: bool = False  # an optimizer with a learning-rate schedule
    optimizer_accumulation: int = 0  # the optimizer's gradient_accumulation_steps
    devices: str = "one"
    step: str = "builtin"
    accumulate_check: bool = False
    # Interrupted in epoch 1 and resumed from a kgb.callbacks.BackupAndRestore
    # backup taken every 3 batches, mid-window for accumulate_steps=4: after
    # batch 6 (micro-batches 4-6 pending), or with chunks of 3 after batch 5
    # (4, 5 pending).
    backup: bool = False
    # compile(precision="measure"), with a fake clock on which
    # mixed_bfloat16 is faster (`MeasureClock`): the first calls alternate
    # float32 and mixed_bfloat16 (timed in whole windows), then it keeps
    # mixed_bfloat16. With accumulate_steps=4 or steps_per_execution=3 the
    # 16 batches end before it decides (it measures throughout).
    measure: bool = False
    # compile(recompute_check=True): the first batch compares the gradients
    # with each block recomputed, and each block with the blocks nested in
    # it, against no recompute (one device: refused under a strategy).
    recompute_check: bool = False

    @property
    def name(self):
        parts = [
            self.model[:3],
            {"sgd": "sgd", "momentum": "mom"}[self.optimizer],
            f"k{self.accumulate_steps}",
            f"spe{self.steps_per_execution}",
            {True: "xla", False: "noxla", "measure": "xlameasure"}[self.jit_compile],
            {"none": "f32", "fixed": "f32fixed", "dynamic16": "f16dyn"}[self.scaling],
            "rc-" + {"auto": "auto", "selective": "sel"}.get(
                self.recompute, "nested" if len(self.recompute) > 1 else "list"
            )
            if self.recompute
            else "rc-off",
            "cb-" + self.callbacks,
            "w-" + self.watcher + (f"@{self.bad}" if self.bad is not None else ""),
        ]
        if self.devices == "mirrored":
            parts.append("mirrored")
        if self.step != "builtin":
            parts.append(f"step-{self.step}")
        if self.accumulate_check:
            parts.append("acheck")
        if self.lr_schedule:
            parts.append("schedule")
        if self.optimizer_accumulation:
            parts.append(f"optacc{self.optimizer_accumulation}")
        if self.backup:
            parts.append("resumed")
        if self.measure:
            parts.append("pmeasure")
        if self.recompute_check:
            parts.append("rcheck")
        return "-".join(parts)

    @property
    def precision(self):
        if self.measure:
            return "bfloat16"
        if self.scaling == "dynamic16":
            return "float16"
        return "xla" if self.jit_compile else "float32"


def _cell(row, **extra):
    if "bad" not in row and "bad" not in extra:
        row = {**row, "bad": None if row.get("watcher", "none") == "none" else 5}
    return Cell(**{**row, **extra})


PAIRWISE = [_cell(row) for row in all_pairs(FACTORS, allowed, SEED)]

# Known-risky cells, named in the recovery issue (and the spine issue's
# recompute x NaN replay).
SPECIFIC = [
    # Recompute x NaNWatcher replay: the replay must leave the recompute
    # marks in place (plan unchanged), and training equal the reference.
    # (The pairwise cells meet it under every other factor's values too.)
    _cell(dict(model="residual", recompute=("block_*",), watcher="skip")),
    # The same with selective recompute ("selective": {"policy":
    # "selective"}), whose replay keeps the kernel layers' outputs: under a
    # float16 dynamic loss scale, accumulation and XLA with a restore, and
    # on MirroredStrategy with chunks of 3 resumed from a mid-window backup.
    _cell(dict(model="residual", recompute="selective", watcher="skip")),
    _cell(dict(model="residual", recompute="selective", scaling="dynamic16",
               accumulate_steps=K, jit_compile=True, watcher="restore")),
    _cell(dict(model="residual", recompute="selective", accumulate_steps=K,
               steps_per_execution=3, optimizer="momentum", devices="mirrored",
               watcher="skip", bad=2), backup=True),
    # Nested recompute (each block and the Dense layers inside it, which
    # recompute inside the block's replay) x NaN replay, a float16 dynamic
    # loss scale, accumulation and XLA with a restore; and on
    # MirroredStrategy with chunks of 3 resumed from a mid-window backup.
    # (The first also checked by recompute_check, nested replays included.)
    _cell(dict(model="residual", recompute=("block_*", "inner_*"), scaling="dynamic16",
               accumulate_steps=K, jit_compile=True, watcher="restore"),
          recompute_check=True),
    _cell(dict(model="residual", recompute=("block_*", "inner_*"), accumulate_steps=K,
               steps_per_execution=3, optimizer="momentum", devices="mirrored",
               watcher="skip", bad=2), backup=True),
    # "auto" cutting the graph of a functional layer (keras.io's fine-tuning
    # pattern), whose calls run as a chain of its segments: x NaN replay, a
    # float16 dynamic loss scale, accumulation and XLA with a restore
    # (checked by recompute_check too); on MirroredStrategy with an own step
    # calling minimize(), chunks of 3, resumed from a mid-window backup.
    _cell(dict(model="nested", recompute="auto", scaling="dynamic16",
               accumulate_steps=K, jit_compile=True, watcher="restore"),
          recompute_check=True),
    _cell(dict(model="nested", recompute="auto", accumulate_steps=K,
               steps_per_execution=3, optimizer="momentum", devices="mirrored",
               step="minimize", watcher="skip", bad=2), backup=True),
    # Accumulate x restore, plain SGD (no optimizer slots): micro-batch 4 is
    # accumulated, 5 is bad, 6 runs halted, the restore follows; the
    # window's stale micro-batch 4 must not reach the next update.
    _cell(dict(accumulate_steps=K, watcher="restore")),
    # The same with momentum: the roll-back must reset the momentum too.
    _cell(dict(accumulate_steps=K, watcher="restore", optimizer="momentum")),
    # Accumulation with momentum, bad step 2: window (0-3) closes halted at
    # 3, the restore follows at once; the momentum must be rolled back.
    _cell(dict(accumulate_steps=K, watcher="restore", optimizer="momentum", bad=2)),
    # Restore without accumulation, momentum: the first epoch's roll-back.
    _cell(dict(watcher="restore", optimizer="momentum")),
    # Accumulate x stop: micro-batches 0, 1 accumulated, 2 bad, the window
    # closes at 3 (before the late read): no update may be applied.
    _cell(dict(accumulate_steps=K, watcher="stop", bad=2)),
    # Bad step 5 in chunk (3, 4, 5): chunk (6, 7) runs halted and closes
    # window (4..7) with micro-batch 4 in it.
    _cell(dict(accumulate_steps=K, watcher="stop", steps_per_execution=3)),
    # Accumulate x skip at the start of a window, with a fixed loss scale.
    _cell(dict(accumulate_steps=K, watcher="skip", scaling="fixed", bad=4)),
    # Backup x everything that keeps state across batches: resumed mid-window
    # (micro-batches 4, 5 pending) with a dynamic float16 loss scale,
    # momentum, recompute, chunks of 3 and a restore just before the backup
    # (bad step 2, acted on after chunk (3, 4, 5), as one call late as
    # without a backup), on MirroredStrategy; with the three callbacks and a
    # skip; with an own step calling minimize() under XLA.
    _cell(dict(model="residual", accumulate_steps=K, steps_per_execution=3,
               scaling="dynamic16", recompute="auto", watcher="restore",
               optimizer="momentum", devices="mirrored", bad=2), backup=True),
    _cell(dict(accumulate_steps=K, watcher="skip", callbacks="all"), backup=True),
    _cell(dict(accumulate_steps=K, step="minimize", jit_compile=True), backup=True),
    # precision="measure": a restore (momentum rolled back) in epoch 0 while
    # it measures, decided at the epoch's end; a skip inside a window timed
    # as one unit (accumulation: measuring throughout); chunks of 3 with
    # a stop; resumed from a backup taken after the decision (kept, not
    # measured again) and from one taken mid-window while measuring (goes
    # on with the schedule).
    _cell(dict(watcher="restore", optimizer="momentum"), measure=True),
    _cell(dict(accumulate_steps=K, watcher="skip"), measure=True),
    _cell(dict(steps_per_execution=3, watcher="stop"), measure=True),
    _cell(dict(optimizer="momentum"), measure=True, backup=True),
    _cell(dict(accumulate_steps=K, watcher="skip"), measure=True, backup=True),
    # precision="measure" x "auto" cutting a functional layer's graph: each
    # candidate traces under its own policy and chooses its own plan (at
    # the float32 trace, then again at the bfloat16 one), with a skip in
    # a measured window. Also equal to the same cell without recompute
    # (`check`).
    _cell(dict(model="nested", recompute="auto", accumulate_steps=K, watcher="skip"),
          measure=True),
    # Recompute's depthwise="chunked" (a depthwise Conv2D in 2 slices,
    # checked at its first trace) x accumulation with momentum and a
    # restore (the NaN replay runs the slices again); x nested recompute of
    # the block on MirroredStrategy (replicas trace in threads) with chunks
    # of 3, resumed from a mid-window backup.
    _cell(dict(model="depthwise", recompute="auto", accumulate_steps=K,
               optimizer="momentum", watcher="restore")),
    _cell(dict(model="depthwise", recompute=("block_*",), accumulate_steps=K,
               steps_per_execution=3, devices="mirrored", watcher="skip", bad=2),
          backup=True),
    # ... x precision="measure": float32 and mixed_bfloat16 both run the
    # slices (in bfloat16 each casts its part of the float32 kernel inside
    # its XLA function, as Keras does), and the fit equals the same cell
    # without recompute (Keras' unsliced convolution) bit for bit.
    _cell(dict(model="depthwise", recompute="auto", accumulate_steps=K, watcher="skip"),
          measure=True),
    # Dropout under accumulation (each micro-batch draws its rows of the
    # window's masks, `window_dropout`) x recompute's replay, XLA, chunks of
    # 3 and a skipped micro-batch (window (4-7) is 5, 6 and 7, drawn from
    # the seeds window 4 started with); x a backup mid-window (micro-batches 4-6 pending: where
    # their rows end and the window's seeds come back with it) with
    # momentum and the three callbacks. The reference draws once per
    # update, so a dropped window or step (stop, restore, skip without
    # accumulation), after which the seeds have moved on where Keras'
    # would not, is no cell.
    _cell(dict(model="dropout", recompute=("block_*",), accumulate_steps=K,
               steps_per_execution=3, jit_compile=True, watcher="skip", bad=4)),
    _cell(dict(model="dropout", accumulate_steps=K, optimizer="momentum",
               callbacks="all"), backup=True),
    # A recompute block whose call returns None beside its output (T5's
    # attention; it raised "None values not supported"): named blocks with
    # accumulation, momentum, a restore and chunks of 3; with a dynamic
    # float16 loss scale and a skip on MirroredStrategy. ("auto" and
    # selective recompute the layer that drops the None, here.)
    _cell(dict(model="cache", recompute=("block_*",), accumulate_steps=K,
               steps_per_execution=3, optimizer="momentum", watcher="restore")),
    _cell(dict(model="cache", recompute=("block_*",), scaling="dynamic16", watcher="skip",
               devices="mirrored")),
    # jit_compile="measure" x accumulation: each timing is a whole window
    # (4 calls; 16 calls: XLA, no XLA, XLA, no XLA, undecided), with a
    # skipped micro-batch opening a window timed without XLA, and the three
    # callbacks (two train functions traced, one per setting).
    _cell(dict(accumulate_steps=K, jit_compile="measure", watcher="skip", bad=4,
               callbacks="all")),
    # ... x Dropout, with a skipped micro-batch (5), resumed from a backup
    # mid-window: the interrupted fit ran epoch 1's window 4-7 without XLA
    # (its fourth unit), and the resumed fit goes on with the saved
    # schedule (NaNWatcher's guarded measuring function): the rest of that
    # unit's window without XLA. The windows ran XLA, no XLA, XLA, no XLA.
    # (Before, the rest ran under XLA with a warning.)
    _cell(dict(model="dropout", accumulate_steps=K, jit_compile="measure", watcher="skip",
               bad=5), backup=True),
    # ... without accumulation: units of one call decide after 8 (no XLA,
    # a tie) in epoch 0; resumed in epoch 1 from a backup holding the
    # decision, which the resumed fit keeps without measuring. (Before, it
    # measured again: XLA and no XLA alternating, other masks.)
    _cell(dict(model="dropout", jit_compile="measure"), backup=True),
]

# Cells that must refuse, with what the message must name.
REFUSALS = [
    (
        _cell(dict(accumulate_steps=K), optimizer_accumulation=2),
        ValueError,
        ("accumulate_steps=4", "gradient_accumulation_steps=2"),
    ),
    (
        _cell(dict(watcher="restore", accumulate_steps=K), lr_schedule=True),
        ValueError,
        ('action="restore"', "schedule"),
    ),
]


# ------------------------------------------------------------ the reference


def epoch_schedule(k, steps_per_execution, action, bad, batches=BATCHES):
    """What one epoch must do, as operations for the reference.

    `("update", [batches])`: one optimizer step on those batches
    concatenated; `("restore",)`: weights and optimizer state back to the
    epoch's start, learning rate times `LR_FACTOR`; `("stop",)`: training
    ends with these weights.

    The documented behaviour it encodes: windows of `k` micro-batches from
    the epoch's start (the last one shorter); "skip" drops the bad
    micro-batch from its window; "stop" and "restore" apply no update from
    the bad step on (the bad window's good micro-batches are dropped)
    until NaNWatcher acts, which it does after the call that follows the
    bad step's call (it reads the count one call late), or after the
    epoch's last call; "restore" then starts again from the epoch's start
    with an empty window. (Whether the window's position restarts at the
    restore is not documented; the cells put the bad step where it makes no
    difference.)
    """
    act = None
    if action in ("stop", "restore") and bad is not None:
        spe = steps_per_execution
        bad_call_end = min((bad // spe + 1) * spe, batches) - 1
        act = min(bad_call_end + spe, batches - 1)
    ops, window, halted = [], [], False
    for step in range(batches):
        if step == bad and action in ("stop", "restore"):
            halted, window = True, []
        elif step == bad and action == "skip":
            pass
        elif not halted:
            window.append(step)
        if (step + 1) % k == 0 or step == batches - 1:
            if window:
                ops.append(("update", window))
            window = []
        if step == act:
            ops.append((action,))
            if action == "stop":
                return ops
            halted = False
    return ops


def test_pairwise_design_covers_every_allowed_pair():
    rows = all_pairs(FACTORS, allowed, SEED)
    assert rows == all_pairs(FACTORS, allowed, SEED)  # seeded: the same design
    assert all(allowed(row) for row in rows)
    covered = set().union(*(_pairs_of(row) for row in rows))
    for a, b in itertools.combinations(FACTORS, 2):
        for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
            if allowed({a: va, b: vb}):
                assert _pair(a, va, b, vb) in covered, (a, va, b, vb)
    full = sum(
        allowed(dict(zip(FACTORS, values))) for values in itertools.product(*FACTORS.values())
    )
    assert full == 60480 and len(rows) == 20


@pytest.mark.parametrize("scaling", ["none", "dynamic16"])
def test_the_nested_model_recomputes_segments_of_its_tower(scaling):
    # The "nested" cells meet the chain of a functional layer's segments
    # only if "auto" chooses them there.
    model = build("nested", GradBoostModel)
    precision = "mixed_float16" if scaling == "dynamic16" else None
    model.compile(optimizer="sgd", loss="mse", recompute="auto", precision=precision)
    chosen = model.recompute_plan(batch_size=BATCH).recomputed
    assert chosen and all(name.startswith("tower/") for name in chosen), chosen


def test_epoch_schedule_by_hand():
    assert epoch_schedule(1, 1, "none", None) == [("update", [s]) for s in range(8)]
    assert epoch_schedule(4, 1, "skip", 5) == [("update", [0, 1, 2, 3]), ("update", [4, 6, 7])]
    assert epoch_schedule(1, 1, "stop", 5) == [("update", [s]) for s in range(5)] + [("stop",)]
    assert epoch_schedule(4, 1, "stop", 2) == [("stop",)]
    assert epoch_schedule(4, 3, "stop", 5) == [("update", [0, 1, 2, 3]), ("stop",)]
    # Bad step 5 in chunk (3, 4, 5); chunk (6, 7) halted; then the restore.
    assert epoch_schedule(1, 3, "restore", 5) == [("update", [s]) for s in range(5)] + [
        ("restore",)
    ]
    assert epoch_schedule(4, 1, "restore", 5) == [
        ("update", [0, 1, 2, 3]), ("restore",), ("update", [7])
    ]
    # Bad step 2 in chunk (0, 1, 2); chunk (3, 4, 5) halted; window (4-7)
    # then holds 6 and 7 only.
    assert epoch_schedule(4, 3, "restore", 2) == [("restore",), ("update", [6, 7])]


class CacheBlock(keras.layers.Layer):
    """A residual block returning `(output, None)`, as keras-hub's
    `T5MultiHeadAttention` returns `(output, cache)` without a cache."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        i = self.name[-1]
        self.a = keras.layers.Dense(16, activation="tanh", name=f"inner_{i}a")
        self.b = keras.layers.Dense(
            8, kernel_initializer=keras.initializers.RandomNormal(stddev=0.1), name=f"inner_{i}b")

    def call(self, x):
        return x + self.b(self.a(x)), None


class Unpacks(keras.layers.Layer):
    """Calls `block` and passes on its output, dropping the None."""

    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.block = block

    def call(self, x):
        output, cache = self.block(x)
        assert cache is None
        return output


def build(kind, cls, seed=0):
    """Dense(8, tanh) [-> two residual blocks (with a Dropout inside each:
    "dropout") | -> repeated 64 times, a
    functional tower of Dense layers called as a layer (keras.io's
    fine-tuning pattern, whose graph "auto" cuts), average pooling] ->
    Dense(3)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    if kind == "nested":
        inner = keras.Input((64, 8))
        t = inner
        for i in range(8):
            small = keras.initializers.RandomNormal(stddev=0.1)
            t = keras.layers.Dense(32, "tanh", kernel_initializer=small, name=f"tower_{i}")(t)
        tower = keras.Model(inner, t, name="tower")
        h = keras.layers.GlobalAveragePooling1D()(tower(keras.layers.RepeatVector(64)(h)))
    if kind in ("residual", "dropout"):
        for i in (1, 2):
            small = keras.initializers.RandomNormal(stddev=0.1)
            # "dropout": a Dropout between the two (seeded: the reference's
            # are the same generators' draws).
            drop = [keras.layers.Dropout(0.3, seed=i, name=f"drop_{i}")] * (kind == "dropout")
            block = keras.Sequential(
                [
                    keras.layers.Dense(16, activation="tanh", name=f"inner_{i}a"),
                    *drop,
                    # Small residual branches: gradients times the dynamic
                    # loss scale's 2**15 stay below float16's 65504.
                    keras.layers.Dense(8, kernel_initializer=small, name=f"inner_{i}b"),
                ],
                name=f"block_{i}",
            )
            h = keras.layers.Add(name=f"add_{i}")([h, block(h)])
    if kind == "cache":
        # keras-hub T5's attention returns its cache as None beside its
        # output: a recompute block whose call returns None, called by a
        # layer of its own that drops the None.
        for i in (1, 2):
            h = Unpacks(CacheBlock(name=f"block_{i}"), name=f"pair_{i}")(h)
    if kind == "depthwise":
        # ConvNeXt's pattern in small: a depthwise Conv2D of 128 channels
        # in a residual block. Over 96: recompute without XLA runs it in 2
        # slices of 64 (depthwise="chunked" chosen by
        # recompute, Keras' values bit for bit; 98 channels in slices of 49
        # failed the check here, in the filter's gradient, and ran Keras'
        # way with a warning).
        g = keras.layers.Reshape((2, 2, 2))(h)
        g = keras.layers.Dense(128, activation="tanh", name="widen")(g)
        small = keras.initializers.RandomNormal(stddev=0.1)
        block = keras.Sequential(
            [
                keras.layers.Conv2D(128, 3, padding="same", groups=128,
                                    kernel_initializer=small, name="inner_1a"),
                keras.layers.Dense(128, kernel_initializer=small, name="inner_1b"),
            ],
            name="block_1",
        )
        g = keras.layers.Add(name="add_1")([g, block(g)])
        h = keras.layers.GlobalAveragePooling2D()(g)
    outputs = keras.layers.Dense(3, name="out")(h)
    return cls(inputs, outputs)


class SuperStep(GradBoostModel):
    """A class with its own train_step that calls GradBoostModel's."""

    def train_step(self, data):
        return super().train_step(data)


class MinimizeStep(GradBoostModel):
    """A class with its own train_step: the forward, Keras' loss, and the
    update through `minimize()` (count: the samples the loss averages)."""

    def train_step(self, data):
        import tensorflow as tf

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred, sample_weight, training=True)
        self.minimize(tape, loss, count=tf.shape(x)[0])
        return {"loss": loss}


STEP_CLASSES = {"builtin": GradBoostModel, "super": SuperStep, "minimize": MinimizeStep}


def make_optimizer(cell):
    lr = LR
    if cell.lr_schedule:
        lr = keras.optimizers.schedules.ExponentialDecay(LR, 10, 0.9)
    kwargs = {"momentum": 0.9} if cell.optimizer == "momentum" else {}
    if cell.optimizer_accumulation:
        kwargs["gradient_accumulation_steps"] = cell.optimizer_accumulation
    return keras.optimizers.SGD(lr, **kwargs)


def make_data(bad):
    """32 samples; with `bad`, a NaN in batch `bad`: in x for an odd index
    (NaNWatcher must name the forward pass), in y for an even one (the
    loss)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * BATCHES, 5)).astype("float32")
    y = (0.5 * np.tanh(x[:, :3]) + 0.1 * rng.normal(size=(len(x), 3))).astype("float32")
    if bad is not None:
        (x if bad % 2 else y)[bad * BATCH + 1, 2] = np.nan
    return x, y


_REFERENCES = {}


def reference(cell):
    """The plain-Keras run of what `cell` must do (cached per schedule)."""
    # TensorFlow's random draws under XLA are not its draws without it, so
    # Keras' Dropout masks under jit_compile=True are Keras' XLA step's.
    # Under jit_compile="measure" each update is a unit (a window, or one
    # call), the units alternate XLA and no XLA from the first, and after
    # 8 of them `JitClock`'s tie keeps no XLA.
    xla_draws = cell.model == "dropout" and cell.jit_compile
    key = (cell.model, cell.optimizer, cell.accumulate_steps, cell.steps_per_execution,
           cell.watcher, cell.bad, xla_draws)
    if key in _REFERENCES:
        return _REFERENCES[key]
    model = build(cell.model, keras.Model)
    model.compile(optimizer=make_optimizer(cell), loss="mse",
                  **({"jit_compile": True} if xla_draws else {"run_eagerly": True}))
    updates = 0
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    x, y = make_data(cell.bad)
    stopped = False
    for _ in range(EPOCHS):
        weights = model.get_weights()
        state = [(v, v.numpy()) for v in optimizer.variables if v.name != "learning_rate"]
        for op in epoch_schedule(cell.accumulate_steps, cell.steps_per_execution,
                                 cell.watcher, cell.bad):
            if op[0] == "update":
                rows = np.concatenate([np.arange(b * BATCH, (b + 1) * BATCH) for b in op[1]])
                if xla_draws == "measure":
                    model.jit_compile = updates < 8 and updates % 2 == 0
                    model.train_function = None  # made again under this setting
                model.train_on_batch(x[rows], y[rows])
                updates += 1
            elif op[0] == "restore":
                model.set_weights(weights)
                for v, value in state:
                    v.assign(value)
                optimizer.learning_rate = float(np.asarray(optimizer.learning_rate)) * LR_FACTOR
            else:
                stopped = True
        if stopped:
            break
    result = {
        "weights": model.get_weights(),
        "iterations": int(optimizer.iterations.numpy()),
        "slots": optimizer_slots(optimizer),
        "learning_rate": float(np.asarray(optimizer.learning_rate)),
        "stopped": stopped,
        "initial": build(cell.model, keras.Model).get_weights(),
    }
    _REFERENCES[key] = result
    return result


def optimizer_slots(optimizer):
    """The optimizer's state besides `iterations` and the learning rate (the
    momenta, if any), in variable order."""
    names = ("iteration", "learning_rate")
    return [np.asarray(v) for v in optimizer.variables if v.name not in names]


def expected_events(cell):
    """NaNWatcher's events as (epoch, step, phase, layer). A NaN in the
    data is produced by no layer: the layer is None (the event's detail
    names the layer it reached)."""
    if cell.watcher == "none":
        return []
    epochs = 1 if cell.watcher == "stop" else EPOCHS
    where = ("forward" if cell.bad % 2 else "loss", None)
    return [(e, cell.bad) + where for e in range(epochs)]


# ------------------------------------------------------------------ running


def make_callbacks(cell):
    names = {
        "none": [],
        "StepTimeMonitor": ["StepTimeMonitor"],
        "RetraceCounter": ["RetraceCounter"],
        "GradientAuditor": ["GradientAuditor"],
        "all": ["StepTimeMonitor", "RetraceCounter", "GradientAuditor"],
    }[cell.callbacks]
    made = {
        "StepTimeMonitor": lambda: StepTimeMonitor(window=3),  # split after step 3
        "RetraceCounter": lambda: RetraceCounter(strict=True),
        "GradientAuditor": lambda: GradientAuditor(
            every_n_steps=3, on_missing="raise", verbose=0
        ),
    }
    return [made[n]() for n in names]


def compile_kwargs(cell):
    kwargs = {
        "accumulate_steps": cell.accumulate_steps,
        "steps_per_execution": cell.steps_per_execution,
        "jit_compile": cell.jit_compile,
        "recompute": list(cell.recompute) if isinstance(cell.recompute, tuple) else (
            {"policy": "selective"} if cell.recompute == "selective" else cell.recompute),
        "loss_scale": None,
        "accumulate_check": cell.accumulate_check,
    }
    if cell.recompute_check:
        kwargs["recompute_check"] = True
    if cell.scaling == "fixed":
        kwargs["loss_scale"] = 128.0
    elif cell.scaling == "dynamic16":
        kwargs.update(precision="mixed_float16", loss_scale="dynamic")
    if cell.measure:
        kwargs["precision"] = "measure"
    return kwargs


class MeasureClock:
    """`precision_measure.perf_counter` for `Cell.measure`: each tick
    advances by the time of the call about to be timed (2 ms in
    mixed_bfloat16, 9 ms in float32), so every call lasts that long."""

    MS = {"float32": 9.0, "mixed_bfloat16": 2.0}

    def __init__(self):
        self.model, self.now = None, 0.0

    def __call__(self):
        measuring = wrappers.base_train_function(self.model)
        policy, _ = measuring.measurer.next_call()
        self.now += self.MS[policy] / 1000
        return self.now


class JitClock:
    """`jit_measure.perf_counter` for `jit_compile="measure"` cells: every
    call lasts 1 ms, so the measuring, where it decides, keeps no XLA (a
    tie), as `reference` assumes."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 0.0005  # two ticks per timed call
        return self.now


def _plan_facts(model):
    """What `recompute_plan()` says, as comparable values."""
    plan = model.recompute_plan(batch_size=BATCH)
    return {
        "recomputed": plan.recomputed,
        "blocks (name, recomputed, cached, inputs bytes)": [
            (b.name, b.recomputed, b.cached_bytes, b.input_bytes) for b in plan.blocks
        ],
        "bytes_without": plan.bytes_without,
        "bytes_with": plan.bytes_with,
    }


def run(cell, with_callbacks=True):
    """Trains the cell's GradBoostModel; returns what the checks need."""
    def scope():  # (a strategy's scope is entered once: a new one each time)
        if cell.devices == "mirrored":
            return shared_mirrored_strategy().scope()
        return contextlib.nullcontext()

    x, y = make_data(cell.bad)
    watcher = None
    callbacks = make_callbacks(cell) if with_callbacks else []
    if cell.watcher != "none":
        watcher = NaNWatcher(action=cell.watcher, verbose=0)
        callbacks = [watcher] + callbacks
    stopped = None
    events = []

    clock = MeasureClock()

    def make_model():
        with scope():
            model = build(cell.model, STEP_CLASSES[cell.step])
            model.compile(optimizer=make_optimizer(cell), loss="mse", **compile_kwargs(cell))
        clock.model = model
        return model

    measuring = (
        mock.patch.object(precision_measure, "perf_counter", clock)
        if cell.measure
        else mock.patch.object(jit_measure, "perf_counter", JitClock())
        if cell.jit_compile == "measure"
        else contextlib.nullcontext()
    )
    sliced = set()  # the layers whose traces ran slices
    recording = mock.patch.object(depthwise._Depthwise, "_chunked", slices_recorder(sliced))
    with measuring, recording, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = make_model()
        plan_before = _plan_facts(model) if cell.recompute else None
        if cell.backup:  # the interrupted fit; the one below resumes it
            backup_dir = tempfile.mkdtemp()
            with pytest.raises(RuntimeError, match="interrupted"):
                model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                          callbacks=callbacks + [
                              BackupAndRestore(backup_dir, save_freq=3),
                              InterruptAt(1, 5 if cell.steps_per_execution == 3 else 6),
                          ])
            if watcher:
                # The events of the batches the backup holds; the resumed fit
                # meets those after it again.
                with open(f"{backup_dir}/training_metadata.json") as f:
                    saved = json.load(f)
                events += [e for e in watcher.events
                           if (e.epoch, e.step) < (saved["epoch"], saved["batches_done"])]
                watcher = NaNWatcher(action=cell.watcher, verbose=0)
            callbacks = ([watcher] if watcher else []) + (
                make_callbacks(cell) if with_callbacks else []
            ) + [BackupAndRestore(backup_dir, save_freq=3)]
            model = make_model()
        history = None
        try:
            history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                                verbose=0, callbacks=callbacks)
        except NonFiniteError as error:
            stopped = error
    facts = model.step_facts.read()
    plan_expected = plan_before
    if cell.recompute and cell.measure:
        # The plan follows the policy the layers hold after the fit (the
        # winner, or while measuring the last candidate timed); before it,
        # the static rule's (float32 on a CPU without bfloat16 instructions):
        # the plan of a model compiled with that policy.
        with scope():
            held = build(cell.model, STEP_CLASSES[cell.step])
            held.compile(optimizer=make_optimizer(cell), loss="mse", **{
                **compile_kwargs(cell), "precision": model.dtype_policy_applied})
        plan_expected = _plan_facts(held)
    # (At the batch size the fit traced: each replica's, or each micro-batch's.)
    fitted_plan = model.recompute_plan() if cell.recompute else None
    return {
        # (Keras' own save_weights warns under NumPy 2: its Dense layers
        # save with np.array(variable), whose __array__ takes no `copy`.)
        "warnings": [str(w.message) for w in caught
                     if "__array__ implementation doesn't accept a copy" not in str(w.message)],
        "weights": model.get_weights(),
        # Micro-batches a dynamic loss scale dropped in its own search.
        "scale_overflows": facts["skipped_steps"] - facts["nonfinite_steps"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "slots": optimizer_slots(model.optimizer),
        "learning_rate": float(np.asarray(model.optimizer.learning_rate)),
        "stopped": stopped,
        "events": [(e.epoch, e.step, e.phase, e.layer) for e in events + watcher.events]
        if watcher
        else [],
        "callbacks": callbacks,
        "plan_expected": plan_expected,
        "plan_after": _plan_facts(model) if cell.recompute else None,
        "measured_slots": None if fitted_plan is None else fitted_plan.measured_slot_bytes,
        # (peak_bytes, peak_bytes_updates_alone, gradients_pile_up)
        "peak_ends": None if fitted_plan is None else (
            fitted_plan.peak_bytes, fitted_plan.peak_bytes_updates_alone,
            fitted_plan.gradients_pile_up),
        "precision_measurement": model.precision_measurement,
        "logged_loss": None if history is None else history.history["loss"],
        "depthwise": (model.train_plan.depthwise_setting, sliced),
    }


def max_diff(a, b):
    return max(float(np.max(np.abs(wa - wb))) for wa, wb in zip(a, b))


def check(cell):
    """Runs `cell` and compares it with its reference.

    Returns:
        `(findings, figures)`: the failed checks as `(kind, message)` pairs,
        kind "training" (weights, optimizer state, updates, stop), "plan"
        (recompute_plan() changed by the fit) or "other" (events, learning
        rate, warnings, callbacks); and the measured figures for the table.
    """
    ref = reference(cell)
    got = run(cell)
    found, figures = _training_findings(cell, got, ref)
    found += _other_findings(cell, got, ref)
    if cell.callbacks == "all":
        # The same cell without the three callbacks (pairwise: "all" meets
        # every value of every other factor).
        alone = run(cell, with_callbacks=False)
        figures["cb_diff"] = max_diff(got["weights"], alone["weights"])
        if figures["cb_diff"] > SAME_CELL_ATOL:
            found.append(("other", f"callbacks changed training: {figures['cb_diff']:.3g} "
                                   "from the same cell without them"))
    if cell.measure and cell.recompute:
        # Each candidate recomputes with the plan chosen under its policy:
        # the same measured fit without recompute, exactly.
        plain = run(dataclasses.replace(cell, recompute=None))
        figures["rc_diff"] = max_diff(got["weights"], plain["weights"])
        if figures["rc_diff"] > SAME_CELL_ATOL:
            found.append(("training", f"recompute changed the measured fit: "
                                      f"{figures['rc_diff']:.3g} from the same cell "
                                      "without it"))
    return found, figures


def _training_findings(cell, got, ref):
    # How far a clean run moves the weights (and how large its momenta
    # get): the scale of the tolerance.
    clean = reference(dataclasses.replace(cell, watcher="none", bad=None))
    moved = max_diff(clean["weights"], clean["initial"])
    diff = max_diff(got["weights"], ref["weights"])
    tol = RTOL[cell.precision]
    if cell.model == "nested" and cell.precision == "bfloat16":
        tol = RTOL_NESTED_BFLOAT16
    figures = {"diff": diff, "rel": diff / moved,
               "updates": f"{got['iterations']}/{ref['iterations']}"}
    found = []
    if diff > tol * moved:
        found.append(("training", f"weights: max |w - w_ref| = {diff:.3g}, {diff / moved:.2%} of "
                                  f"the {moved:.3g} a clean run moves them (tolerance {tol:.0e})"))
    if got["slots"]:
        slot_diff = max_diff(got["slots"], ref["slots"])
        slot_scale = max(float(np.max(np.abs(m))) for m in clean["slots"])
        figures["slot_rel"] = slot_diff / slot_scale
        if slot_diff > tol * slot_scale:
            found.append(("training", f"optimizer state: max |m - m_ref| = {slot_diff:.3g}, "
                                      f"{figures['slot_rel']:.2%} of the largest clean-run "
                                      "momentum"))
    if got["iterations"] != ref["iterations"]:
        found.append(("training", f"updates: {got['iterations']}, reference {ref['iterations']}"))
    if bool(got["stopped"]) != ref["stopped"]:
        found.append(("training", f"stopped: {bool(got['stopped'])}, reference {ref['stopped']}"))
    return found, figures


def _other_findings(cell, got, ref):
    found = []
    if got["scale_overflows"]:
        found.append(("other", f"the dynamic loss scale overflowed {got['scale_overflows']} "
                               "micro-batches, which the reference does not model: make the "
                               "cell's gradients smaller"))
    # A dropped step's loss stays out of the logs (the epoch's mean would be
    # NaN, and Keras' TerminateOnNaN would end the run the watcher saves).
    if got["logged_loss"] is not None and not np.isfinite(got["logged_loss"]).all():
        found.append(("other", f"logged loss {got['logged_loss']}: a dropped step's NaN "
                               "stayed in the epoch's logs"))
    if got["events"] != expected_events(cell):
        found.append(("other", f"events (epoch, step, phase, layer): {got['events']}, "
                               f"expected {expected_events(cell)}"))
    if not np.isclose(got["learning_rate"], ref["learning_rate"], rtol=1e-6):
        found.append(("other", f"learning rate {got['learning_rate']:g}, "
                               f"reference {ref['learning_rate']:g}"))
    if cell.recompute and got["plan_after"] != got["plan_expected"]:
        before, after = got["plan_expected"], got["plan_after"]
        changes = [f"{k} {before[k]} -> {after[k]}" for k in before if before[k] != after[k]]
        found.append(("plan", "recompute_plan() changed by the fit: " + "; ".join(changes)))
    if got["measured_slots"] is not None:
        # The plan's measured line takes off the optimizer state the fit
        # made (every slot: each cell's model is new), a copy per replica.
        copies = 2 if cell.devices == "mirrored" else 1
        made = copies * sum(slot.nbytes for slot in got["slots"])
        if got["measured_slots"] != made:
            found.append(("plan", f"recompute_plan() took {got['measured_slots']} bytes of "
                                  f"optimizer variables off its measured peak, the fit made {made}"))
    if got["peak_ends"] is not None:
        # The low end of the estimate (each update alone) is at most the
        # high one, and the same where the gradients wait for every update
        # (a loss scale's or NaNWatcher's check).
        peak, alone, pile_up = got["peak_ends"]
        if peak is not None and (alone is None or alone > peak or (pile_up and alone != peak)):
            found.append(("plan", f"recompute_plan()'s estimate with each update alone "
                                  f"{alone}, its peak_bytes {peak} (gradients pile up: "
                                  f"{pile_up})"))
    # Recompute runs a depthwise Conv2D of over 96 channels in slices where
    # they serve: without XLA (in either measured precision too).
    chunked = cell.model == "depthwise" and bool(cell.recompute) and not cell.jit_compile
    want = ("chunked", {"inner_1a"}) if chunked else (None, set())
    if got["depthwise"] != want:
        found.append(("other", f"depthwise (setting, layers sliced): {got['depthwise']}, "
                               f"expected {want}"))
    found += [("other", message) for message in _callback_findings(got["callbacks"])]
    if cell.measure:
        found += [("other", m) for m in _measure_findings(cell, got["precision_measurement"])]
    # The documented warnings here: XLA off under MirroredStrategy over
    # logical CPUs (TensorFlow cannot run that step), and mixed_float16 on a
    # CPU without XLA.
    xla = cell.jit_compile and cell.devices == "one"
    slow = [w for w in got["warnings"] if w.startswith('precision="mixed_float16" on a CPU')]
    models = 2 if cell.backup else 1  # an interrupted fit's, the resumed one's
    if len(slow) != models * int(cell.scaling == "dynamic16" and not xla):
        found.append(("other", f"{len(slow)} float16-on-CPU warnings"))
    blocked = [w for w in got["warnings"] if "but XLA is off: MirroredStrategy over 2 CPU" in w]
    if len(blocked) != models * int(cell.jit_compile and cell.devices == "mirrored"):
        found.append(("other", f"{len(blocked)} XLA-off-under-MirroredStrategy warnings"))
    # accumulate_check with the NaN in the first window: checked at the next.
    deferred = [w for w in got["warnings"] if "first accumulation window holds a non-finite" in w]
    if len(deferred) != int(cell.accumulate_check and cell.bad is not None and cell.bad < K):
        found.append(("other", f"{len(deferred)} accumulate_check-deferred warnings"))
    # "auto" where recompute cannot lower the training peak (a small model
    # after a check: every gradient with the updates, at the end of the
    # backward, outweighs its activations) says so and recomputes nothing.
    idle = [w for w in got["warnings"] if w.startswith('recompute="auto": no plan of recompute')]
    checked = cell.watcher != "none" or cell.scaling != "none"  # a loss scale checks too
    idle = idle if cell.recompute == "auto" and checked else []
    if idle and got["plan_after"]["recomputed"]:
        found.append(("other", f"{len(idle)} nothing-recomputed warnings, but the plan "
                               f"recomputes {got['plan_after']['recomputed']}"))
    found += [
        ("other", f"warning: {w}")
        for w in got["warnings"]
        if w not in slow + blocked + deferred + idle
    ]
    return found


def _measure_findings(cell, measurement):
    """precision="measure" decided when its schedule fits in the cell's
    calls (16 batches; 8 units of `calls_per_timing` calls), for
    mixed_bfloat16 (the fake clock's faster), and kept it through a
    resume; undecided otherwise."""
    from keras_gradboost.measure_schedule import calls_per_timing

    spe = cell.steps_per_execution
    calls = EPOCHS * -(-BATCHES // spe)
    if cell.watcher == "stop":
        calls = -(-BATCHES // spe)  # stopped in epoch 0
    decides = 8 * calls_per_timing(cell.accumulate_steps, spe) <= calls
    if not decides:
        return [] if measurement is None else [f"decided although it cannot yet: {measurement}"]
    if measurement is None or measurement.policy != "mixed_bfloat16":
        return [f"precision_measurement {measurement}, expected mixed_bfloat16"]
    if cell.backup and not measurement.restored:
        return ["the resumed fit measured again"]
    return []


def _callback_findings(callbacks):
    found = []
    for callback in callbacks:
        if isinstance(callback, RetraceCounter) and callback.retraces:
            found.append(f"RetraceCounter: {callback.retraces} retraces")
        if isinstance(callback, GradientAuditor) and callback.missing:
            found.append(f"GradientAuditor: missing {callback.missing}")
        if isinstance(callback, StepTimeMonitor) and not callback.report().steps:
            found.append("StepTimeMonitor: no steps timed")
    return found


# ------------------------------------------------------- known defects

# The recovery issue's defects (issue 14's numbering) that a cell may run
# into, with the kind of finding each explains: {number: (kind, text)}.
# Defects 1 (restore in the first epoch left the optimizer's slots), 2
# (restore kept a stale window), 3 (stop applied a halted window's good
# micro-batches) and 8 (the NaN replay removed the recompute marks) are
# fixed; their cells now must equal the reference.
DEFECTS = {}


def known_defects(cell):
    """The numbers of the known defects `cell` runs into."""
    return []


class KnownDefect(AssertionError):
    """A cell failed exactly as its known defects explain."""


def _param(cell):
    numbers = known_defects(cell)
    marks = []
    if numbers:
        reason = "; ".join(f"issue 14 defect {n}: {DEFECTS[n][1]}" for n in numbers)
        marks = [pytest.mark.xfail(strict=True, raises=KnownDefect, reason=reason)]
    return pytest.param(cell, id=cell.name, marks=marks)


# ------------------------------------------------------------------- tests

RESULTS = {}  # cell name -> (result, figures, note), for the table


@pytest.fixture(scope="module", autouse=True)
def matrix_table(request):
    """Prints the matrix as a table once the module's cells have run."""
    yield
    width = max([len(name) for name in RESULTS] + [4])
    lines = [
        "",
        f"Interaction matrix: {len(PAIRWISE)} pairwise cells (seed {SEED}) over "
        + " x ".join(f"{n} {len(v)}" for n, v in FACTORS.items())
        + f"; {len(CELLS) - len(PAIRWISE)} specific cells; {len(REFUSALS)} refusals",
        f"{'cell':<{width}}  {'result':<12} {'max diff':>9} {'rel diff':>9} {'mom rel':>9}"
        f" {'updates':>7} {'cb diff':>8}  note",
    ]
    for name, (result, figures, note) in RESULTS.items():
        diff = f"{figures['diff']:.2g}" if "diff" in figures else ""
        rel = f"{figures['rel']:.2e}" if "rel" in figures else ""
        cb = f"{figures['cb_diff']:.2g}" if "cb_diff" in figures else ""
        mom = f"{figures['slot_rel']:.2e}" if "slot_rel" in figures else ""
        lines.append(
            f"{name:<{width}}  {result:<12} {diff:>9} {rel:>9} {mom:>9}"
            f" {figures.get('updates', ''):>7} {cb:>8}  {note}"
        )
    text = "\n".join(lines)
    plugins = request.config.pluginmanager
    reporter = plugins.getplugin("terminalreporter")
    capture = plugins.getplugin("capturemanager")
    if reporter is None or capture is None:
        print(text)
        return
    with capture.global_and_fixture_disabled():  # shown without -s too
        reporter.write_line(text)


CELLS = list(dict.fromkeys(PAIRWISE + SPECIFIC))  # a specific cell may be a pairwise one


@pytest.mark.parametrize("cell", [_param(c) for c in CELLS])
def test_cell_equals_its_reference(cell):
    found, figures = check(cell)
    numbers = known_defects(cell)
    explained = {DEFECTS[n][0] for n in numbers}
    unexplained = [m for kind, m in found if kind not in explained]
    # Strict per defect: each expected defect must still show.
    gone = [n for n in numbers if DEFECTS[n][0] not in {kind for kind, _ in found}]
    messages = [m for _, m in found]
    if unexplained or gone:
        result = "FAIL"
    elif numbers:
        result = "xfail " + ",".join(map(str, numbers))
    else:
        result = "ok"
    RESULTS[cell.name] = (result, figures, "; ".join(messages))
    if unexplained:
        pytest.fail(f"{cell.name}: " + "; ".join(unexplained), pytrace=False)
    if gone:
        pytest.fail(
            f"{cell.name}: issue 14 defect(s) {gone} no longer seen: remove them from "
            "known_defects()", pytrace=False)
    if numbers:
        raise KnownDefect(f"{cell.name}: " + "; ".join(messages))


@pytest.mark.parametrize("cell, error, names", REFUSALS, ids=[c.name for c, _, _ in REFUSALS])
def test_cell_refuses_naming_the_options(cell, error, names):
    with pytest.raises(error) as info:
        run(cell)
    message = str(info.value)
    RESULTS[cell.name] = ("refused", {}, message.split(". ")[0] + ".")
    for name in names:
        assert name in message, message
