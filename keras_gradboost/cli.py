"""Command line: `keras-gradboost compare` and `keras-gradboost launch`
(also `python -m keras_gradboost`).

`compare` trains one model under each configuration (baseline, XLA,
precision "auto", gradient accumulation, recompute, all on), each in a fresh
subprocess (`keras_gradboost/compare.py`), and prints one side-by-side
table. `launch` runs a script in N local workers of one
MultiWorkerMirroredStrategy cluster (`keras_gradboost/launcher.py`).
Arguments are checked before any TensorFlow process starts: a bad one exits
with status 2 and a one-line error naming the argument, the value and what
is accepted.
"""

import argparse
import importlib.util
import json
import os
import sys
import zipfile

from keras_gradboost import compare as compare_lib
from keras_gradboost import flops as flops_lib
from keras_gradboost import launcher

EPILOG = """\
configurations (compile keyword arguments of GradBoostModel):
  baseline        jit_compile=False
  jit_compile     jit_compile=True (XLA)
  precision_auto  precision="auto" (times float32 against the device's
                  mixed policy, mixed_bfloat16 on a CPU, mixed_float16 on a
                  GPU, on the first 8 steps and keeps the faster)
  accumulate      accumulate_steps=4 (one update per 4 batches)
  recompute       recompute="auto" (blocks or graph segments: the plan
                  cheapest to recompute within 8% of the activations above
                  the lowest estimated training peak)
  all_on          everything, with the "auto" choices: jit_compile="auto"
                  (Keras: XLA on a GPU, not on a CPU), the policy
                  precision="auto" starts from (mixed_bfloat16 on a CPU
                  with bfloat16 instructions, mixed_float16 on a GPU, else
                  float32: measuring would take 32 of its accumulated
                  steps), accumulate_steps=4, recompute={"budget_mb": half
                  the available memory} (blocks are recomputed only when
                  the estimated training peak would not fit)

With --repeat N, every configuration runs once per round (a fresh process
each time), in a shuffled order per round (seeded), and each figure is the
median over the rounds; the speed-up is the median of the per-round ratios
(baseline and configuration from the same round). A configuration that
failed in some rounds only is shown with a note; it fails (and for the
baseline, the exit status is 1) only when it failed in every round.

Every row trains on the same batches (--batch-size examples per step; under
accumulate_steps a step is one micro-batch). Columns: steady step ms (median
after 2 warm-up steps), speed-up vs baseline, first-step compile s,
examples/s, GFLOP/step (the step's matmuls and convolutions, forward and
backward, counted from its traced graph; ">=" when some could not be
counted, e.g. inside a tf.cond), GFLOP/s (GFLOP/step / step time), % peak
(of this machine's peak for the dtype the step computes in: a 2048x2048
matmul timed once per run, shown above the table), backward share (1 - forward-only time / train-step time, on one
batch after training), peak MiB (TensorFlow allocator peak during fit minus
the level before it), retraces (traces of the train step after the first
batch), final loss (mean over the last quarter of the steps), setup, and
xla: on, off, or off with what blocked it when XLA was asked for (a layer
with supports_jit=False, an op without an XLA kernel); under
jit_compile="measure", the measured XLA vs no-XLA medians. Under
precision="auto" (the precision_auto row) the setup shows the policy
it chose after its measured first steps and both medians, the choice's
first.

exit status: 0 when the baseline configuration ran (other rows may show
FAILED with their reason), 1 when the baseline failed (or, without a baseline,
when every configuration failed), 2 for a bad argument.
"""


def _int_at_least(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid value {text!r}; expected an int >= {minimum}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"invalid value {value}; expected an int >= {minimum}"
            )
        return value

    return parse


def _parser():
    parser = argparse.ArgumentParser(
        prog="keras-gradboost",
        description="Faster, lighter, debuggable Keras training.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser(
        "compare",
        prog="keras-gradboost compare",
        help="train a model under each configuration, one table side by side",
        description=(
            "Train a model under each configuration, each in a fresh "
            "process, and print one side-by-side table."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_argument(
        "--model",
        default=compare_lib.DEFAULT_MODEL,
        metavar="{" + ",".join(compare_lib.BUILTIN_MODELS) + "} or PATH.keras",
        help=f"a built-in model (keras_gradboost.zoo) on synthetic data, or a "
        f"saved Keras model. Default: {compare_lib.DEFAULT_MODEL}",
    )
    compare.add_argument(
        "--data",
        metavar="PATH.npz",
        help="with --model PATH.keras: arrays `x` and `y` to train on, or "
        "for a model with several inputs one array per input named "
        "`x_<input name>` (numpy.savez(path, x_token_ids=..., x_padding_mask=..., "
        "y=...)); default: synthetic data made from the model's input spec",
    )
    compare.add_argument(
        "--batch-size",
        type=_int_at_least(1),
        default=compare_lib.DEFAULT_BATCH_SIZE,
        help=f"examples per step. Default: {compare_lib.DEFAULT_BATCH_SIZE}",
    )
    compare.add_argument(
        "--steps",
        type=_int_at_least(2),
        default=compare_lib.DEFAULT_STEPS,
        help=f"training steps per configuration. Default: {compare_lib.DEFAULT_STEPS}",
    )
    compare.add_argument(
        "--configs",
        default=",".join(compare_lib.CONFIGS),
        help="comma-separated configurations, from: "
        + ", ".join(compare_lib.CONFIGS)
        + ". Default: all",
    )
    compare.add_argument(
        "--repeat",
        type=_int_at_least(1),
        default=1,
        metavar="N",
        help="rounds of all configurations, shuffled per round; the table "
        "shows medians over the rounds. Default: 1",
    )
    compare.add_argument(
        "--json",
        metavar="OUT.json",
        help="write all rows (with their per-round values) and the environment",
    )
    compare.add_argument(
        "--plot",
        metavar="OUT.png",
        help="plot step time and peak memory per configuration "
        "(needs matplotlib: pip install 'keras-gradboost[plot]')",
    )
    launch = sub.add_parser(
        "launch",
        prog="keras-gradboost launch",
        help="run a script in N local workers of one MultiWorkerMirroredStrategy",
        description=(
            "Run SCRIPT in N local worker processes on 127.0.0.1, each with "
            "its own TF_CONFIG (ports picked free at run time), so that "
            "tf.distribute.MultiWorkerMirroredStrategy() in SCRIPT spans them. "
            "Each worker's lines are prefixed [worker i]. When one worker "
            "fails, or at the timeout, the others are stopped."
        ),
        epilog=LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument(
        "--workers",
        type=_int_at_least(1),
        default=2,
        metavar="N",
        help="worker processes. Default: 2",
    )
    launch.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=launcher.DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="stop every worker still running after this long. "
        f"Default: {launcher.DEFAULT_TIMEOUT:g}",
    )
    launch.add_argument("script", help="the Python script each worker runs")
    launch.add_argument(
        "args", nargs=argparse.REMAINDER, help="the script's own arguments"
    )
    return parser


LAUNCH_EPILOG = """exit status: 0 when every worker exited with 0; else the status of a worker
that failed (128 + the signal number for a worker stopped by a signal);
2 for a bad argument.
"""


def _positive_seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; expected a number of seconds > 0"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(
            f"invalid value {text}; expected a number of seconds > 0"
        )
    return value


def launch_status(codes):
    """The exit status of `keras-gradboost launch` for the workers' exit
    codes: 0, a failing worker's own status (preferred to those the
    launcher stopped), or 128 + the signal number."""
    failed = [c for c in codes if c > 0]
    if failed:
        return failed[0]
    stopped = [c for c in codes if c < 0]
    return 128 - stopped[0] if stopped else 0


def launch(args, parser):
    if not os.path.isfile(args.script):
        parser.error(
            f"argument script: invalid value {args.script!r}; expected the "
            "path of an existing Python file"
        )
    codes = launcher.launch(
        args.script, args.args, workers=args.workers, timeout=args.timeout
    )
    return launch_status(codes)


def _check_output_path(parser, option, path):
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(
            f"argument {option}: the folder of {path!r} does not exist; "
            "expected a path in an existing folder"
        )


def check_args(args, parser):
    """Validates `compare` arguments; exits with status 2 on a bad one.

    Returns:
        The configuration names to run.
    """
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in compare_lib.CONFIGS]
    if unknown or not names:
        parser.error(
            f"argument --configs: unknown configuration(s) "
            f"{','.join(unknown) if unknown else repr(args.configs)}; "
            f"expected comma-separated names from: {', '.join(compare_lib.CONFIGS)}"
        )
    names = list(dict.fromkeys(names))
    model = args.model
    is_path = model.endswith(".keras") or os.sep in model or os.path.exists(model)
    if not is_path and model not in compare_lib.BUILTIN_MODELS:
        parser.error(
            f"argument --model: unknown model {model!r}; expected one of "
            f"{', '.join(compare_lib.BUILTIN_MODELS)} or a path to a .keras file"
        )
    if is_path:
        if not os.path.isfile(model):
            parser.error(f"argument --model: no such file: {model!r}")
        problem = _keras_file_problem(model)
        if problem:
            parser.error(
                f"argument --model: {model!r} is not a .keras file ({problem}); "
                "expected one saved with model.save('name.keras')"
            )
    if args.data is not None:
        if not is_path:
            parser.error(
                f"argument --data: only used with --model PATH.keras "
                f"(got --model {model}, which makes its own data)"
            )
        _check_data(parser, args.data)
    if args.json is not None:
        _check_output_path(parser, "--json", args.json)
    if args.plot is not None:
        _check_output_path(parser, "--plot", args.plot)
        if importlib.util.find_spec("matplotlib") is None:
            parser.error(
                "argument --plot: matplotlib is not installed; "
                "pip install 'keras-gradboost[plot]' (or matplotlib)"
            )
    return names


def _keras_file_problem(path):
    """What makes `path` not a loadable `.keras` archive, or None."""
    if not path.endswith(".keras"):
        return "the name does not end in .keras"
    if not zipfile.is_zipfile(path):
        return "not a zip archive"
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except KeyError:
        return "no config.json inside"
    except (ValueError, OSError, zipfile.BadZipFile) as error:
        return f"config.json cannot be read: {error}"
    if not isinstance(config, dict) or "class_name" not in config:
        return "config.json names no model class"
    return None


def _check_data(parser, path):
    import numpy as np

    if not os.path.isfile(path):
        parser.error(f"argument --data: no such file: {path!r}")
    if not zipfile.is_zipfile(path):
        parser.error(
            f"argument --data: {path!r} is not an .npz archive; expected one "
            "written by numpy.savez(path, x=..., y=...)"
        )
    try:
        with np.load(path) as data:
            keys = set(data.files)
            inputs = sorted(k for k in keys if k == "x" or k.startswith("x_"))
            if "y" not in keys or not inputs:
                parser.error(
                    f"argument --data: {path!r} holds {sorted(keys)}; "
                    "expected arrays named 'x' (or one per input, 'x_<input "
                    "name>') and 'y'"
                )
            for key in inputs:
                if len(data[key]) != len(data["y"]) or len(data[key]) == 0:
                    parser.error(
                        f"argument --data: {key} has {len(data[key])} rows and y "
                        f"{len(data['y'])}; expected the same number, at least 1"
                    )
    except (OSError, ValueError) as error:
        parser.error(f"argument --data: cannot read {path!r} as .npz: {error}")


# ------------------------------------------------------------------ output


def _policy(row):
    """The row's policy; under precision="auto", with the measured
    medians, the choice's first (`compare.precision_fields`)."""
    measured = row.get("precision_measurement")
    if not measured or measured.get("float32_ms") is None or measured.get("mixed_ms") is None:
        return row["policy"]
    chosen, other = measured["policy"], "float32"
    ms = (measured["mixed_ms"], measured["float32_ms"])
    if chosen == "float32":
        other, ms = measured["mixed_policy"], ms[::-1]
    return f"{chosen} (measured {ms[0]:.2f} vs {other} {ms[1]:.2f} ms)"


def _setup(row):
    parts = [_policy(row)]
    if row["accumulate_steps"] > 1:
        parts.append(f"accumulate {row['accumulate_steps']}")
    if row["kwargs"].get("recompute") is not None:
        count = row["recomputed"]
        parts.append(f"recompute {count} block{'' if count == 1 else 's'}")
    return ", ".join(parts)


COLUMNS = (
    ("config", "<", 15),
    ("step ms", ">", 9),
    ("speed-up", ">", 9),
    ("compile s", ">", 10),
    ("examples/s", ">", 11),
    ("GFLOP/step", ">", 11),
    ("GFLOP/s", ">", 9),
    ("% peak", ">", 8),
    ("bwd share", ">", 10),
    ("peak MiB", ">", 9),
    ("retraces", ">", 9),
    ("final loss", ">", 11),
    ("  setup", "<", 0),  # as wide as the widest setup
    ("xla", "<", 0),
)


def _xla(row):
    """The row's `xla` cell: on, off, or off with the reason XLA was
    blocked (rows from before the column: from `jit_compile`)."""
    return row.get("xla") or ("on" if row["jit_compile"] else "off")


def _flops_cells(row):
    """The GFLOP/step, GFLOP/s and % peak cells; ">=" marks a lower bound
    (some contraction not counted), "-" what is not known."""
    if row.get("step_flops") is None:
        return "-", "-", "-"
    bound = "" if row.get("step_flops_exact", True) else ">="
    per_s, share = row.get("flop_per_s"), row.get("peak_share")
    return (
        f"{bound}{row['step_flops'] / 1e9:.3g}",
        "-" if per_s is None else f"{bound}{per_s / 1e9:.0f}",
        "-" if share is None else f"{bound}{100 * share:.0f}%",
    )


def format_peaks(peaks):
    """The header line of the measured matmul peaks, or None."""
    if not peaks:
        return None
    size = peaks["size"]
    if "error" in peaks:
        return f"peak ({size}x{size} matmul): FAILED: {peaks['error']}"
    figures = ", ".join(
        f"{dtype} {'-' if v is None else f'{v / 1e9:.0f}'} GFLOP/s"
        for dtype, v in peaks["flop_per_s"].items()
    )
    return f"peak ({size}x{size} matmul, fastest of {flops_lib.PEAK_REPS}): {figures}"


def format_table(rows):
    """The side-by-side table of `compare` rows, as text."""
    base = next((r for r in rows if r["config"] == "baseline" and "error" not in r), None)
    setups = ["  " + _setup(r) for r in rows if "error" not in r]
    setup_width = max([len(s) for s in setups] + [len("  setup")]) + 2
    # As wide as the longest name (precision_auto) plus a space.
    config_width = max([len(r["config"]) + 2 for r in rows] + [COLUMNS[0][2]])
    widths = {"  setup": setup_width, "config": config_width}
    columns = [(name, align, widths.get(name, width)) for name, align, width in COLUMNS]
    header = "".join(f"{name:{align}{width}}" for name, align, width in columns)
    lines = [header.rstrip(), "-" * len(header.rstrip())]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['config']:<{config_width}}FAILED: {r['error']}")
            continue
        if "speed_up" in r:  # median of per-round ratios (`compare.aggregate`)
            speed = "-" if r["speed_up"] is None else f"{r['speed_up']:.2f}x"
        else:
            speed = f"{base['step_ms'] / r['step_ms']:.2f}x" if base else "-"
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        cells = (
            r["config"],
            f"{r['step_ms']:.2f}",
            speed,
            f"{r['compile_s']:.2f}",
            f"{r['examples_per_s']:.0f}",
            *_flops_cells(r),
            f"{100 * r['backward_share']:.0f}%",
            peak,
            str(r["retraces"]),
            f"{r['final_loss']:.4f}",
            "  " + _setup(r),
            _xla(r),
        )
        lines.append(
            "".join(f"{c:{a}{w}}" for c, (_, a, w) in zip(cells, columns)).rstrip()
        )
    return "\n".join(lines)


def format_notes(rows):
    """One line per distinct note, naming its configurations unless it
    holds for every row."""
    by_note = {}
    for r in rows:
        for note in r.get("notes", ()):
            by_note.setdefault(note, []).append(r["config"])
    return [
        f"note: {note}" if len(names) == len(rows) else f"note ({', '.join(names)}): {note}"
        for note, names in by_note.items()
    ]


def _context(args, rows):
    env = next((r["environment"] for r in rows if "environment" in r), None)
    text = f"model {args.model}, batch size {args.batch_size}, {args.steps} steps"
    if args.repeat > 1:
        text += f", medians of {args.repeat} rounds"
    else:
        text += ", 1 round"
    if env:
        device = ", ".join(env["gpus"]) or f"{env['cpu']} ({env['cpu_count']} CPUs)"
        text += f"; TensorFlow {env['tensorflow']}, Keras {env['keras']}, {device}"
    return text, env


def plot(rows, path):
    """Bar charts of steady step time and peak memory per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "error" not in r]
    names = [r["config"] for r in good]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.bar(names, [r["step_ms"] for r in good], color="tab:blue")
    left.set_ylabel("steady step (ms)")
    right.bar(names, [r["peak_mib"] or 0 for r in good], color="tab:orange")
    right.set_ylabel("training peak memory (MiB)")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare(args, parser):
    """Runs `keras-gradboost compare`; returns `(rows, exit status)`."""
    names = check_args(args, parser)
    spec = {
        "model": args.model,
        "data": args.data,
        "batch_size": args.batch_size,
        "steps": args.steps,
    }
    rows, orders = compare_lib.run_rounds(spec, names, args.repeat, progress=sys.stderr)
    peaks = compare_lib.run_peaks(rows, progress=sys.stderr)
    compare_lib.add_throughput(rows, peaks)
    context, env = _context(args, rows)
    print(context)
    if format_peaks(peaks):
        print(format_peaks(peaks))
    print(format_table(rows))
    for note in format_notes(rows):
        print(note)
    if args.json is not None:
        with open(args.json, "w") as f:
            saved = {
                "spec": spec,
                "environment": env,
                "repeat": args.repeat,
                "orders": orders,
                "peaks": peaks,
            }
            json.dump({**saved, "rows": rows}, f, indent=2)
    if args.plot is not None and any("error" not in r for r in rows):
        plot(rows, args.plot)
    baseline = [r for r in rows if r["config"] == "baseline"]
    failed = all("error" in r for r in (baseline or rows))
    return rows, 1 if failed else 0


# The rows of the last `compare` run, for tests and notebooks.
LAST_ROWS = []


def main(argv=None):
    """Entry point of the `keras-gradboost` console script.

    Returns:
        The exit status: 0, or 1 when `compare`'s baseline failed; for
        `launch`, 0 or a failed worker's status (`launch_status`). Bad
        arguments exit with status 2 (`SystemExit`).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    status = 0
    if args.command == "compare":
        rows, status = compare(args, parser)
        LAST_ROWS[:] = rows
    elif args.command == "launch":
        status = launch(args, parser)
    return status


if __name__ == "__main__":
    sys.exit(main())
