"""`benchmarks/run_all.py`: its entries and argument handling, with the
benchmark subprocesses stubbed out (no benchmark runs here); and
`benchmarks/requested_peak.py`, the memory measure `bench_recompute.py`
reports beside the allocator's peak."""

import glob
import os

import pytest

from conftest import BENCHMARKS
from conftest import load_benchmark


@pytest.fixture
def run_all():
    return load_benchmark("run_all")


def test_every_benchmark_script_has_an_entry(run_all):
    scripts = {
        os.path.join("benchmarks", os.path.basename(path))
        for path in glob.glob(os.path.join(BENCHMARKS, "bench_*.py"))
    }
    listed = {args[0] for _, args, _ in run_all.ENTRIES.values() if args[0].endswith(".py")}
    assert listed == scripts
    assert run_all.command("compare", quick=False) == [
        "-m", "keras_gradboost", "compare", "--repeat", "3"
    ]
    assert run_all.shown(run_all.command("compare", quick=True)) == (
        "keras-gradboost compare --repeat 3 --steps 6 --repeat 1"
    )
    assert run_all.shown(run_all.command("foundation", quick=True)) == (
        "python benchmarks/bench_foundation.py --quick"
    )


@pytest.mark.parametrize("only", ["nope", "foundation,nope", ","])
def test_an_unknown_only_name_exits_2_listing_the_names(run_all, capsys, monkeypatch, only):
    monkeypatch.setattr(run_all, "run", lambda *a: pytest.fail("must not run a benchmark"))
    with pytest.raises(SystemExit) as info:
        run_all.main(["--only", only])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --only: unknown benchmark(s)" in last
    assert "expected comma-separated names from: " + ", ".join(run_all.ENTRIES) in last


def test_only_runs_the_named_entries_in_order_and_writes_the_markdown(
    run_all, tmp_path, monkeypatch, capsys
):
    ran = []

    def fake_run(args):
        ran.append(run_all.shown(args))
        if "compare" in args:
            return 1, "half a table\n", ["Traceback", "ValueError: boom"]
        return 0, "ratio 1.00x\n", []

    monkeypatch.setattr(run_all, "run", fake_run)
    output = tmp_path / "RESULTS.md"
    status = run_all.main(["--only", "compare,all_on", "--quick", "--output", str(output)])
    assert status == 1  # compare failed
    assert ran == [
        "python benchmarks/bench_all_on.py --steps 4 --rounds 3",
        "keras-gradboost compare --repeat 3 --steps 6 --repeat 1",
    ]
    text = output.read_text()
    assert text.startswith("# Benchmark results\n")
    assert "`python benchmarks/run_all.py --only compare,all_on --quick --output" in text
    assert "load average (1, 5, 15 min): " in text and "TensorFlow " in text
    assert "```text\nratio 1.00x\n```" in text
    assert "(0 s, ok)" in text and "FAILED, exit status 1" in text
    assert "```text\nTraceback\nValueError: boom\n```" in text
    assert text.index("## all_on") < text.index("## compare")
    assert "=== compare: FAILED (exit status 1)" in capsys.readouterr().out


def test_run_returns_status_output_and_stderr_tail(run_all, tmp_path, capsys):
    script = tmp_path / "noisy.py"
    script.write_text(
        "import sys\nprint('table')\n"
        "for i in range(8): print(f'log {i}', file=sys.stderr)\nsys.exit(3)\n"
    )
    status, out, tail = run_all.run([str(script)])
    assert (status, out) == (3, "table\n")
    assert tail == [f"log {i}" for i in range(3, 8)]
    assert "log 0" in capsys.readouterr().err  # passed through as it came


def test_the_hand_written_section_is_kept_on_rewrite(run_all, tmp_path, monkeypatch):
    monkeypatch.setattr(run_all, "run", lambda args: (0, "ratio 1.00x\n", []))
    output = tmp_path / "RESULTS.md"
    section = f"{run_all.HAND_WRITTEN}\n\nHand-written: 1.04x.\n"
    output.write_text(f"# Benchmark results\n\nold run\n\n{section}")
    assert run_all.main(["--only", "compare", "--output", str(output)]) == 0
    text = output.read_text()
    assert "old run" not in text and "```text\nratio 1.00x\n```" in text
    assert text.endswith("\n" + section) and text.count(run_all.HAND_WRITTEN) == 1
    # The repository's own file has the section.
    assert run_all.hand_written(run_all.DEFAULT_OUTPUT).startswith(run_all.HAND_WRITTEN)


def test_the_requested_peak_counts_frees_of_buffers_from_before_the_run(requested_peak):
    # (time, allocation?, address, bytes): a 10-byte buffer from before the
    # run is freed first (a copy-on-write update), then 8 and 6 are
    # allocated, 8 is freed (its event without a size: its own is used),
    # 7 is allocated.
    events = [
        (0, False, "old", 10), (1, True, "a", 8), (2, True, "b", 6),
        (3, False, "a", None), (4, True, "c", 7),
    ]
    assert requested_peak._peak(events) == 4  # -10 + 8 + 6
    assert requested_peak._peak([(0, True, "a", 8), (1, False, "a", 8), (2, True, "b", 3)]) == 8


def test_what_is_alive_at_the_requested_peak(requested_peak):
    # The events above, with their ops: at the peak (4 bytes above the
    # start), a's 8 and b's 6 are alive; the old buffer's free counted.
    events = [
        (0, False, {"addr": "old", "requested_bytes": 10}),
        (1, True, {"addr": "a", "requested_bytes": 8, "tf_op": "step/a"}),
        (2, True, {"addr": "b", "requested_bytes": 6, "tf_op": "step/b"}),
        (3, False, {"addr": "a"}),
        (4, True, {"addr": "c", "requested_bytes": 7}),
    ]
    assert requested_peak._alive_at_peak(events) == (4, [(8, "step/a"), (6, "step/b")])


def test_the_requested_peak_refuses_what_it_cannot_count(requested_peak):
    with pytest.raises(RuntimeError, match="no memory events"):
        requested_peak._peak([])
    with pytest.raises(RuntimeError, match="no requested_bytes"):
        requested_peak._peak([(0, False, "from before", None)])


def test_the_requested_peak_of_a_real_run_counts_what_it_frees(requested_peak):
    import tensorflow as tf

    @tf.function
    def run(total):
        for _ in range(6):  # a 4 MiB sine each, freed as the sum moves on
            total = total + tf.sin(total)
        return tf.reduce_sum(total)

    start = tf.zeros([1024, 1024])
    float(run(start))  # traced outside the profiled run
    peak = requested_peak.requested_peak(lambda: float(run(start)))
    # Two 4 MiB buffers at least (the sum and a sine); far from the 24 MiB
    # of all its allocations, which a replay without the frees would give.
    assert 8 * 2**20 <= peak <= 16 * 2**20
