"""`keras-gradboost compare`: one configuration per fresh subprocess.

The parent (`run_configs`) runs each configuration in a process of its
own, so allocator pools, XLA caches and traced functions never leak from
one row into the next: a child forked from a server that imported
TensorFlow once and never ran an op (keras_gradboost/row_server.py), or,
where that cannot run, `python -m keras_gradboost.compare SPEC`. `run_rounds` repeats that for
`repeat` rounds, each in a seeded shuffled order, and `aggregate` reduces the
rounds to one row per configuration (medians, and the speed-up as the median
of the per-round ratios to the baseline). The child (`measure`) builds the
model, compiles it with the configuration's keyword arguments, trains
`steps` batches with `fit`, measures, and prints one JSON line: the row.

What a row holds (all measured in the child):
- `step_ms`: median wall time of one training batch (one `fit` step, one
  micro-batch under `accumulate_steps`) after `WARMUP_STEPS` warm-up
  batches (under `jit_compile="measure"` or `precision="auto"`: after
  the measured batches, once the choice is made), timed from `on_train_batch_begin` to
  `on_train_batch_end` (Keras pulls the logs to the host there, so each step
  is synchronised).
- `compile_s`: the first batch's time minus `step_ms`: tracing and (XLA)
  compilation (under `jit_compile="measure"` or `precision="auto"`: the
  warm-up batches of each variant).
- `examples_per_s`: batch size / `step_ms`.
- `backward_share`: after training, on one fixed batch, 1 - the median over
  interleaved pairs of (time of a compiled forward-only `tf.function`
  calling the model with `training=True`) / (time of the model's own train
  function): the share of a step spent in the backward pass, the loss and
  the update.
- `peak_mib`: TensorFlow's allocator peak during `fit` minus its level just
  before (`tf.config.experimental.get_memory_info`): what training adds on
  top of the weights (optimizer slots, activations, gradients). `None`
  where the device has no allocator statistics.
- `retraces`: how many times the train step was traced after the first
  batch, counted by a Python side effect in `model.train_step` (it runs
  only while TensorFlow traces). The first batch may trace twice: a
  `tf.function` whose first call creates variables (optimizer slots) is
  traced again; that is not a retrace. (The batches come from a tf.data
  pipeline of fixed-size batches, so a retrace here means the train
  function was made again, or traced for a new Python value.)
- `final_loss`: the mean training loss over the last quarter of the batches
  (recovered exactly from the running means Keras logs).
- `step_flops`: the FLOPs of one training step (one micro-batch under
  `accumulate_steps`): its matrix multiplications and convolutions,
  forward and backward, 2 per multiply-add, counted from the shapes of the
  step's traced graph (`keras_gradboost.flops.step_flops`: `train_step`
  traced once more, before XLA, so recompute's extra forward is in it and
  the first layer's unneeded input gradient is not). By dtype in
  `step_flops_by_dtype` (under mixed precision most are bfloat16 or
  float16, a float32 head's are float32). Elementwise operations
  (activations, normalisation, loss, optimizer update) are not counted:
  about 5% more on the built-in MLP. `step_flops_exact` is False when some
  contraction could not be counted (inside a `tf.cond`/`tf.while_loop`
  body or a nested `tf.function`, unknown shapes, an unknown contraction
  type; `step_flops_uncounted` names them, and a note says so): the count
  is then a lower bound, shown as `>=`. Why not TensorFlow's graph
  profiler, an analytic count from the layers or XLA's cost analysis: see
  `keras_gradboost/flops.py`.
- `flop_per_s` (set by the parent, `add_throughput`): `step_flops` /
  `step_ms`; `peak_share`: the time those FLOPs would take at this
  machine's peak of each dtype, over `step_ms` (for one dtype: `flop_per_s`
  / the peak).
- `xla`: whether the train step ran with XLA: `"on"`, `"off"`, or, when
  `jit_compile=True` or `"measure"` asked for XLA and something blocked it,
  `"off: <reason>"` (a layer with `supports_jit=False`, an op without an XLA
  kernel); under `jit_compile="measure"` the measured medians follow
  (`"on (measured 1.20 vs 2.31 ms)"`, XLA first), and `jit_measurement`
  holds them.
- `policy`: the dtype policy the layers hold after `fit`; under
  `precision="auto"` the measured choice, and `precision_measurement`
  holds both medians (the setup column shows them, the choice's first:
  `"mixed_bfloat16 (measured 2.10 vs float32 3.05 ms)"`).

The machine's peak (`run_peaks`, once per run, in a subprocess of its own
like the rows, after them): per dtype the rows compute in (float32 always),
a `PEAK_SIZE` x `PEAK_SIZE` matmul in a `tf.function`, warmed up, the fastest
of a few timed calls, `2 * PEAK_SIZE**3` FLOPs each
(`keras_gradboost.flops.measure_peak`). Nothing is cached. It is the
throughput of a large, compute-bound matmul; a training step also moves
memory and runs small or elementwise operations, so its share is lower.
"""

import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
import zipfile

from keras_gradboost import row_server

# all_on's precision: the policy precision="auto" starts from (its static
# rule), resolved in the child (`resolve_kwargs`).
STATIC_RULE = "static_rule"
# Keyword arguments of `GradBoostModel.compile` per configuration. Every
# configuration sets `jit_compile` explicitly (Keras' "auto" means XLA on a
# GPU).
CONFIGS = {
    "baseline": {"jit_compile": False},
    "jit_compile": {"jit_compile": True},
    "precision_auto": {"jit_compile": False, "precision": "auto"},
    "accumulate": {"jit_compile": False, "accumulate_steps": 4},
    "recompute": {"jit_compile": False, "recompute": "auto"},
    "all_on": {
        "jit_compile": "auto",
        "precision": STATIC_RULE,
        "accumulate_steps": 4,
        "recompute": {"budget_mb": "half_available"},
    },
}
# all_on switches everything on with the "auto" choices, so that it is not
# slower than the baseline (measured on a 2-core CPU; the figures are in
# benchmarks/RESULTS.md, "Figures quoted elsewhere"):
# - jit_compile="auto" is Keras' own: XLA on a GPU, not on a CPU, where XLA
#   made the built-in MLP and CNN slower per step; jit_compile="measure"
#   picks the same on this CPU under all_on's mixed_bfloat16 but adds
#   seconds of first steps (XLA compilation and XLA calls), and with 3 timed
#   calls a loaded machine could tip it the wrong way: it is not worth it
#   for all_on;
# - precision: the pick of precision="auto"'s static rule, mixed_bfloat16
#   on a CPU with bfloat16 instructions (faster than float32 on the MLP),
#   mixed_float16 on a GPU. precision="auto" itself times float32 against
#   it in the first calls, whole accumulation windows each: 32 calls under
#   accumulate_steps=4, more than the default 30 steps (the precision_auto
#   row measures, without accumulation: 8 calls);
# - recompute only what must be: the budget is half the memory available
#   when the child starts (see `resolve_kwargs`), so a model whose
#   activations fit pays no extra forward pass (recompute="auto" costs one).
HALF_AVAILABLE = "half_available"
BUILTIN_MODELS = ("mlp", "cnn", "transformer", "residual_mlp")
# Sizes of the built-ins under `compare` (zoo defaults otherwise).
BUILTIN_SIZES = {"residual_mlp": {"width": 256, "blocks": 4}}
DEFAULT_MODEL = "mlp"
DEFAULT_BATCH_SIZE = 256
DEFAULT_STEPS = 30
WARMUP_STEPS = 2
# Forward-only / full-step timing pairs (backward share): at least this
# many, up to 4x as many while they take under ~2 s.
SHARE_REPS = 5
CHILD_TIMEOUT_S = 3600
# The matmul timed for the machine's peak (see `run_peaks`).
PEAK_SIZE = 2048
PEAK_TIMEOUT_S = 600
# Seed of each row's process: its model's initial weights, Dropout seeds.
MODEL_SEED = 0
# Seed of the per-round shuffles of `run_rounds` (the same orders each run).
ROUND_SEED = 0
# Row fields reduced to their median over the rounds by `aggregate`.
MEDIAN_FIELDS = (
    "step_ms",
    "compile_s",
    "examples_per_s",
    "backward_share",
    "forward_ms",
    "full_step_ms",
    "peak_mib",
    "final_loss",
)


# --------------------------------------------------------------- the parent


def run_configs(spec, names, progress=None, label=""):
    """Runs each configuration in its own subprocess and collects the rows.

    Args:
        spec: dict with `model` (a built-in name or a `.keras` path), `data`
            (a `.npz` path or None), `batch_size` and `steps`.
        names: configuration names, keys of `CONFIGS`, in the order to run.
        progress: optional stream for one progress line per configuration.
            Defaults to `None` (silent).
        label: text starting each progress line. Defaults to `""`.

    Returns:
        A list of row dicts, one per name, in order; a failed configuration's
        row has `"error"`: a one-line reason.
    """
    rows = []
    for i, name in enumerate(names, 1):
        if progress is not None:
            progress.write(f"{label}[{i}/{len(names)}] {name} ... ")
            progress.flush()
        start = time.perf_counter()
        row = run_one({**spec, "config": name, "kwargs": CONFIGS[name]})
        if progress is not None:
            elapsed = time.perf_counter() - start
            if "error" in row:
                progress.write(f"FAILED in {elapsed:.1f} s: {row['error']}\n")
            else:
                progress.write(f"{row['step_ms']:.2f} ms/step ({elapsed:.1f} s)\n")
            progress.flush()
        rows.append(row)
    return rows


def round_orders(names, repeat, seed=ROUND_SEED):
    """The order of the configurations in each of `repeat` rounds.

    One round keeps the given order; more rounds are each shuffled, with
    `random.Random(seed)`, so that a slow phase of the machine does not
    always hit the same configuration.
    """
    if repeat == 1:
        return [list(names)]
    rng = random.Random(seed)
    orders = []
    for _ in range(repeat):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def run_rounds(spec, names, repeat=1, progress=None, seed=ROUND_SEED):
    """Runs every configuration once per round, each in a fresh subprocess.

    Args:
        spec: as for `run_configs`.
        names: configuration names, keys of `CONFIGS`.
        repeat: the number of rounds. Defaults to `1`.
        progress: optional stream for one progress line per configuration
            and round. Defaults to `None` (silent).
        seed: seed of the per-round shuffles (see `round_orders`).
            Defaults to `ROUND_SEED`.

    Returns:
        `(rows, orders)`: one row per name, in order, from `aggregate`; and
        the configuration order of each round.
    """
    orders = round_orders(names, repeat, seed)
    rounds = []
    for r, order in enumerate(orders, 1):
        label = f"round {r}/{repeat} " if repeat > 1 else ""
        rows = run_configs(spec, order, progress=progress, label=label)
        rounds.append({row["config"]: row for row in rows})
    return aggregate(rounds, names), orders


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _figures(row, baseline):
    """A round's figures of a row, or its error; `speed_up` is the ratio to
    the baseline row of the same round (None without one)."""
    if "error" in row:
        return {"error": row["error"]}
    figures = {field: row.get(field) for field in (*MEDIAN_FIELDS, "retraces")}
    ok = baseline is not None and "error" not in baseline
    figures["speed_up"] = baseline["step_ms"] / row["step_ms"] if ok else None
    return figures


def aggregate(rounds, names):
    """One row per configuration from the rows of several rounds.

    A row's `MEDIAN_FIELDS` are medians over its successful rounds,
    `retraces` is the maximum, and the other fields come from its first
    successful round. `speed_up` is the median over the rounds where both
    ran of the baseline's `step_ms` over the row's, in that same round (None
    without a baseline). `per_round` lists, per round, those figures or the
    round's `error`. A configuration that failed in some rounds gets a note;
    one that failed in all of them keeps its first round's `error`.

    Args:
        rounds: one dict per round, configuration name -> row.
        names: configuration names, in the order of the returned rows.

    Returns:
        A list of rows.
    """
    rows = []
    for name in names:
        runs = [round_[name] for round_ in rounds]
        per_round = [_figures(run, round_.get("baseline")) for round_, run in zip(rounds, runs)]
        good = [figures for figures in per_round if "error" not in figures]
        first = next((run for run in runs if "error" not in run), runs[0])
        row = {**first, "per_round": per_round}
        if good:
            for field in MEDIAN_FIELDS:
                row[field] = _median(figures[field] for figures in good)
            retraces = [f["retraces"] for f in good if f["retraces"] is not None]
            row["retraces"] = max(retraces, default=None)
            row["speed_up"] = _median(figures["speed_up"] for figures in good)
            errors = [figures["error"] for figures in per_round if "error" in figures]
            if errors:
                note = f"failed in {len(errors)} of {len(runs)} rounds: {errors[0]}"
                row["notes"] = [*row.get("notes", ()), note]
        rows.append(row)
    return rows


def run_one(spec):
    """Runs one configuration in a fresh Python process; returns its row."""
    base = {"config": spec["config"], "kwargs": spec["kwargs"]}
    return {**base, **_run_child(spec, CHILD_TIMEOUT_S)}


# Forks each row from one process that imported TensorFlow once
# (keras_gradboost/row_server.py): about 5 s of CPU less per row.
_ROW_SERVER = row_server.RowServer()


def _run_child(spec, timeout):
    """`child_main([SPEC])` in a process of its own, forked by `_ROW_SERVER`
    or else `python -m keras_gradboost.compare SPEC`: the JSON line it
    printed last, or `{"error": reason}`."""
    env = {
        "TF_CPP_MIN_LOG_LEVEL": "2",
        # TensorFlow keeps allocator statistics (peak_mib) on a CPU only with
        # its BFC allocator, which is not the default on every CPU.
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        **os.environ,
    }
    argv = [json.dumps(spec)]
    result = _ROW_SERVER.run(argv, env, timeout)
    if result is None:  # no server: an interpreter of its own
        command = [sys.executable, "-m", "keras_gradboost.compare", *argv]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, env=env, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            result = "timeout"
        else:
            result = result.returncode, result.stdout, result.stderr
    if result == "timeout":
        return {"error": f"timed out after {timeout} s"}
    returncode, stdout, stderr = result
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    reason = lines[-1] if lines else "no output"
    return {"error": f"exit code {returncode}: {reason}"[:200]}


def peak_dtypes(rows):
    """The dtypes to measure the peak of: float32, and every dtype a row's
    counted FLOPs compute in; none when no row counted FLOPs."""
    counted = [r for r in rows if r.get("step_flops_by_dtype")]
    if not counted:
        return []
    dtypes = {"float32"} | {d for r in counted for d in r["step_flops_by_dtype"]}
    return sorted(dtypes, key=lambda d: (d != "float32", d))


def run_peaks(rows, progress=None):
    """Measures the matmul peak of each dtype the rows compute in, in one
    fresh subprocess (after the rows, so it does not share their process).

    Args:
        rows: the rows (from `run_rounds`).
        progress: optional stream for one progress line. Defaults to `None`.

    Returns:
        `{"size": PEAK_SIZE, "flop_per_s": {dtype: FLOP/s or None}}`, with
        `"error"` instead of `"flop_per_s"` when the subprocess failed; or
        None when no row counted FLOPs.
    """
    dtypes = peak_dtypes(rows)
    if not dtypes:
        return None
    if progress is not None:
        progress.write(f"peak: {PEAK_SIZE}x{PEAK_SIZE} matmul in {', '.join(dtypes)} ... ")
        progress.flush()
    start = time.perf_counter()
    result = _run_child({"peak_dtypes": dtypes, "size": PEAK_SIZE}, PEAK_TIMEOUT_S)
    peaks = {"size": PEAK_SIZE, **result}
    if progress is not None:
        elapsed = time.perf_counter() - start
        if "error" in peaks:
            progress.write(f"FAILED in {elapsed:.1f} s: {peaks['error']}\n")
        else:
            figures = ", ".join(
                f"{d} {'-' if v is None else f'{v / 1e9:.0f}'}" for d, v in peaks["flop_per_s"].items()
            )
            progress.write(f"{figures} GFLOP/s ({elapsed:.1f} s)\n")
        progress.flush()
    return peaks


def add_throughput(rows, peaks):
    """Sets each row's `flop_per_s` and `peak_share` (None where unknown)
    from its `step_flops`, `step_ms` and the measured peaks."""
    from keras_gradboost import flops

    per_dtype = (peaks or {}).get("flop_per_s") or {}
    for row in rows:
        if "error" in row or row.get("step_flops") is None:
            continue
        step_s = row["step_ms"] / 1000
        row["flop_per_s"] = row["step_flops"] / step_s if step_s > 0 else None
        row["peak_share"] = flops.peak_share(row["step_flops_by_dtype"], step_s, per_dtype)
        if row["peak_share"] is not None and row["peak_share"] > 1:
            row["notes"] = [*row.get("notes", ()), ABOVE_PEAK]
    return rows


# A share above 1 means the peak was measured while the machine was busier
# than during the row (other processes share the cores).
ABOVE_PEAK = "above 100% of the measured peak: the peak was measured under more load; run again"


# ---------------------------------------------------------------- the child


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Keras wraps a layer's error in a header and a list of the call's arguments;
# the informative line is the one between them.
_KERAS_WRAPPING = ("Exception encountered when calling", "Arguments received by", "\u2022")


def _one_line(error):
    """`TypeName: the informative line of the message`, at most 200 chars."""
    lines = [_ANSI.sub("", l).strip() for l in str(error).splitlines()]
    lines = [l for l in lines if l]
    told = [l for l in lines if not l.startswith(_KERAS_WRAPPING)]
    line = (told or lines or [""])[0]
    return f"{type(error).__name__}: {line}"[:200]


def saved_compile_config(path):
    """The `compile_config` stored in a `.keras` archive, or None."""
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    return config.get("compile_config") or None


def _synthetic_targets(model, x, loss, samples, rng):
    """Random targets matching the model's output and the loss."""
    import numpy as np

    from keras_gradboost import synthetic

    shape = tuple(np.asarray(model(synthetic.first_rows(x, 1))).shape[1:])
    name = loss if isinstance(loss, str) else str(loss)
    if "sparse" in name:
        return rng.integers(0, shape[-1], size=(samples, *shape[:-1])).astype("int32")
    if "categorical" in name:
        labels = rng.integers(0, shape[-1], size=(samples, *shape[:-1]))
        return np.eye(shape[-1], dtype="float32")[labels]
    if "binary" in name or "hinge" in name:
        return rng.integers(0, 2, size=(samples, *shape)).astype("float32")
    return rng.normal(size=(samples, *shape)).astype("float32")


def _default_loss(y):
    import numpy as np

    if y is not None and np.issubdtype(np.asarray(y).dtype, np.integer):
        return "sparse_categorical_crossentropy"
    return "mse"


def build(spec):
    """The model, data, loss and optimizer for a spec (in the child).

    Returns:
        `(model, x, y, loss, optimizer, notes)`.
    """
    import numpy as np

    import keras
    from keras_gradboost import synthetic
    from keras_gradboost import zoo
    from keras_gradboost.model import GradBoostModel
    from keras_gradboost.model import boost

    samples = spec["batch_size"] * min(spec["steps"], 16)
    notes = []
    name = spec["model"]
    # The same initial weights and Dropout seeds in every row's process (a
    # saved model's seed generators are drawn anew when it loads): rows of
    # exact features (recompute) then end at the baseline's loss.
    keras.utils.set_random_seed(MODEL_SEED)
    if name in BUILTIN_MODELS:
        model = getattr(zoo, name)(**BUILTIN_SIZES.get(name, {}))
        if name == "cnn":
            x, y = zoo.image_data(samples)
        elif name == "transformer":
            x, y = zoo.sequence_data(samples)
        else:
            x, y = zoo.classification_data(samples)
        return model, x, y, "sparse_categorical_crossentropy", keras.optimizers.Adam(1e-3), notes

    model = keras.saving.load_model(name, compile=False)
    if not isinstance(model, GradBoostModel):
        model = boost(model)
    compile_config = saved_compile_config(name) or {}
    loss = compile_config.get("loss")
    optimizer = compile_config.get("optimizer")
    try:
        optimizer = keras.optimizers.get(optimizer) if optimizer else None
    except Exception as error:  # noqa: BLE001 - fall back, with a note
        notes.append(f"saved optimizer not usable ({_one_line(error)})")
        optimizer = None
    if optimizer is None:
        optimizer = keras.optimizers.Adam(1e-3)
        notes.append("optimizer: Adam(1e-3)")
    if isinstance(loss, dict):
        loss = keras.losses.deserialize(loss)
    rng = np.random.default_rng(0)
    if spec.get("data"):
        with np.load(spec["data"]) as data:
            x, y = synthetic.from_archive(model, data)
        named = dict(zip(synthetic.expected_keys(model), keras.tree.flatten(x)))
        notes.extend(nonfinite_notes({**named, "y": y}))
    else:
        x = synthetic.inputs(model, samples, notes, rng)
        y = None
        notes.append("synthetic data from the input spec")
    if loss is None:
        loss = _default_loss(y)
        notes.append(f"no saved loss: using {loss!r}")
    if y is None:
        y = _synthetic_targets(model, x, loss, samples, rng)
    return model, x, y, loss, optimizer, notes


def nonfinite_notes(arrays):
    """A note per float array of `arrays` (name -> array) that holds NaN or
    inf values: training on it cannot give a finite loss."""
    import numpy as np

    notes = []
    for name, array in arrays.items():
        array = np.asarray(array)
        if array.dtype.kind != "f":
            continue
        bad = int(array.size - np.count_nonzero(np.isfinite(array)))
        if bad:
            notes.append(f"--data {name}: {bad} of {array.size} values are not finite")
    return notes


def environment():
    """TensorFlow/Keras versions and the devices (in the child)."""
    import platform

    import tensorflow as tf

    import keras

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
    }


def _median_ms(fn, reps):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _memory(tf, device, what):
    try:
        return tf.config.experimental.get_memory_info(device)[what]
    except (ValueError, RuntimeError):
        return None


def available_mib():
    """Memory available to a new process, in MiB (Linux `MemAvailable`;
    else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20


def resolve_kwargs(kwargs):
    """The compile kwargs with `budget_mb: "half_available"` made a number,
    and `precision: "static_rule"` the policy of precision="auto"'s static
    rule on this machine."""
    from keras_gradboost import precision as precision_lib

    kwargs = dict(kwargs)
    if kwargs.get("precision") == STATIC_RULE:
        # jit_compile="auto" is Keras': XLA on a GPU only.
        jit = kwargs.get("jit_compile") is True or (
            kwargs.get("jit_compile") == "auto" and precision_lib.gpu_available()
        )
        kwargs["precision"] = precision_lib.static_pick(jit)
    recompute = kwargs.get("recompute")
    if isinstance(recompute, dict) and recompute.get("budget_mb") == HALF_AVAILABLE:
        kwargs["recompute"] = {**recompute, "budget_mb": round(available_mib() / 2)}
    return kwargs


def final_loss(running_means):
    """The mean loss over the last quarter of the steps (at least one),
    recovered exactly from Keras' per-batch running means of equal-size
    batches: the sum of the first i losses is `i * running_means[i - 1]`."""
    n = len(running_means)
    k = max(1, n // 4)
    earlier = running_means[n - k - 1] * (n - k) if n > k else 0.0
    return (running_means[-1] * n - earlier) / k


def count_traces(model):
    """Wraps `model.train_step` (with `wrappers.patch`; read when Keras
    makes the train function) so each trace increments the returned
    counter."""
    from keras_gradboost import wrappers

    traces = [0]

    def counting_train_step(train_step, data):
        traces[0] += 1  # a Python side effect: runs only while tracing
        return train_step(data)

    wrappers.patch(model, "train_step", counting_train_step)
    return traces


def _measuring_unit(model):
    """Train calls per measured unit (`measure_schedule`) of
    `jit_compile="measure"` or `precision="auto"` (or `"measure"`) in
    `model`'s next fit, or 0 when it will not measure."""
    from keras_gradboost import measure_schedule
    from keras_gradboost import precision as precision_lib

    config = getattr(model, "gradboost_config", None)
    if config is None or model.run_eagerly:
        return 0
    jit = model.get_compile_config().get("jit_compile") == "measure"
    if jit and model.jit_measurement is not None:
        return 0
    precision = precision_lib.measures(config.precision)
    if not jit and (not precision or model.precision_measurement is not None):
        return 0
    return measure_schedule.calls_per_timing(
        config.accumulate_steps, int(model.steps_per_execution)
    )


def first_trace_calls(model):
    """How many first calls trace the train step: 1, or, under
    `jit_compile="measure"` or `precision="auto"`, the warm-up units of
    both variants."""
    from keras_gradboost import measure_schedule

    unit = _measuring_unit(model)
    return 2 * measure_schedule.WARMUP_CALLS * unit if unit else 1


def measuring_calls(model):
    """How many first calls `jit_compile="measure"` or `precision="auto"`
    runs both variants in (0 when it does not measure; units of whole
    windows within one epoch, `measure_schedule`)."""
    from keras_gradboost import measure_schedule

    units = 2 * (measure_schedule.WARMUP_CALLS + measure_schedule.TIMED_CALLS)
    return units * _measuring_unit(model)


def timed_fit(model, data, steps, device, warm_steps=0):
    """`fit` for `steps` batches, timing each and reading the memory peak.

    The peak is the allocator's over the batches after the first
    `warm_steps` (reset there when the device allows: the first calls'
    allocations, tracing and graph optimisation, are no training memory;
    they made recompute look like -10% on ResNet50 where a warmed fit
    shows -54%).

    Returns:
        `(seconds per batch, running-mean losses, traces after the first
        batch, peak bytes above the level before the measured batches or
        None)`.
    """
    import tensorflow as tf

    import keras

    traces = count_traces(model)
    times, losses, first_traces = [], [], []
    first_calls = first_trace_calls(model)

    level = {}

    def start_measuring():
        try:
            tf.config.experimental.reset_memory_stats(device)
        except (ValueError, RuntimeError):
            pass
        level["before"] = _memory(tf, device, "current")

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == warm_steps and warm_steps:
                start_measuring()
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)
            losses.append(float(logs["loss"]))
            if batch == first_calls - 1:
                # tf.function traces twice on a first call that creates
                # variables (optimizer slots): both are the first trace.
                first_traces.append(traces[0])

    start_measuring()
    model.fit(
        data, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0, callbacks=[Clock()]
    )
    peak, before = _memory(tf, device, "peak"), level["before"]
    grown = None if peak is None or before is None else peak - before
    return times, losses, traces[0] - first_traces[0], grown


def backward_share(model, batch, step_ms):
    """1 - forward-only time / train-step time on one batch, with medians
    over interleaved pairs (so both see the same machine load).

    Returns:
        `(share, forward ms, train step ms)`.
    """
    import tensorflow as tf

    forward = tf.function(
        lambda inputs: model(inputs, training=True), jit_compile=bool(model.jit_compile)
    )
    fixed = iter(tf.data.Dataset.from_tensors(batch).repeat())

    def forward_once():
        out = forward(batch[0])
        float(tf.reduce_sum(tf.cast(tf.nest.flatten(out)[0], "float32")))

    def step_once():
        logs = model.train_function(fixed)
        float(logs["loss"])

    for fn in (forward_once, step_once, forward_once, step_once):
        fn()  # warm-up: traces, compiles
    reps = max(SHARE_REPS, min(4 * SHARE_REPS, int(2000 / max(step_ms, 1.0))))
    forward_ms, full_ms = [], []
    for _ in range(reps):
        forward_ms.append(_median_ms(forward_once, 1))
        full_ms.append(_median_ms(step_once, 1))
    share = 1 - statistics.median(f / s for f, s in zip(forward_ms, full_ms))
    return max(0.0, share), statistics.median(forward_ms), statistics.median(full_ms)


def measure(spec):
    """Trains one configuration and returns its row (in the child)."""
    import warnings

    import tensorflow as tf

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    model, x, y, loss, optimizer, notes = build(spec)
    kwargs = resolve_kwargs(spec["kwargs"])
    batch_size, steps = spec["batch_size"], spec["steps"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer=optimizer, loss=loss, **kwargs)
    notes.extend(warning_notes(caught, limit=2))

    data = tf.data.Dataset.from_tensor_slices((x, y))
    if len(y) < batch_size:
        data = data.repeat()
    data = data.batch(batch_size, drop_remainder=True).repeat().prefetch(2)
    first_calls = first_trace_calls(model)
    # Under jit_compile="measure" or precision="auto" the steady state
    # starts after the choice.
    warm_steps = max(WARMUP_STEPS, measuring_calls(model))
    # What training warns about (an inexact accumulation, a recompute that
    # saves nothing) belongs in the table as much as what compile says.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warm = min(warm_steps, steps - 1)
        times, losses, retraces, grown = timed_fit(model, data, steps, device, warm)
        step_ms = statistics.median(times[warm:]) * 1000
        share, forward_ms, full_ms = backward_share(model, next(iter(data)), step_ms)
    notes.extend(n for n in warning_notes(caught) if n not in notes)

    counted = count_step_flops(model, data, notes)
    plan = model.recompute_plan()
    loss_now = final_loss(losses)
    if not math.isfinite(loss_now):
        notes.append(f"the training loss is not finite ({loss_now})")
    return {
        **xla_fields(model),
        "precision_measurement": precision_fields(model),
        "model": spec["model"],
        "compiled_with": kwargs,
        "batch_size": batch_size,
        "steps": steps,
        "step_ms": step_ms,
        "compile_s": max(0.0, sum(times[:first_calls]) - first_calls * step_ms / 1000),
        "examples_per_s": batch_size / (step_ms / 1000),
        "backward_share": share,
        "forward_ms": forward_ms,
        "full_step_ms": full_ms,
        "peak_mib": None if grown is None else grown / 2**20,
        **counted,
        "retraces": retraces,
        "final_loss": loss_now,
        "jit_compile": bool(model.jit_compile),
        "policy": model.dtype_policy_applied or model.dtype_policy.name,
        "accumulate_steps": model.gradboost_config.accumulate_steps,
        "recomputed": len(plan.recomputed) if plan.setting is not None else 0,
        "notes": notes,
        "environment": environment(),
    }


def warning_notes(caught, limit=3):
    """The first sentence of each distinct warning in `caught` (recorded
    `warnings`), at most `limit`."""
    notes = []
    for w in caught:
        first = str(w.message).split(". ")[0]
        if first not in notes:
            notes.append(first)
    return notes[:limit]


def count_step_flops(model, data, notes):
    """The row's `step_flops*` fields (see the module docstring): the
    train step traced once more on the batches' specs; a note when the
    count is a lower bound, or when it failed (then None)."""
    from keras_gradboost import flops

    try:
        counted = flops.step_flops(model, data.element_spec)
    except Exception as error:  # noqa: BLE001 - the row keeps its timings
        notes.append(f"FLOPs not counted ({_one_line(error)})")
        return {"step_flops": None, "step_flops_by_dtype": None,
                "step_flops_exact": None, "step_flops_uncounted": []}
    if not counted.exact:
        shown = "; ".join(counted.uncounted[:2])
        more = len(counted.uncounted) - 2
        shown += f"; and {more} more" if more > 0 else ""
        notes.append(f"FLOPs are a lower bound, not counted: {shown}")
    return {
        "step_flops": counted.total,
        "step_flops_by_dtype": counted.by_dtype,
        "step_flops_exact": counted.exact,
        "step_flops_uncounted": list(counted.uncounted),
    }


def xla_fields(model):
    """`xla` (see the module docstring) and `jit_measurement` of a row."""
    state = "on" if model.jit_compile else "off"
    blocked = getattr(model, "xla_blocked_reason", None)
    if blocked and not model.jit_compile:
        state = f"off: {blocked}"
    measurement = getattr(model, "jit_measurement", None)
    fields = {"xla": state, "jit_measurement": None}
    if measurement is not None:
        fields["jit_measurement"] = {
            "jit_compile": measurement.jit_compile,
            "xla_ms": measurement.xla_ms,
            "no_xla_ms": measurement.no_xla_ms,
            "timed_calls": measurement.timed_calls,
            "reason": measurement.reason,
        }
        if measurement.xla_ms is not None:
            fields["xla"] = (
                f"{state} (measured {measurement.xla_ms:.2f} vs "
                f"{measurement.no_xla_ms:.2f} ms)"
            )
    return fields


def precision_fields(model):
    """`precision_measurement` of a row: what `precision="auto"` chose
    (policy, both medians in ms, reason), or None."""
    measurement = getattr(model, "precision_measurement", None)
    if measurement is None:
        return None
    return {
        "policy": measurement.policy,
        "mixed_policy": measurement.mixed_policy,
        "float32_ms": measurement.float32_ms,
        "mixed_ms": measurement.mixed_ms,
        "timed_calls": measurement.timed_calls,
        "reason": measurement.reason,
    }


def child_main(argv):
    spec = json.loads(argv[0])
    if "peak_dtypes" in spec:
        from keras_gradboost import flops

        peaks = flops.measure_peak(spec["peak_dtypes"], size=spec["size"])
        print(json.dumps({"flop_per_s": peaks}), flush=True)
        return 0
    try:
        row = measure(spec)
    except Exception as error:  # noqa: BLE001 - reported as the row's reason
        print(json.dumps({"error": _one_line(error)}), flush=True)
        return 1
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
