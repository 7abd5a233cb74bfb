"""Runs every benchmark, one after another, and writes benchmarks/RESULTS.md.

Each entry runs in its own subprocess, in the order of `ENTRIES`; its
standard output (the ratio tables) is printed as it comes and its standard
error (progress lines) passes through. `RESULTS.md` is then overwritten with
the date, the machine's load average at the start and the end, the Python,
TensorFlow and Keras versions, and each entry's command, duration, exit
status and output in a code block. An entry that fails is recorded with its
last lines of standard error; the others still run. A hand-written last
section (`HAND_WRITTEN`, the figures quoted elsewhere), if the file has one,
is kept at the end.

`--quick` runs each entry with fewer steps and rounds (the scripts' own
`--quick` where they have one), to check the set-up, not to quote figures.

    python benchmarks/run_all.py [--only NAME[,NAME]] [--quick] [--output PATH]

Exit status: 0 when every entry exited 0, 1 otherwise, 2 for a bad argument.
"""

import argparse
import collections
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUTPUT = os.path.join(HERE, "RESULTS.md")

# name: (what it measures, command after `python`, extra arguments under --quick)
ENTRIES = {
    "foundation": (
        "GradBoostModel overhead, accumulation, precision",
        ["benchmarks/bench_foundation.py"],
        ["--quick"],
    ),
    "nan_watcher": (
        "NaNWatcher overhead",
        ["benchmarks/bench_nan_watcher.py"],
        ["--steps", "8", "--rounds", "3"],
    ),
    "callbacks": (
        "StepTimeMonitor + RetraceCounter + GradientAuditor overhead",
        ["benchmarks/bench_callbacks.py"],
        ["--steps", "8", "--rounds", "3"],
    ),
    "recompute": (
        "recompute: training memory and step time",
        ["benchmarks/bench_recompute.py"],
        ["--quick"],
    ),
    "depthwise": (
        'depthwise="native" vs Keras\' grouped convolution (ConvNeXtTiny)',
        ["benchmarks/bench_depthwise.py"],
        ["--rounds", "2", "--memory-rounds", "1", "--pixels", "32", "--batch", "4"],
    ),
    "window_dropout": (
        "accumulation with Dropout: the window's masks vs masks of their own",
        ["benchmarks/bench_window_dropout.py"],
        ["--steps", "2", "--rounds", "2", "--batch", "2"],
    ),
    "ops": (
        "kgb.ops vs naive composites; gradcheck fast vs full",
        ["benchmarks/bench_ops.py"],
        ["--quick"],
    ),
    "all_on": (
        "all features on: XLA/recompute vs the 'auto' choices",
        ["benchmarks/bench_all_on.py"],
        ["--steps", "4", "--rounds", "3"],
    ),
    "multi_worker": (
        "MultiWorkerMirroredStrategy (2 workers) and MirroredStrategy (2 logical "
        "devices): all-reduces, bytes, step time of k=4 vs k=1",
        ["benchmarks/bench_multi_worker.py"],
        ["--quick"],
    ),
    "faults": (
        "2 workers: time to notice a killed worker, time to resume from a backup",
        ["benchmarks/bench_faults.py"],
        ["--rounds", "1"],
    ),
    "compare": (
        "keras-gradboost compare, default run",
        ["-m", "keras_gradboost", "compare", "--repeat", "3"],
        ["--steps", "6", "--repeat", "1"],
    ),
}
STDERR_TAIL = 5
# The heading of the hand-written last section of RESULTS.md, kept on rewrite.
HAND_WRITTEN = "## Figures quoted elsewhere"


def command(name, quick):
    """The argument list (after the Python executable) of an entry."""
    _, args, quick_args = ENTRIES[name]
    return args + (quick_args if quick else [])


def shown(args):
    """A command as a reader would type it from the repository root."""
    if args[:2] == ["-m", "keras_gradboost"]:
        return " ".join(["keras-gradboost", *args[2:]])
    return " ".join(["python", *args])


def run(args):
    """Runs `python ARGS` from the repository root, echoing its output to
    this process's standard output and error as it comes.

    Returns:
        `(exit status, standard output, last lines of standard error)`.
    """
    process = subprocess.Popen(
        [sys.executable, *args],
        cwd=os.path.dirname(HERE),
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tail = collections.deque(maxlen=STDERR_TAIL)

    def pass_stderr():
        for line in process.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.strip():
                tail.append(line.rstrip())

    reader = threading.Thread(target=pass_stderr, daemon=True)
    reader.start()
    lines = []
    for line in process.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    status = process.wait()
    reader.join()
    return status, "".join(lines), list(tail)


def machine():
    """Versions, CPU and load average, read without importing TensorFlow."""

    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "tensorflow": version("tensorflow"),
        "keras": version("keras"),
        "cpu": f"{cpu} ({os.cpu_count()} CPUs)",
    }


def _load():
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unavailable"


def markdown(info, results):
    """The text of RESULTS.md.

    Args:
        info: dict with `started`, `finished` (UTC datetimes), `load_start`,
            `load_end`, `invocation` and the keys of `machine()`.
        results: list of dicts with `name`, `command`, `seconds`, `status`,
            `stdout` and `stderr_tail`.
    """
    stamp = "%Y-%m-%d %H:%M UTC"
    lines = [
        "# Benchmark results",
        "",
        f"Written by `{info['invocation']}`, started {info['started']:{stamp}}, "
        f"finished {info['finished']:{stamp}}.",
        "",
        f"- TensorFlow {info['tensorflow']}, Keras {info['keras']}, Python {info['python']}",
        f"- CPU: {info['cpu']}",
        f"- load average (1, 5, 15 min): {info['load_start']} at the start, "
        f"{info['load_end']} at the end",
        "",
    ]
    for r in results:
        outcome = "ok" if r["status"] == 0 else f"FAILED, exit status {r['status']}"
        lines += [
            f"## {r['name']}: {ENTRIES[r['name']][0]}",
            "",
            f"`{r['command']}` ({r['seconds']:.0f} s, {outcome})",
            "",
            "```text",
            r["stdout"].rstrip("\n") or "(no output)",
            "```",
            "",
        ]
        if r["status"] != 0 and r["stderr_tail"]:
            lines += ["Last lines of standard error:", "", "```text", *r["stderr_tail"], "```", ""]
    return "\n".join(lines)


def hand_written(path):
    """The hand-written last section of the markdown file at `path`, from its
    `HAND_WRITTEN` heading to the end; "" when there is none."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    at = text.find("\n" + HAND_WRITTEN + "\n")
    return text[at + 1:] if at >= 0 else ""


def _parser():
    parser = argparse.ArgumentParser(
        prog="run_all.py",
        description=__doc__.splitlines()[0],
        epilog="entries: " + ", ".join(ENTRIES),
    )
    parser.add_argument(
        "--only",
        metavar="NAME[,NAME]",
        help="comma-separated entries to run, from: " + ", ".join(ENTRIES) + ". Default: all",
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds per entry")
    parser.add_argument(
        "--output",
        default=DEFAULT_OUTPUT,
        help="the markdown file to write (overwritten). Default: benchmarks/RESULTS.md",
    )
    return parser


def selected(parser, only):
    """The entries to run, in `ENTRIES` order; exits with status 2 on an
    unknown name."""
    if only is None:
        return list(ENTRIES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENTRIES]
    if unknown or not names:
        parser.error(
            f"argument --only: unknown benchmark(s) "
            f"{','.join(unknown) if unknown else repr(only)}; "
            f"expected comma-separated names from: {', '.join(ENTRIES)}"
        )
    return [n for n in ENTRIES if n in names]


def main(argv=None):
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    names = selected(parser, args.only)
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        parser.error(f"argument --output: the folder of {args.output!r} does not exist")
    info = {
        **machine(),
        "invocation": " ".join(["python benchmarks/run_all.py", *argv]),
        "started": datetime.datetime.now(datetime.timezone.utc),
        "load_start": _load(),
    }
    results = []
    for i, name in enumerate(names, 1):
        text = shown(command(name, args.quick))
        print(f"\n=== [{i}/{len(names)}] {name}: {text}", flush=True)
        start = time.perf_counter()
        status, stdout, tail = run(command(name, args.quick))
        seconds = time.perf_counter() - start
        outcome = "ok" if status == 0 else f"FAILED (exit status {status})"
        print(f"=== {name}: {outcome} in {seconds:.0f} s", flush=True)
        results.append(
            {"name": name, "command": text, "seconds": seconds, "status": status,
             "stdout": stdout, "stderr_tail": tail}
        )
    info.update(finished=datetime.datetime.now(datetime.timezone.utc), load_end=_load())
    kept = hand_written(args.output)
    with open(args.output, "w") as f:
        f.write(markdown(info, results))
        if kept:
            f.write("\n" + kept)
    print(f"\nwrote {args.output}")
    return 0 if all(r["status"] == 0 for r in results) else 1

if __name__ == "__main__":
    sys.exit(main())
