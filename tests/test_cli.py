"""The command line, end to end on a tiny configuration."""

import subprocess
import sys

import pytest

from keras_gradboost import cli


def test_compare_runs_and_reports_each_feature(capsys):
    code = cli.main(
        ["compare", "--steps", "8", "--batch-size", "16", "--configs", "baseline,accumulate,loss_scale"]
    )
    assert code == 0
    rows = cli.LAST_ROWS
    out = capsys.readouterr().out
    for name in ("baseline", "accumulate", "loss_scale"):
        assert f"\n{name} " in out
    by_name = {r["config"]: r for r in rows}
    assert by_name["baseline"]["updates"] == 8
    assert by_name["accumulate"]["updates"] == 2  # 8 micro-batches, k=4
    assert by_name["loss_scale"]["loss_scale"] == 2.0**15
    assert by_name["baseline"]["loss_scale"] is None


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["compare", "--configs", "nope"], "unknown configuration"),
        (["compare", "--steps", "0"], "--steps: expected an int >= 1"),
        (["compare", "--batch-size", "-1"], "--batch-size: expected an int >= 1"),
        (["compare", "--steps", "x"], "invalid int value"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_error(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert err.strip().splitlines()[-1].startswith("keras-gradboost")


def test_module_entry_point_help():
    result = subprocess.run(
        [sys.executable, "-m", "keras_gradboost", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0
    assert "compare" in result.stdout
