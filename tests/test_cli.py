"""`keras-gradboost compare`: end to end on tiny configurations, and its
argument checks (which run before any TensorFlow subprocess starts)."""

import json
import math
import re
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

import keras
from keras_gradboost import cli
from keras_gradboost import compare as compare_lib
from keras_gradboost import precision


def _run(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err, list(cli.LAST_ROWS)


def _row_line(out, name):
    return next(line for line in out.splitlines() if line.startswith(name + " "))


def test_compare_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(compare_lib, "PEAK_SIZE", 128)  # the peak: fast, not timed
    out_json = tmp_path / "rows.json"
    code, out, err, rows = _run(
        [
            "compare", "--model", "mlp", "--steps", "3", "--batch-size", "16",
            "--configs", "baseline,all_on", "--json", str(out_json),
        ],
        capsys,
    )
    assert code == 0, out + err
    assert "[1/2] baseline" in err and "[2/2] all_on" in err
    # all_on's precision (the static rule's) is mixed_bfloat16 only on a CPU
    # with bfloat16 instructions; the peak is measured for the dtypes the rows use.
    bf16 = precision.cpu_has_native_bfloat16()
    dtypes = "float32, bfloat16" if bf16 else "float32"
    assert f"peak: 128x128 matmul in {dtypes} ... " in err
    peaks_line = out.splitlines()[1]
    assert re.fullmatch(
        r"peak \(128x128 matmul, fastest of 5\): float32 \d+ GFLOP/s"
        + (r", bfloat16 \d+ GFLOP/s" if bf16 else ""),
        peaks_line,
    ), peaks_line
    header = out.splitlines()[2]
    for column in ("step ms", "speed-up", "compile s", "examples/s", "GFLOP/step",
                   "GFLOP/s", "% peak", "bwd share", "peak MiB", "retraces",
                   "final loss", "setup", "xla"):
        assert column in header
    # The MLP at batch 16: forward, and backward but for the data's gradient.
    forward = 2 * 16 * (784 * 1024 + 1024 * 1024 + 1024 * 10)
    step_flops = 3 * forward - 2 * 16 * 784 * 1024
    assert f"{step_flops / 1e9:.3g}" in _row_line(out, "baseline").split()
    assert _row_line(out, "baseline").endswith("  off")
    assert "1.00x" in _row_line(out, "baseline")
    assert "accumulate 4" in _row_line(out, "all_on")
    assert "recompute 0 blocks" in _row_line(out, "all_on")  # fits the budget

    saved = json.loads(out_json.read_text())
    assert saved["environment"]["tensorflow"] and saved["environment"]["keras"]
    assert saved["spec"] == {"model": "mlp", "data": None, "batch_size": 16, "steps": 3}
    assert saved["peaks"]["size"] == 128
    assert set(saved["peaks"]["flop_per_s"]) == ({"float32", "bfloat16"} if bf16 else {"float32"})
    assert all(v > 0 for v in saved["peaks"]["flop_per_s"].values())
    by_name = {r["config"]: r for r in saved["rows"]}
    assert list(by_name) == ["baseline", "all_on"]
    for row in by_name.values():
        assert "error" not in row, row
        for field in ("step_ms", "compile_s", "examples_per_s", "backward_share",
                      "peak_mib", "retraces", "final_loss"):
            assert field in row
        assert row["retraces"] == 0  # fixed shapes: one trace (or the init pair)
        assert 0.0 <= row["backward_share"] < 1.0
        assert math.isfinite(row["final_loss"])
        assert row["peak_mib"] is None or row["peak_mib"] > 0
        assert row["step_flops"] == step_flops and row["step_flops_exact"] is True
        assert row["flop_per_s"] == pytest.approx(step_flops / (row["step_ms"] / 1000))
        assert row["peak_share"] > 0
    baseline, all_on = by_name["baseline"], by_name["all_on"]
    assert baseline["step_flops_by_dtype"] == {"float32": step_flops}
    # mixed_bfloat16 (a CPU with bfloat16 instructions) but the float32 head.
    head = 3 * 2 * 16 * 1024 * 10
    if all_on["policy"] == "mixed_bfloat16":
        assert all_on["step_flops_by_dtype"] == {"bfloat16": step_flops - head, "float32": head}
    assert (baseline["jit_compile"], baseline["accumulate_steps"]) == (False, 1)
    assert (baseline["xla"], baseline["jit_measurement"]) == ("off", None)
    assert all_on["accumulate_steps"] == 4
    assert all_on["recomputed"] == 0
    assert isinstance(all_on["compiled_with"]["recompute"]["budget_mb"], (int, float))
    # all_on compiles with the policy precision="auto" starts from (on a
    # CPU, Keras' jit_compile="auto" is no XLA), not with "auto", which
    # would measure through all its steps.
    assert all_on["compiled_with"]["precision"] == precision.static_pick(False)
    assert all_on["policy"] == precision.static_pick(False)
    assert rows == saved["rows"]


def _tiny_saved_model(path, compiled):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(3, name="out")(inputs)
    model = keras.Model(inputs, outputs)
    if compiled:
        model.compile(optimizer="sgd", loss="mean_absolute_error")
    model.save(path)
    return path


def test_saved_model_with_data(tmp_path, capsys, no_matmul_peak):
    model_path = _tiny_saved_model(str(tmp_path / "tiny.keras"), compiled=True)
    data_path = tmp_path / "data.npz"
    rng = np.random.default_rng(0)
    np.savez(data_path, x=rng.normal(size=(40, 5)), y=rng.normal(size=(40, 3)))
    code, out, err, rows = _run(
        ["compare", "--model", model_path, "--data", str(data_path),
         "--steps", "3", "--batch-size", "8", "--configs", "baseline"],
        capsys,
    )
    assert code == 0, out + err
    (row,) = rows
    assert "error" not in row, row
    assert row["notes"] == []  # the saved loss and optimizer, the given data
    assert math.isfinite(row["final_loss"])


def test_rows_of_a_saved_model_with_dropout_start_from_the_same_seeds(tmp_path, monkeypatch):
    # Keras draws a loaded model's Dropout seeds anew in each process: two
    # baseline rows ended at different losses, and a recompute row (exact)
    # looked like it changed training. A row forked from the row server
    # against one in an interpreter of its own (children forked from one
    # server share their Python random state); the model's path relative
    # to the parent's working directory, which the server's child takes.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dropout(0.5)(keras.layers.Dense(16)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    model.compile(optimizer="sgd", loss="mean_squared_error")
    model.save(str(tmp_path / "dropout.keras"))
    spec = {"config": "baseline", "kwargs": {}, "model": str(tmp_path / "dropout.keras"),
            "batch_size": 8, "steps": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the server ran them (else it warns)
        absolute = compare_lib.run_one(spec)  # (the server started elsewhere)
        monkeypatch.chdir(tmp_path)
        forked = compare_lib.run_one({**spec, "model": "dropout.keras"})
    monkeypatch.setattr(compare_lib._ROW_SERVER, "run", lambda *args: None)
    fresh = compare_lib.run_one(spec)
    assert "error" not in forked, forked
    assert absolute["final_loss"] == forked["final_loss"] == fresh["final_loss"]


def test_saved_model_without_loss_or_data_and_a_failed_row(tmp_path, capsys, no_matmul_peak):
    model_path = _tiny_saved_model(str(tmp_path / "plain.keras"), compiled=False)
    code, out, err, rows = _run(
        ["compare", "--model", model_path, "--steps", "2", "--batch-size", "4",
         "--configs", "baseline,recompute"],
        capsys,
    )
    # A one-layer model has nothing to recompute: that row fails, the
    # baseline does not, so the exit status is 0.
    assert code == 0, out + err
    baseline, recompute = rows
    assert "error" not in baseline, baseline
    assert "no saved loss: using 'mse'" in baseline["notes"]
    assert "synthetic data from the input spec" in baseline["notes"]
    assert "optimizer: Adam(1e-3)" in baseline["notes"]
    assert "note (baseline): no saved loss: using 'mse'" in out
    assert "found nothing to recompute" in recompute["error"]
    assert "\n" not in recompute["error"]
    assert _row_line(out, "recompute").startswith("recompute      FAILED: ValueError")
    assert "recompute ... FAILED" in err


def _fake_rows(failed):
    def run_one(spec):
        if spec["config"] in failed:
            return {"config": spec["config"], "kwargs": spec["kwargs"], "error": "Boom: no"}
        return {
            "config": spec["config"], "kwargs": spec["kwargs"],
            "step_ms": 10.0 if spec["config"] == "baseline" else 8.0,
            "compile_s": 1.0, "examples_per_s": 100.0, "backward_share": 0.6,
            "peak_mib": 5.0, "retraces": 0, "final_loss": 1.0, "jit_compile": False,
            "policy": "float32", "accumulate_steps": 1, "recomputed": 0, "notes": [],
        }

    return run_one


@pytest.mark.parametrize(
    "configs, failed, status",
    [
        ("baseline,jit_compile", {"jit_compile"}, 0),
        ("baseline,jit_compile", set(), 0),
        ("baseline,jit_compile", {"baseline"}, 1),
        ("jit_compile,recompute", {"jit_compile"}, 0),
        ("jit_compile,recompute", {"jit_compile", "recompute"}, 1),
    ],
)
def test_exit_status_depends_on_the_baseline(monkeypatch, capsys, configs, failed, status):
    monkeypatch.setattr(compare_lib, "run_one", _fake_rows(failed))
    code, out, _, _ = _run(["compare", "--configs", configs], capsys)
    assert code == status
    for name in failed:
        assert _row_line(out, name) == f"{name:<15}FAILED: Boom: no"
    if "baseline" in configs and not failed & {"baseline", "jit_compile"}:
        assert "1.25x" in _row_line(out, "jit_compile")  # 10 ms / 8 ms


def test_compare_repeat_end_to_end(tmp_path, capsys, no_matmul_peak):
    out_json = tmp_path / "rows.json"
    code, out, err, rows = _run(
        [
            "compare", "--model", "mlp", "--steps", "2", "--batch-size", "8",
            "--configs", "baseline", "--repeat", "2", "--json", str(out_json),
        ],
        capsys,
    )
    assert code == 0, out + err
    assert "medians of 2 rounds" in out.splitlines()[0]
    # One configuration, two real rounds (the order of several in a round:
    # test_repeat_runs_every_configuration_once_per_round).
    assert err.count("round 1/2 [") == 1 and err.count("round 2/2 [") == 1
    saved = json.loads(out_json.read_text())
    assert saved["repeat"] == 2
    assert saved["orders"] == [["baseline"]] * 2
    assert [r["config"] for r in saved["rows"]] == ["baseline"]
    for row in saved["rows"]:
        assert "error" not in row, row
        assert len(row["per_round"]) == 2
        steps = [figures["step_ms"] for figures in row["per_round"]]
        assert row["step_ms"] == pytest.approx(sum(steps) / 2)  # median of two
        ratios = [figures["speed_up"] for figures in row["per_round"]]
        assert row["speed_up"] == pytest.approx(sum(ratios) / 2)
    assert saved["rows"][0]["speed_up"] == 1.0
    assert saved["peaks"] is None
    for row in saved["rows"]:  # the FLOPs of the first round; no peak
        assert row["flop_per_s"] == pytest.approx(row["step_flops"] / (row["step_ms"] / 1000))
        assert row["peak_share"] is None
    assert rows == saved["rows"]


def _timed_row(name, step_ms, **extra):
    return {
        "config": name, "kwargs": compare_lib.CONFIGS[name], "step_ms": step_ms,
        "compile_s": 1.0, "examples_per_s": 256 / step_ms, "backward_share": 0.5,
        "forward_ms": 1.0, "full_step_ms": 2.0, "peak_mib": 5.0, "retraces": 0,
        "final_loss": 1.0, "notes": ["shared"], **extra,
    }


def test_aggregate_takes_medians_and_the_median_of_per_round_speed_ups():
    rounds = [
        {"baseline": _timed_row("baseline", 10.0), "accumulate": _timed_row("accumulate", 5.0, compile_s=3.0)},
        {"baseline": _timed_row("baseline", 30.0), "accumulate": _timed_row("accumulate", 10.0, retraces=2)},
        {"baseline": _timed_row("baseline", 12.0), "accumulate": _timed_row("accumulate", 12.0, peak_mib=None)},
    ]
    baseline, accumulate = compare_lib.aggregate(rounds, ["baseline", "accumulate"])
    assert baseline["step_ms"] == 12.0 and baseline["speed_up"] == 1.0
    assert accumulate["step_ms"] == 10.0
    # Per-round ratios 2, 3 and 1: median 2, not 12 ms / 10 ms.
    assert accumulate["speed_up"] == 2.0
    assert [f["speed_up"] for f in accumulate["per_round"]] == [2.0, 3.0, 1.0]
    assert accumulate["compile_s"] == 1.0
    assert accumulate["examples_per_s"] == pytest.approx(25.6)
    assert accumulate["peak_mib"] == 5.0  # the rounds that measured it
    assert accumulate["retraces"] == 2  # any retrace shows
    assert accumulate["notes"] == ["shared"]
    assert accumulate["per_round"][0]["step_ms"] == 5.0


def test_aggregate_with_failed_rounds_and_without_a_baseline():
    failed = {"config": "accumulate", "kwargs": {}, "error": "Boom: no"}
    rounds = [
        {"baseline": _timed_row("baseline", 10.0), "accumulate": failed},
        {"baseline": {**failed, "config": "baseline"}, "accumulate": _timed_row("accumulate", 4.0)},
        {"baseline": _timed_row("baseline", 9.0), "accumulate": _timed_row("accumulate", 3.0)},
    ]
    baseline, accumulate = compare_lib.aggregate(rounds, ["baseline", "accumulate"])
    assert "error" not in baseline and baseline["step_ms"] == 9.5
    assert baseline["notes"] == ["shared", "failed in 1 of 3 rounds: Boom: no"]
    # Round 2 has no baseline to compare with: only round 3 counts.
    assert accumulate["speed_up"] == 3.0
    assert accumulate["step_ms"] == 3.5
    assert accumulate["per_round"][0] == {"error": "Boom: no"}
    assert accumulate["per_round"][1]["speed_up"] is None

    (always,) = compare_lib.aggregate([{"recompute": failed}] * 2, ["recompute"])
    assert always["error"] == "Boom: no" and "step_ms" not in always
    (alone,) = compare_lib.aggregate([{"accumulate": _timed_row("accumulate", 4.0)}], ["accumulate"])
    assert alone["speed_up"] is None


def test_round_orders_are_shuffled_per_round_and_seeded():
    names = list(compare_lib.CONFIGS)
    assert compare_lib.round_orders(names, 1) == [names]
    orders = compare_lib.round_orders(names, 4)
    assert len(orders) == 4 and all(sorted(o) == sorted(names) for o in orders)
    assert len({tuple(o) for o in orders}) > 1
    assert compare_lib.round_orders(names, 4) == orders
    assert compare_lib.round_orders(names, 4, seed=1) != orders


def test_repeat_runs_every_configuration_once_per_round(monkeypatch, capsys, tmp_path):
    calls = []
    step_ms = {"baseline": [10.0, 30.0, 12.0], "accumulate": [5.0, 10.0, 12.0]}

    def run_one(spec):
        calls.append(spec["config"])
        r = sum(c == spec["config"] for c in calls) - 1
        return _timed_row(spec["config"], step_ms[spec["config"]][r], jit_compile=False,
                          policy="float32", accumulate_steps=1, recomputed=0)

    monkeypatch.setattr(compare_lib, "run_one", run_one)
    out_json = tmp_path / "rows.json"
    code, out, _, rows = _run(
        ["compare", "--configs", "baseline,accumulate", "--repeat", "3", "--json", str(out_json)],
        capsys,
    )
    assert code == 0
    saved = json.loads(out_json.read_text())
    assert calls == [name for order in saved["orders"] for name in order]
    assert "medians of 3 rounds" in out.splitlines()[0]
    assert "2.00x" in _row_line(out, "accumulate")
    assert [r["speed_up"] for r in rows] == [1.0, 2.0]


@pytest.mark.parametrize("baseline_failures, status", [(1, 0), (2, 1)])
def test_repeat_fails_the_baseline_only_when_every_round_failed(
    monkeypatch, capsys, baseline_failures, status
):
    calls = []

    def run_one(spec):
        calls.append(spec["config"])
        if calls.count("baseline") <= baseline_failures and spec["config"] == "baseline":
            return {"config": "baseline", "kwargs": spec["kwargs"], "error": "Boom: no"}
        return _fake_rows(set())(spec)

    monkeypatch.setattr(compare_lib, "run_one", run_one)
    code, out, _, _ = _run(["compare", "--configs", "baseline,accumulate", "--repeat", "2"], capsys)
    assert code == status
    if status == 0:
        assert "note (baseline): failed in 1 of 2 rounds: Boom: no" in out
    else:
        assert _row_line(out, "baseline") == f"{'baseline':<15}FAILED: Boom: no"


def test_a_child_that_dies_without_a_row_fails_with_its_last_stderr_line(tmp_path, monkeypatch):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'some log' >&2\necho 'Fatal Python error: Aborted' >&2\nexit 134\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    row = compare_lib.run_one({"config": "baseline", "kwargs": {}, "model": "mlp"})
    assert row == {
        "config": "baseline",
        "kwargs": {},
        "error": "exit code 134: Fatal Python error: Aborted",
    }


def test_flops_cells_mark_a_lower_bound_and_what_is_not_known():
    row = {"step_flops": 2.5e9, "step_flops_exact": False, "flop_per_s": 5e11, "peak_share": 0.5}
    assert cli._flops_cells(row) == (">=2.5", ">=500", ">=50%")
    assert cli._flops_cells({**row, "step_flops_exact": True, "peak_share": None}) == ("2.5", "500", "-")
    assert cli._flops_cells({"step_flops": None}) == ("-", "-", "-")
    assert cli._flops_cells({}) == ("-", "-", "-")  # rows from before the columns
    peaks = {"size": 2048, "flop_per_s": {"float32": 5.1e11, "bfloat16": None}}
    assert cli.format_peaks(peaks) == (
        "peak (2048x2048 matmul, fastest of 5): float32 510 GFLOP/s, bfloat16 - GFLOP/s"
    )
    assert cli.format_peaks(None) is None
    assert compare_lib.peak_dtypes([{"step_flops_by_dtype": {"bfloat16": 1.0}}, {"error": "x"}]) == [
        "float32", "bfloat16"
    ]
    assert compare_lib.peak_dtypes([{"config": "baseline"}]) == []
    rows = [
        {"config": "baseline", "step_ms": 10.0, "step_flops": 2e9, "step_flops_by_dtype": {"float32": 2e9}},
        {"config": "accumulate", "step_ms": 2.0, "step_flops": 2e9, "step_flops_by_dtype": {"float32": 2e9}},
        {"config": "recompute", "error": "Boom: no"},
    ]
    compare_lib.add_throughput(rows, {"size": 2048, "flop_per_s": {"float32": 5e11}})
    assert rows[0]["flop_per_s"] == pytest.approx(2e11) and rows[0]["peak_share"] == pytest.approx(0.4)
    assert "notes" not in rows[0]
    assert rows[1]["peak_share"] == pytest.approx(2.0)
    assert rows[1]["notes"] == [compare_lib.ABOVE_PEAK]
    assert "flop_per_s" not in rows[2]


def test_notes_name_their_configurations_unless_shared():
    rows = [
        {"config": "baseline", "notes": ["synthetic data", "only here"]},
        {"config": "recompute", "notes": ["synthetic data"]},
    ]
    assert cli.format_notes(rows) == [
        "note: synthetic data",
        "note (baseline): only here",
    ]


@pytest.fixture
def no_subprocess(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a bad argument must not start a configuration")

    monkeypatch.setattr(compare_lib, "run_one", refuse)


def _bad_argument_cases(tmp):
    not_zip = tmp / "broken.keras"
    not_zip.write_text("not a zip")
    saved = tmp / "ok.keras"
    saved.write_bytes(b"")
    import zipfile

    with zipfile.ZipFile(saved, "w") as archive:
        archive.writestr("config.json", '{"class_name": "Functional", "config": {}}')
    empty = tmp / "empty.keras"
    zipfile.ZipFile(empty, "w").close()
    corrupt = tmp / "corrupt.keras"
    with zipfile.ZipFile(corrupt, "w") as archive:
        archive.writestr("config.json", "{not json")
    classless = tmp / "classless.keras"
    with zipfile.ZipFile(classless, "w") as archive:
        archive.writestr("config.json", "{}")
    text_data = tmp / "text.npz"
    text_data.write_text("x,y\n1,2\n")
    npy_data = tmp / "array.npz"
    with open(npy_data, "wb") as f:
        np.save(f, np.zeros(3))
    no_y = tmp / "no_y.npz"
    np.savez(no_y, x=np.zeros((4, 5)))
    uneven = tmp / "uneven.npz"
    np.savez(uneven, x=np.zeros((4, 5)), y=np.zeros(3))
    return [
        (["compare", "--configs", "nope"], "argument --configs: unknown configuration(s) nope"),
        (["compare", "--configs", "baseline,xla"], "unknown configuration(s) xla; expected"),
        (["compare", "--configs", ","], "argument --configs: unknown configuration(s) ','"),
        (["compare", "--steps", "0"], "argument --steps: invalid value 0; expected an int >= 2"),
        (["compare", "--steps", "x"], "argument --steps: invalid value 'x'; expected an int >= 2"),
        (["compare", "--batch-size", "-1"], "argument --batch-size: invalid value -1; expected an int >= 1"),
        (["compare", "--repeat", "0"], "argument --repeat: invalid value 0; expected an int >= 1"),
        (["compare", "--repeat", "2.5"], "argument --repeat: invalid value '2.5'; expected an int >= 1"),
        (["compare", "--model", "resnet"], "argument --model: unknown model 'resnet'; expected one of mlp"),
        (["compare", "--model", str(tmp / "missing.keras")], "argument --model: no such file"),
        (["compare", "--model", str(not_zip)], "is not a .keras file (not a zip archive)"),
        (["compare", "--model", str(empty)], "is not a .keras file (no config.json inside)"),
        (["compare", "--model", str(corrupt)], "is not a .keras file (config.json cannot be read"),
        (["compare", "--model", str(classless)], "(config.json names no model class)"),
        (["compare", "--model", str(saved), "--data", str(text_data)], "argument --data: '"),
        (["compare", "--model", str(saved), "--data", str(text_data)], "is not an .npz archive"),
        (["compare", "--model", str(saved), "--data", str(npy_data)], "is not an .npz archive"),
        (["compare", "--data", str(no_y)], "argument --data: only used with --model PATH.keras"),
        (["compare", "--model", str(saved), "--data", str(tmp / "none.npz")], "argument --data: no such file"),
        (["compare", "--model", str(saved), "--data", str(no_y)], "holds ['x']; expected arrays named 'x' (or one per input, 'x_<input name>') and 'y'"),
        (["compare", "--model", str(saved), "--data", str(uneven)], "x has 4 rows and y 3"),
        (["compare", "--json", str(tmp / "no" / "out.json")], "argument --json: the folder of"),
        (["compare", "--plot", str(tmp / "no" / "out.png")], "argument --plot: the folder of"),
        (["frobnicate"], "invalid choice"),
    ]


def test_bad_arguments_exit_2_with_one_line_error(tmp_path, capsys, no_subprocess):
    for argv, fragment in _bad_argument_cases(tmp_path):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2, argv
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert last.startswith("keras-gradboost"), (argv, err)
        assert fragment in last, (argv, last)


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, no_subprocess, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    with pytest.raises(SystemExit) as info:
        cli.main(["compare", "--plot", str(tmp_path / "out.png")])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --plot: matplotlib is not installed; pip install 'keras-gradboost[plot]'" in last


def test_plot_writes_a_png(tmp_path, monkeypatch, capsys):
    import matplotlib  # noqa: F401 - in the test extra: a missing one fails
    monkeypatch.setattr(compare_lib, "run_one", _fake_rows({"recompute"}))
    path = tmp_path / "out.png"
    code, _, _, _ = _run(
        ["compare", "--configs", "baseline,recompute", "--plot", str(path)], capsys
    )
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_module_entry_point_help():
    result = subprocess.run(
        [sys.executable, "-m", "keras_gradboost", "compare", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0
    for text in ("--model", "--configs", "all_on", "exit status", "1 when the baseline failed"):
        assert text in result.stdout


@pytest.mark.parametrize(
    "per_step, expected",
    [
        ([4.0, 3.0, 2.0, 1.0], 1.0),  # 4 steps: the last one
        ([2.0], 2.0),
        ([3.0, 1.0], 1.0),
        ([8.0, 4.0, 3.0, 1.0, 2.0, 0.0, 1.0, 3.0], 2.0),  # 8 steps: the last 2
    ],
)
def test_final_loss_from_running_means(per_step, expected):
    running = [sum(per_step[: i + 1]) / (i + 1) for i in range(len(per_step))]
    assert compare_lib.final_loss(running) == pytest.approx(expected)


def test_count_traces_counts_each_new_input_shape():
    from keras_gradboost import zoo

    model = zoo.mlp(input_dim=5, hidden=(4,), classes=3)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    traces = compare_lib.count_traces(model)
    x, y = zoo.classification_data(4, input_dim=5, classes=3)
    model.train_on_batch(x, y)
    first = traces[0]
    assert first >= 1
    model.train_on_batch(x, y)
    assert traces[0] == first  # same shapes: no trace
    model.train_on_batch(x[:2], y[:2])
    assert traces[0] == first + 1  # a new batch size: one retrace


def test_timed_fit_does_not_count_the_first_batch_traces_as_retraces():
    import tensorflow as tf

    from keras_gradboost import zoo

    model = zoo.mlp(input_dim=5, hidden=(4,), classes=3)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x, y = zoo.classification_data(12, input_dim=5, classes=3)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True).repeat()
    times, losses, retraces, _ = compare_lib.timed_fit(model, data, 5, "CPU:0")
    assert len(times) == len(losses) == 5
    # Adam creates its slots in the first step, so TensorFlow traces that
    # step twice; neither is a retrace.
    assert retraces == 0


def test_xla_column_shows_the_blocked_reason(monkeypatch, capsys):
    def run_one(spec):
        row = _fake_rows(set())(spec)
        if spec["config"] == "jit_compile":
            row["xla"] = "off: layer 'rnn' (MyRNN) has supports_jit=False"
        return row

    monkeypatch.setattr(compare_lib, "run_one", run_one)
    code, out, _, _ = _run(["compare", "--configs", "baseline,jit_compile"], capsys)
    assert code == 0
    assert _row_line(out, "jit_compile").endswith(
        "  float32  off: layer 'rnn' (MyRNN) has supports_jit=False"
    )
    assert _row_line(out, "baseline").endswith("  float32  off")
    # The xla column starts at the same place in every line.
    lines = out.splitlines()
    starts = {line.index("off") for line in lines if line.startswith(("baseline ", "jit_compile "))}
    assert starts == {lines[1].index("xla")}


class _NoJit(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False

    def call(self, x):
        return x


@pytest.mark.parametrize("jit_compile", [True, "measure"])
def test_xla_fields_name_what_blocked_xla(jit_compile):
    from keras_gradboost.model import GradBoostModel

    inputs = keras.Input((5,))
    model = GradBoostModel(inputs, keras.layers.Dense(3)(_NoJit(name="slow")(inputs)))
    with pytest.warns(UserWarning, match="XLA is off"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    fields = compare_lib.xla_fields(model)
    assert fields["xla"] == "off: layer 'slow' (_NoJit) has supports_jit=False"
    if jit_compile == "measure":
        assert fields["jit_measurement"]["jit_compile"] is False


def test_xla_fields_of_a_measured_model():
    from keras_gradboost.model import GradBoostModel

    inputs = keras.Input((5,))
    model = GradBoostModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse", jit_compile="measure")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(80, 5)), rng.normal(size=(80, 3)), batch_size=8, verbose=0)
    fields = compare_lib.xla_fields(model)
    measured = fields["jit_measurement"]
    state = "on" if measured["jit_compile"] else "off"
    assert fields["xla"] == (
        f"{state} (measured {measured['xla_ms']:.2f} vs {measured['no_xla_ms']:.2f} ms)"
    )


@pytest.mark.parametrize(
    "chosen, expected",
    [("mixed_bfloat16", "mixed_bfloat16 (measured 2.10 vs float32 3.05 ms)"),
     ("float32", "float32 (measured 3.05 vs mixed_bfloat16 2.10 ms)")],
)
def test_the_precision_auto_row_shows_the_choice_and_both_medians(monkeypatch, capsys, chosen,
                                                                      expected):
    def run_one(spec):
        row = _fake_rows(set())(spec)
        if spec["config"] == "precision_auto":
            row["policy"] = chosen
            row["precision_measurement"] = {
                "policy": chosen, "mixed_policy": "mixed_bfloat16", "float32_ms": 3.05,
                "mixed_ms": 2.10, "timed_calls": 3, "reason": "...",
            }
        return row

    monkeypatch.setattr(compare_lib, "run_one", run_one)
    code, out, _, _ = _run(["compare", "--configs", "baseline,precision_auto"], capsys)
    assert code == 0
    assert _row_line(out, "precision_auto").endswith(f"  {expected}  off")
    assert _row_line(out, "baseline").split()[-2:] == ["float32", "off"]
    # The config column is as wide as the longest name: the columns align.
    header, row = out.splitlines()[1], _row_line(out, "precision_auto")
    assert row.index("8.00") + len("8.00") == header.index("step ms") + len("step ms")


def test_precision_auto_steady_state_starts_after_the_measuring_calls(monkeypatch):
    """The child's warm-up covers the measured calls; its row holds the
    measured choice (a fake clock: bfloat16 faster)."""
    from keras_gradboost import precision_measure
    from keras_gradboost.model import GradBoostModel

    inputs = keras.Input((5,))
    model = GradBoostModel(inputs, keras.layers.Dense(3)(keras.layers.Dense(4)(inputs)))
    model.compile(optimizer="sgd", loss="mse", **compare_lib.CONFIGS["precision_auto"])
    calls = 2 * (precision_measure.WARMUP_CALLS + precision_measure.TIMED_CALLS)
    assert compare_lib.measuring_calls(model) == calls
    assert compare_lib.first_trace_calls(model) == 2 * precision_measure.WARMUP_CALLS
    from keras_gradboost import wrappers

    state = {"now": 0.0}

    def fake():  # each call lasts 3 ms in float32, 1 ms in bfloat16
        measuring = wrappers.base_train_function(model)
        policy, _ = measuring.measurer.next_call()
        state["now"] += (3.0 if policy == "float32" else 1.0) / 1000
        return state["now"]

    monkeypatch.setattr(precision_measure, "perf_counter", fake)
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(80, 5)), rng.normal(size=(80, 3)), batch_size=8, verbose=0)
    assert compare_lib.measuring_calls(model) == 0  # decided: steady from here
    fields = compare_lib.precision_fields(model)
    assert fields["policy"] == "mixed_bfloat16"
    assert (fields["float32_ms"], fields["mixed_ms"]) == pytest.approx((3.0, 1.0))


def test_a_keras_layer_error_keeps_its_informative_line():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError) as info:
        model(np.zeros((2, 5), "float32"))
    assert str(info.value).startswith("Exception encountered when calling")
    line = compare_lib._one_line(info.value)
    assert line.startswith("ValueError: Input 0 ")
    assert "expected axis -1 of input shape to have value 3" in line
    assert "\x1b" not in line and "Arguments received" not in line
    assert compare_lib._one_line(RuntimeError("first\nsecond")) == "RuntimeError: first"


def test_nonfinite_data_gets_a_note():
    x = np.ones((4, 3), "float32")
    x[1, 2] = np.nan
    y = np.full((4,), np.inf, "float32")
    assert compare_lib.nonfinite_notes({"x": x, "y": y, "ids": np.arange(4)}) == [
        "--data x: 1 of 12 values are not finite",
        "--data y: 4 of 4 values are not finite",
    ]


def test_what_training_warns_about_is_a_note_of_its_row(tmp_path):
    # The rows recorded compile's warnings only: an accumulation that is
    # not the large batch's (here an Embedding's sparse gradient under
    # Adam) trained silently in the table.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    path = str(tmp_path / "embedding.keras")
    model.save(path)
    row = compare_lib.run_one({"config": "accumulate", "kwargs": compare_lib.CONFIGS["accumulate"],
                               "model": path, "batch_size": 8, "steps": 3})
    assert "error" not in row, row
    assert any("is sparse" in note for note in row["notes"]), row["notes"]
    recorded = [types.SimpleNamespace(message=UserWarning(m)) for m in ("a. b", "a. c", "d")]
    assert compare_lib.warning_notes(recorded) == ["a", "d"]
