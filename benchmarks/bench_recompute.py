"""Recompute benchmark: training memory and step time, each configuration in
its own process.

Model: `zoo.residual_mlp` (16 pre-norm residual blocks, width 256, 4x inner
expansion with gelu), batch 2048, Adam, float32, no XLA: training memory is
dominated by activations. Configurations: no recompute (baseline),
`recompute="auto"`, Keras' own `keras.RematScope` (modes "activations" and
"full"), and `recompute={"budget_mb": N}` for budgets at fractions of the
baseline's estimated training peak (`peak_bytes_without`).

Each configuration runs in a fresh subprocess (no shared allocator pools or
caches), once per round, rounds in shuffled order. In the subprocess: build,
compile, two warm-up steps through `fit`, then `--reps` timings of `--steps`
calls of the compiled train function (one host sync each).

Measured, per configuration:
- train MiB: TensorFlow's CPU allocator peak during the timed steps minus
  its level just before them (`tf.config.experimental.get_memory_info`
  after `reset_memory_stats`): what training adds on top of weights and
  optimizer slots. This is the figure the targets use.
- req MiB: the peak of the bytes requested by the allocations of
  `--steps` more steps, above the level at their start (the TensorFlow
  profiler's memory events, `requested_peak.py`): the allocator peak counts
  whole BFC chunks (a buffer can read as nearly twice its size) and is taken
  against a level that includes buffers the steps free.
- RSS MiB: the subprocess's peak resident set size minus its size before
  the first `fit` (includes tracing and allocator pools; a cross-check).
- step: median seconds per step; its ratio to the baseline is the median
  over rounds of the ratio within each round.

    python benchmarks/bench_recompute.py [--rounds 3] [--quick]

`--precision P` compiles every configuration with `precision=P` (the
policy set after the model is built: no cut where a raw operation reads,
`choice.cut_points`); `--global-policy P` sets the global policy before
building instead. Memory table only:

    python benchmarks/bench_recompute.py --models ConvNeXtTiny --depthwise native \
        --configs baseline,auto,selective --precision mixed_bfloat16

`--update U` trains every configuration with an update that waits for
every gradient (`updates.gradients_pile_up`): Adam with `global_clipnorm`
(`global_clipnorm`), wrapped in a `LossScaleOptimizer`
(`loss_scale_optimizer`), with Keras' `gradient_accumulation_steps=2`
(`optimizer_accumulation`), or with a `NaNWatcher` (`nan_watcher`: the
steps run through `fit`, where the watcher is attached). Memory table
only:

    python benchmarks/bench_recompute.py --models ResNet50 --configs baseline,auto \
        --update nan_watcher

`--models ... --time` instead times, in one process per model, no
recompute against itself (A/A) and each of `--configs` ("auto" and
selective recompute by default; budget_F as above) against no recompute:
pairs of back-to-back `fit`s in alternating order (`fit_rounds.paired`,
tf.data autotuning off), the median ratio over `--rounds` rounds with a
bootstrap 95% CI. Step time only: the memory figures need a process per
configuration.

    python benchmarks/bench_recompute.py --models bert,gpt2 --time --rounds 12
    python benchmarks/bench_recompute.py --models gpt2 --time --configs auto,budget_0.45

`--models ... --search-time` times, in one process, the estimates "auto" and
a budget search at the first traced batch: every kind of plan from one
traced step (`RecomputeSetup.search` now) against a trace per kind (what
it did before), pairs in alternating order, an A/A row beside; batch 16
(the residual MLP's 2048).

    python benchmarks/bench_recompute.py --models nested_MobileNetV2,gpt2 \
        --search-time --pixels 32 --rounds 6

`--sweep` instead runs a budget sweep on keras.applications models
(`--apps`, weights=None, `--pixels` square inputs, `--batch`, default 16):
per model no recompute, "auto" and four budgets (`SWEEP_FRACTIONS` of no
recompute's estimated training peak, above the XLA depthwise temporary
no plan removes, `RecomputePlan.xla_temporary_bytes`), each with its
estimated training peak beside its measured train MiB and req MiB.

    python benchmarks/bench_recompute.py --sweep [--apps MobileNetV2,ResNet50]
"""

import argparse
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Allocator statistics on a CPU need TensorFlow's BFC allocator, not the
# default on every CPU.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

BUDGET_FRACTIONS = (0.6, 0.4, 0.25)
SWEEP_FRACTIONS = (0.8, 0.6, 0.45, 0.3)


def _rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args):
    """Runs one configuration and prints one JSON line."""
    import tensorflow as tf

    import keras
    from keras_gradboost import zoo
    from requested_peak import requested_peak

    config = args.worker
    size = dict(blocks=args.blocks, width=args.width)
    kwargs = {}
    if args.global_policy:  # before the model is built: its graph in that dtype
        keras.mixed_precision.set_global_policy(args.global_policy)
    if args.precision:
        kwargs["precision"] = args.precision
    if config.startswith("rematscope_") and not (args.app or args.hub):
        with keras.RematScope(mode=config.split("_", 1)[1]):
            model = zoo.residual_mlp(cls=keras.Model, **size)
    else:
        model = (
            application(args) if args.app else hub_model(args) if args.hub
            else zoo.residual_mlp(**size)
        )
        recompute = _recompute_setting(config)
        if recompute is not None:
            kwargs["recompute"] = recompute
        if args.depthwise:
            kwargs["depthwise"] = args.depthwise
        if args.pointwise:
            kwargs["pointwise"] = args.pointwise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.compile(
            optimizer=optimizer(args),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=bool(args.hub)),
            jit_compile=args.jit,
            **kwargs,
        )
    x, y = training_data(args)
    data = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(args.batch, drop_remainder=True)
        .repeat()
    )
    result = {"config": config}
    rss_before = _rss_bytes()
    callbacks = []
    if args.update == "nan_watcher":
        from keras_gradboost.callbacks import NaNWatcher

        callbacks = [NaNWatcher(action="skip", verbose=0)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(data, steps_per_epoch=2, epochs=1, verbose=0, callbacks=callbacks)
    except Exception as error:  # noqa: BLE001 - reported in the table
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Keras' bold markers
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        telling = [line for line in lines if "gradient" in line] or lines or [""]
        result["error"] = f"{type(error).__name__}: {telling[0][:110]}"
        print(json.dumps(result))
        return
    iterator = iter(data)

    def steps():  # --steps calls of the compiled train function, one host sync
        if callbacks:  # attached by fit alone
            model.fit(data, steps_per_epoch=args.steps, epochs=1, verbose=0, callbacks=callbacks)
            return
        for _ in range(args.steps):
            logs = model.train_function(iterator)
        float(logs["loss"])

    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        steps()
        times.append((time.perf_counter() - start) / args.steps)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    result["requested_bytes"] = requested_peak(steps)
    if args.contents:
        from requested_peak import alive_at_peak

        contents_peak, alive = alive_at_peak(steps)
        result["peak_contents"] = [contents_peak] + [
            [size, (op or "(no op)").split("/", 1)[-1]] for size, op in alive[: args.contents]
        ]
    result.update(
        step_s=statistics.median(times),
        train_bytes=peak - before,
        rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        - rss_before,
    )
    if hasattr(model, "recompute_plan") and "recompute" in kwargs:
        plan = model.recompute_plan()
        result["recomputed"] = len(plan.recomputed)
        result["estimate_bytes"] = plan.bytes_with
        result["peak_estimate_bytes"] = plan.peak_bytes
        result["peak_alone_bytes"] = plan.peak_bytes_updates_alone
    print(json.dumps(result))


def optimizer(args):
    """Adam, with `--update`'s option."""
    import keras

    if args.update == "global_clipnorm":
        return keras.optimizers.Adam(global_clipnorm=1.0)
    if args.update == "optimizer_accumulation":
        return keras.optimizers.Adam(gradient_accumulation_steps=2)
    if args.update == "loss_scale_optimizer":
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    return keras.optimizers.Adam()


def _recompute_setting(config):
    """The `recompute` argument of a configuration name (None: none)."""
    if config == "auto":
        return "auto"
    if config == "selective":
        return {"policy": "selective"}
    if config.startswith("budget_"):
        return {"budget_mb": float(config.split("_")[1])}
    if config.startswith("blocks_"):  # blocks_<glob>[+<glob>...]: named blocks
        return tuple(config.split("_", 1)[1].split("+"))
    return None


def select_model(args, name):
    """Points `args` at model `name` (residual_mlp, a keras-hub backbone in
    HUB or a keras.applications model) with its batch size."""
    args.app = args.hub = None
    if name in HUB:
        args.hub, args.batch = name, 16
    elif name != "residual_mlp":
        args.app, args.batch = name, 16
    else:
        args.batch = 2048


def training_data(args):
    """`(x, y)`: two batches of the model's synthetic training data."""
    from keras_gradboost import zoo

    if args.app:
        return zoo.image_data(args.batch * 2, shape=(args.pixels, args.pixels, 3))
    if args.hub:
        return hub_data(args)
    return zoo.classification_data(args.batch * 2)


def application(args):
    """`keras.applications.<args.app>` (weights=None), boosted. A name
    `nested_<App>`: keras.io's fine-tuning pattern instead, the application
    without its top called as a layer of a functional model, with a pooled
    10-class head (everything trainable); `frozen_<App>`: the same with the
    base frozen (keras.io's transfer learning)."""
    import keras

    import keras_gradboost as kgb

    keras.utils.set_random_seed(0)
    shape = (args.pixels, args.pixels, 3)
    name = args.app.removeprefix("nested_").removeprefix("frozen_")
    app = getattr(keras.applications, name)
    if name == args.app:
        return kgb.boost(app(input_shape=shape, weights=None, classes=10))
    base = app(input_shape=shape, weights=None, include_top=False)
    base.trainable = not args.app.startswith("frozen_")
    inputs = keras.Input(shape)
    pooled = keras.layers.GlobalAveragePooling2D()(base(inputs))
    return kgb.boost(keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(pooled)))


# keras-hub backbones built from constructor arguments (no weights), with a
# per-token head: (backbone class, layers). Width 256, 4 heads, feed-forward
# 1024, vocabulary 1000, sequences of HUB_LENGTH.
HUB = {"bert": ("BertBackbone", 4), "gpt2": ("GPT2Backbone", 2)}
HUB_LENGTH, HUB_VOCAB = 128, 1000


def hub_model(args):
    """`keras_hub.models.<backbone>` (dropout 0.1) with a 3-class per-token
    head, boosted."""
    import keras
    import keras_hub

    import keras_gradboost as kgb

    keras.utils.set_random_seed(0)
    name, layers = HUB[args.hub]
    backbone = getattr(keras_hub.models, name)(
        vocabulary_size=HUB_VOCAB, num_layers=layers, num_heads=4, hidden_dim=256,
        intermediate_dim=1024, max_sequence_length=HUB_LENGTH, dropout=0.1,
    )
    out = backbone(backbone.input)
    sequence = out["sequence_output"] if isinstance(out, dict) else out
    head = keras.layers.Dense(3, name="tag_head")(sequence)
    return kgb.boost(keras.Model(backbone.input, head))


def hub_data(args):
    import numpy as np

    rng = np.random.default_rng(0)
    n = args.batch * 2
    x = {
        "token_ids": rng.integers(1, HUB_VOCAB, size=(n, HUB_LENGTH)).astype("int32"),
        "padding_mask": np.ones((n, HUB_LENGTH), "int32"),
    }
    if args.hub == "bert":
        x["segment_ids"] = np.zeros((n, HUB_LENGTH), "int32")
    return x, rng.integers(0, 3, size=(n, HUB_LENGTH))


def estimates(args):
    """recompute="auto"'s plan at the batch size (`RecomputePlan`: its
    estimates and no recompute's)."""
    import keras  # noqa: F401
    from keras_gradboost import zoo

    if args.global_policy:
        keras.mixed_precision.set_global_policy(args.global_policy)
    try:
        if args.app or args.hub:
            model = application(args) if args.app else hub_model(args)
        else:
            model = zoo.residual_mlp(blocks=args.blocks, width=args.width)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # As the workers compile it (under XLA the slices of "chunked" do not run).
    model.compile(optimizer=optimizer(args), loss=keras.losses.SparseCategoricalCrossentropy(),
                  recompute="auto", depthwise=args.depthwise, pointwise=args.pointwise,
                  precision=args.precision, jit_compile=args.jit)
    plan = model.recompute_plan(batch_size=args.batch)
    # Inputs of unknown length are estimated at fit; a NaNWatcher's fit
    # holds every gradient, which the plan's peaks then count.
    if plan.bytes_without is None or args.update == "nan_watcher":
        from keras_gradboost.callbacks import NaNWatcher

        watcher = [NaNWatcher(verbose=0)] if args.update == "nan_watcher" else []
        x, y = training_data(args)
        model.fit(x, y, batch_size=args.batch, epochs=1, steps_per_epoch=1, verbose=0,
                  callbacks=watcher)
        plan = model.recompute_plan(batch_size=args.batch)
    return plan


def run(config, args):
    command = [
        sys.executable,
        __file__,
        "--worker",
        config,
        "--blocks", str(args.blocks),
        "--width", str(args.width),
        "--batch", str(args.batch),
        "--steps", str(args.steps),
        "--reps", str(args.reps),
        "--pixels", str(args.pixels),
    ] + (["--jit"] if args.jit else []) + (["--app", args.app] if args.app else []) + (
        ["--hub", args.hub] if args.hub else []) + (
        ["--depthwise", args.depthwise] if args.depthwise else []) + (
        ["--pointwise", args.pointwise] if args.pointwise else []) + (
        ["--precision", args.precision] if args.precision else []) + (
        ["--global-policy", args.global_policy] if args.global_policy else []) + (
        ["--update", args.update] if args.update else []) + (
        ["--contents", str(args.contents)] if args.contents else [])
    out = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"config": config, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:90]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small model, 1 round")
    parser.add_argument("--sweep", action="store_true", help="budget sweep on --apps")
    parser.add_argument("--apps", default="MobileNetV2,ResNet50")
    parser.add_argument("--pixels", type=int, default=64)
    parser.add_argument("--models", help="per-model table: residual_mlp, bert, gpt2, "
                        "keras.applications names, nested_<name> for the application "
                        "called as a layer (fine-tuning), frozen_<name> for the same "
                        "with the base frozen (transfer learning; comma-separated)")
    parser.add_argument("--configs", default="baseline,auto,selective",
                        help="with --models: configurations; budget_F is a budget at "
                        "F times no recompute's estimate; blocks_GLOB[+GLOB] recomputes "
                        "the layers named")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True (XLA)")
    parser.add_argument("--depthwise", choices=["keras", "native", "chunked"],
                        help="compile(depthwise=...) in every configuration")
    parser.add_argument("--pointwise", choices=["matmul"],
                        help='compile(pointwise="matmul") in every configuration')
    parser.add_argument("--precision", choices=["mixed_bfloat16", "mixed_float16"],
                        help="compile(precision=...) in every configuration (the "
                        "policy set after the model is built; memory table only)")
    parser.add_argument("--global-policy", choices=["mixed_bfloat16", "mixed_float16"],
                        help="keras.mixed_precision.set_global_policy before the model "
                        "is built (memory table only)")
    parser.add_argument("--update", choices=["global_clipnorm", "loss_scale_optimizer",
                                             "optimizer_accumulation", "nan_watcher"],
                        help="an update that waits for every gradient in every "
                        "configuration (memory table only)")
    parser.add_argument("--contents", type=int, default=0, metavar="N",
                        help="with --models: print the N largest allocations alive "
                        "at each configuration's requested peak (one more run of "
                        "its steps under the profiler)")
    parser.add_argument("--time", action="store_true",
                        help="with --models: step time only, paired in one process "
                        "(--configs: auto, selective, budget_F)")
    parser.add_argument("--search-time", action="store_true",
                        help="with --models: the search's estimates, one trace for "
                        "every kind of plan against one per kind, paired in one process")
    parser.add_argument("--time-worker", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--hub", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if (args.precision or args.global_policy or args.update) and (args.time or args.sweep):
        parser.error(
            "--precision, --global-policy and --update apply to the --models memory table"
        )
    if args.search_time and not args.models:
        parser.error("--search-time times the search on --models: name them")
    if args.worker:
        return worker(args)
    if args.time_worker:
        return time_worker(args)
    if args.models and args.time:
        return time_model(args)
    if args.models and args.search_time:
        return search_time(args)
    if args.sweep:
        return sweep(args)
    if args.models:
        return per_model(args)
    if args.quick:
        args.rounds, args.blocks, args.batch = 1, 4, 512

    plan = estimates(args)
    without, with_auto = plan.bytes_without, plan.bytes_with
    mib = 2**20
    budgets = [f"budget_{plan.peak_bytes_without * f / mib:.0f}" for f in BUDGET_FRACTIONS]
    configs = ["baseline", "auto", "rematscope_activations", "rematscope_full"] + budgets
    results = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[:]
        random.shuffle(order)
        for config in order:
            results[config].append(run(config, args))
            print(f"round {r + 1}/{args.rounds}: {config} done", file=sys.stderr, flush=True)

    base = results["baseline"]
    print(
        f"\nRecompute: residual MLP, {args.blocks} blocks, width {args.width}, "
        f"batch {args.batch}, Adam, float32, no XLA; {args.rounds} round(s), "
        "each configuration in its own process."
    )
    print(
        f"Estimated activations kept for backward: {without / mib:.0f} MiB "
        f"without recompute, {with_auto / mib:.0f} MiB with recompute=\"auto\"; "
        f"training peak without recompute {plan.peak_bytes_without / mib:.0f} MiB "
        "(the budgets are fractions of it)."
    )
    header = (
        f"{'configuration':<24} {'blocks':>6} {'estimate':>9} {'train MiB':>10} "
        f"{'x base':>7} {'RSS MiB':>8} {'x base':>7} {'step s':>7} {'x base':>7}"
    )
    print(header)
    print("-" * len(header))
    for config in configs:
        runs = results[config]
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            print(f"{config:<24} fails: {errors[0]}")
            continue
        train = statistics.median(r["train_bytes"] for r in runs)
        rss = statistics.median(r["rss_bytes"] for r in runs)
        step = statistics.median(r["step_s"] for r in runs)
        base_train = statistics.median(r["train_bytes"] for r in base)
        base_rss = statistics.median(r["rss_bytes"] for r in base)
        step_ratio = statistics.median(
            r["step_s"] / b["step_s"] for r, b in zip(runs, base)
        )
        blocks = runs[0].get("recomputed", "-")
        estimate = runs[0].get("estimate_bytes")
        estimate = f"{estimate / mib:.0f}" if estimate else "-"
        print(
            f"{config:<24} {blocks:>6} {estimate:>9} {train / mib:>10.0f} "
            f"{train / base_train:>6.2f}x {rss / mib:>8.0f} {rss / base_rss:>6.2f}x "
            f"{step:>7.3f} {step_ratio:>6.2f}x"
        )
    print(
        "\nTargets: recompute=\"auto\" train memory <= 0.5x baseline, step time "
        "<= 1.4x; budget rows: measured train memory tracks the budget (MiB in the name)."
    )


def time_model(args):
    """`--time`: one process per model (`--models`), paired in-process."""
    print(
        "Recompute step time, one process per model, pairs of back-to-back fits "
        f"of {args.steps} steps in alternating order, {args.rounds} rounds; float32, "
        f"Adam, {'XLA' if args.jit else 'no XLA'}. ratio: median of "
        "configuration / no recompute, [bootstrap 95% CI]."
    )
    for name in args.models.split(","):
        command = [sys.executable, __file__, "--time-worker", name, "--rounds",
                   str(args.rounds), "--steps", str(args.steps), "--configs", args.configs,
                   "--pixels", str(args.pixels)] + (["--jit"] if args.jit else []) + (
                   ["--depthwise", args.depthwise] if args.depthwise else []) + (
                   ["--pointwise", args.pointwise] if args.pointwise else [])
        out = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        lines = [line for line in out.stdout.splitlines() if line.startswith("  ")]
        print(f"{name}:")
        print("\n".join(lines) or f"  fails: {(out.stderr.strip().splitlines() or ['?'])[-1]}")


def time_worker(args):
    import warnings as _warnings

    import tensorflow as tf

    import keras
    from fit_rounds import paired
    from fit_rounds import ratio
    from keras_gradboost import zoo

    select_model(args, args.time_worker)

    def build(recompute):
        model = (
            hub_model(args) if args.hub else application(args) if args.app
            else zoo.residual_mlp(blocks=args.blocks, width=args.width)
        )
        with _warnings.catch_warnings():
            _warnings.simplefilter("ignore")
            model.compile(
                optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=bool(args.hub)),
                jit_compile=args.jit,
                recompute=recompute,
                depthwise=args.depthwise,
                pointwise=args.pointwise,
            )
        return model

    x, y = training_data(args)
    options = tf.data.Options()
    options.autotune.enabled = False
    ds = (tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True)
          .repeat().with_options(options))
    configs = [c for c in args.configs.split(",") if c != "baseline"]
    unknown = [c for c in configs if _recompute_setting(c) is None]
    if unknown:
        raise SystemExit(f"--configs: {unknown} are none of auto, selective, budget_F, "
                         "blocks_GLOB, baseline")
    if any(c.startswith("budget_") for c in configs):
        without = estimates(args).peak_bytes_without  # budget_F: F times it
    base = build(None)
    pairs = {"A/A: no recompute / itself": [((base, []), (build(None), []))]}
    for config in configs:
        setting = _recompute_setting(config)
        if config.startswith("budget_"):
            mib = without * float(config.split("_")[1]) / 2**20
            setting = {"budget_mb": round(mib, 1), "batch_size": args.batch}
        pairs[f"recompute={setting!r}"] = [((base, []), (build(setting), []))]
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore")
        times = paired(pairs, ds, args.steps, args.rounds)
    for label, pair_times in times.items():
        value, (low, high) = ratio(pair_times)
        model = pairs[label][0][1][0]
        blocks = len(model.recompute_plan().recomputed) if model.gradboost_config.recompute else "-"
        print(f"  {label:<48} {value:6.3f}x [95% CI {low:.3f}-{high:.3f}]  blocks {blocks}")


def search_time(args):
    """`--search-time`: per model, seconds of the search's estimates."""
    import time

    import tensorflow as tf

    from fit_rounds import ratio
    from keras_gradboost import zoo
    from keras_gradboost.recompute import choice

    print(
        "Recompute search: estimates of every kind of plan from one traced step "
        "against one trace per kind (before), in one process, pairs in alternating "
        f"order, {args.rounds} rounds. ratio: median of "
        "one trace / a trace per kind, [bootstrap 95% CI]."
    )
    for name in args.models.split(","):
        select_model(args, name)
        model = (
            hub_model(args) if args.hub else application(args) if args.app
            else zoo.residual_mlp(blocks=args.blocks, width=args.width)
        )
        model.compile(optimizer="adam", loss="mse", recompute="auto")
        setup = model._gradboost.recompute
        spec = tf.nest.map_structure(
            lambda t: tf.TensorSpec([args.batch] + list(t.shape[1:]), t.dtype), model.input
        )
        kinds = choice.search_families(model)

        def together():
            setup._estimate_together(model, spec, kinds)

        def per_kind():
            for layers, pieces in kinds:
                setup.layers, setup.segments = layers, pieces
                setup.apply()
                setup._estimate(model, spec)

        def seconds(fn):
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        pairs = {"A/A: one trace / itself": (together, together), "one trace": (per_kind, together)}
        times = {label: [] for label in pairs}
        together()  # builds the model
        for round_ in range(args.rounds):
            for label, (a, b) in pairs.items():
                if round_ % 2:
                    tb, ta = seconds(b), seconds(a)
                else:
                    ta, tb = seconds(a), seconds(b)
                times[label].append((ta, tb))
        print(f"{name}: {len(kinds)} kinds of plan, batch {args.batch}")
        for label, pair_times in times.items():
            value, (low, high) = ratio(pair_times)
            a_s, b_s = (statistics.median(t) for t in zip(*pair_times))
            print(f"  {label:<26} {value:6.3f}x [95% CI {low:.3f}-{high:.3f}]  "
                  f"{a_s:.2f} s -> {b_s:.2f} s")


def per_model(args):
    """Per model (`--models`), each configuration (`--configs`) in its own
    process per round, the rounds in alternating order: train memory and
    step time against no recompute's, and the plan's estimate."""
    mib = 2**20
    configs = args.configs.split(",")
    table = []
    for name in args.models.split(","):
        select_model(args, name)
        run_configs = []
        plan = estimates(args)
        for config in configs:
            if config.startswith("budget_"):
                fraction = float(config.split("_")[1])
                config = f"budget_{plan.peak_bytes_without * fraction / mib:.1f}"
            run_configs.append(config)
        results = {c: [] for c in run_configs}
        for r in range(args.rounds):
            order = run_configs if r % 2 == 0 else run_configs[::-1]
            for config in order:
                results[config].append(run(config, args))
                print(f"{name} round {r + 1}/{args.rounds}: {config} done",
                      file=sys.stderr, flush=True)
        table.append((name, plan.peak_bytes_without, results))
    print(
        f"\nRecompute per model: each configuration in its own process, "
        f"{args.rounds} round(s) in alternating order; "
        + (f"compile(precision={args.precision!r})" if args.precision else
           f"global policy {args.global_policy} set before building" if args.global_policy
           else "float32")
        + ", Adam" + (f" ({args.update})" if args.update else "") + ", "
        f"{'XLA' if args.jit else 'no XLA'}; "
        f"keras.applications at {args.pixels}x{args.pixels}, batch 16; keras-hub "
        f"(width 256, 4 heads, sequences of {HUB_LENGTH}, dropout 0.1), batch 16; "
        "residual MLP batch 2048."
    )
    header = (
        f"{'model':<14} {'configuration':<16} {'blocks':>6} {'estimate':>9} "
        f"{'peak est':>9} {'train MiB':>10} {'/ est':>6} {'x base':>7} {'req MiB':>8} "
        f"{'/ est':>6} {'alone':>6} {'/ alone':>7} {'x base':>7} {'step s':>7} "
        f"{'x base':>7} {'(min-max)':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, peak_without, results in table:
        base = results[next(iter(results))]
        for config, runs in results.items():
            errors = [r["error"] for r in runs if "error" in r]
            if errors or any("error" in b for b in base):
                print(f"{name:<14} {config:<16} fails: {(errors or ['(baseline)'])[0]}")
                continue
            train = statistics.median(r["train_bytes"] for r in runs)
            base_train = statistics.median(r["train_bytes"] for r in base)
            requested = statistics.median(r["requested_bytes"] for r in runs)
            base_requested = statistics.median(r["requested_bytes"] for r in base)
            ratios = [r["step_s"] / b["step_s"] for r, b in zip(runs, base)]
            estimate = runs[0].get("estimate_bytes")
            peak = runs[0].get("peak_estimate_bytes")
            alone = runs[0].get("peak_alone_bytes")
            if config == "baseline":
                peak, alone = peak_without, None
            print(
                f"{name:<14} {config:<16} {runs[0].get('recomputed', '-')!s:>6} "
                f"{(f'{estimate / mib:.1f}' if estimate else '-'):>9} "
                f"{(f'{peak / mib:.1f}' if peak else '-'):>9} "
                f"{train / mib:>10.1f} {(f'{train / peak:.2f}' if peak else '-'):>6} "
                f"{train / base_train:>6.2f}x "
                f"{requested / mib:>8.1f} {(f'{requested / peak:.2f}' if peak else '-'):>6} "
                f"{(f'{alone / mib:.1f}' if alone else '-'):>6} "
                f"{(f'{requested / alone:.2f}' if alone else '-'):>7} "
                f"{requested / base_requested:>6.2f}x "
                f"{statistics.median(r['step_s'] for r in runs):>7.3f} "
                f"{statistics.median(ratios):>6.2f}x "
                f"{f'({min(ratios):.2f}-{max(ratios):.2f})':>13}"
            )
    print(
        "\ntrain MiB: allocator peak of the timed steps above the level before "
        "them (activations, gradients, temporaries); x base: against the first "
        "configuration (no recompute); step x base: median over rounds of the "
        "ratio within each round. estimate: recompute_plan().bytes_with at the "
        "batch size (activations kept for backward); peak est: with the "
        "gradients alive with them (recompute_plan().peak_bytes; for the "
        "baseline, .peak_bytes_without); / est: train MiB over it. "
        "req MiB: the peak of the bytes requested by the allocations of "
        "--steps more steps, above the level at their start (the profiler's "
        "memory events, requested_peak.py; the allocator peak counts whole "
        "chunks); / est: req MiB over peak est. alone: the training peak "
        "estimated with each optimizer update alone (recompute_plan()."
        "peak_bytes_updates_alone, the low end); / alone: req MiB over it."
    )
    if args.contents:
        print_contents(table)


def print_contents(table):
    """`--contents`: per model and configuration (its first round), the
    largest allocations alive at the requested peak of its steps."""
    mib = 2**20
    print(
        "\nAlive at the requested peak (the allocations of one more run of the "
        "steps, largest first; requested_peak.alive_at_peak):"
    )
    for name, _, results in table:
        for config, runs in results.items():
            contents = runs[0].get("peak_contents")
            if not contents:
                continue
            peak, largest = contents[0], contents[1:]
            print(f"{name} {config}: peak {peak / mib:.1f} MiB")
            for size, op in largest:
                print(f"  {size / mib:7.2f}  {op}")


def sweep(args):
    """The budget sweep: per model, estimate against measured train MiB."""
    mib = 2**20
    if args.batch == 2048:  # the residual MLP's default: too large here
        args.batch = 16
    rows = []
    for app in args.apps.split(","):
        args.app = app
        plan = estimates(args)
        # Above a temporary no plan removes (XLA's depthwise backward), so
        # that each budget is one a plan can meet.
        floor = plan.xla_temporary_bytes
        budgets = [
            f"budget_{(floor + (plan.peak_bytes_without - floor) * f) / mib:.1f}"
            for f in SWEEP_FRACTIONS
        ]
        for config in ["baseline", "auto"] + budgets:
            result = run(config, args)
            print(f"{app}: {config} done", file=sys.stderr, flush=True)
            rows.append((app, plan.peak_bytes_without, result))
    print(
        f"\nBudget sweep: keras.applications, weights=None, {args.pixels}x"
        f"{args.pixels} inputs, batch {args.batch}, Adam, float32, no XLA; "
        "one process per row."
    )
    header = (
        f"{'model':<14} {'configuration':<16} {'blocks':>6} {'peak est':>9} "
        f"{'train MiB':>10} {'/ est':>6} {'req MiB':>8} {'/ est':>6}  "
        "smaller budget, larger peak?"
    )
    print(header)
    print("-" * len(header))
    previous = {}  # model: the last budget row's measured bytes
    for app, without, result in rows:
        if "error" in result:
            print(f"{app:<14} {result['config']:<16} fails: {result['error']}")
            continue
        estimate = result.get("peak_estimate_bytes", without)
        train, requested = result["train_bytes"], result["requested_bytes"]
        flag = ""
        if result["config"].startswith("budget_"):
            # 2% of slack: the peaks move that much run to run.
            if app in previous and requested > previous[app] * 1.02:
                flag = f"  YES (+{(requested / previous[app] - 1) * 100:.0f}%)"
            previous[app] = requested
        print(
            f"{app:<14} {result['config']:<16} {result.get('recomputed', 0):>6} "
            f"{estimate / mib:>9.1f} {train / mib:>10.1f} {train / estimate:>6.2f} "
            f"{requested / mib:>8.1f} {requested / estimate:>6.2f}{flag}"
        )
    print(
        "\npeak est: activations kept for backward plus the gradients alive "
        "with them (recompute_plan().peak_bytes; .peak_bytes_without for the "
        "baseline); train MiB: allocator peak of the timed steps above the "
        "level before them; req MiB: the peak of the bytes their allocations "
        "request (the profiler's memory events); budgets in decreasing order, "
        "each flagged if its req MiB is larger than the previous (larger) "
        "budget's."
    )


if __name__ == "__main__":
    main()
