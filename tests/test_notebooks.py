"""The notebooks run top to bottom in a fresh kernel and show what their text
promises; the committed files carry no outputs.

Each notebook runs once (in `notebooks/`, kernel "python3" from the ipykernel
installed with the `test` extra, a timeout per cell; the three at once); a
cell that raises fails the test with its traceback, naming the notebook. The checks read the printed outputs.
"""

import ast
import asyncio
import os
import pathlib
import re
import traceback

import nbformat
import pytest
from conftest import KERAS_VERSION
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ("01_callbacks.ipynb", "02_gradboost_model.ipynb", "03_recompute_budget.ipynb")
CELL_TIMEOUT = 300  # seconds, per cell


def _client(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    return NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},  # the kernel's cwd
    )


@pytest.fixture(scope="module")
def executed():
    """`{name: executed notebook or the exception it raised}`: the three run
    at once, each in its own kernel (most of their time is single-threaded:
    kernel start, imports, tracing)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}

    async def run_all():
        clients = [_client(name) for name in NAMES]
        return await asyncio.gather(
            *(client.async_execute(env=env) for client in clients), return_exceptions=True
        )

    return dict(zip(NAMES, asyncio.run(run_all())))


def _result(executed, name):
    nb = executed[name]
    if isinstance(nb, BaseException):
        raise nb  # a CellExecutionError shows the failing cell's traceback
    return nb


def _stdout(nb):
    return "".join(
        output.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "stream" and output.name == "stdout"
    )


def _images(nb):
    return [
        output
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if "image/png" in output.get("data", {})
    ]


def _line(text, prefix):
    """The rest of the first output line starting with `prefix`."""
    match = re.search("^" + re.escape(prefix) + "(.*)$", text, re.MULTILINE)
    assert match, f"no line starting with {prefix!r} in:\n{text}"
    return match.group(1).strip()


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_has_no_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and any(cell.cell_type == "markdown" for cell in nb.cells)
    for cell in code:
        assert cell.outputs == [], f"{name}: a code cell has outputs"
        assert cell.execution_count is None, f"{name}: a code cell has an execution count"
    assert nb.metadata.kernelspec.name == "python3"


def test_notebooks_are_the_ones_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


def _check_01_callbacks(executed):
    out = _stdout(_result(executed, "01_callbacks.ipynb"))
    # NaNWatcher: the planted NaN at batch 5, made by unsafe_log, skipped.
    assert "non-finite training step at epoch 0, step 5." in out
    assert "events: [(5, 'forward', 'unsafe_log', 'skipped')]" in out
    assert _line(out, "nonfinite_steps in History:") == "[1.0]"
    assert _line(out, "optimizer steps applied:") == "7 of 8"
    assert _line(out, "all weights finite:") == "True"
    # RetraceCounter: one XLA recompile per new length, then per bucket.
    counts = re.findall(r"^retraces: (\d+) \| XLA recompiles: (\d+)$", out, re.MULTILINE)
    assert counts == [("0", "5"), ("0", "2")]
    assert "x: shape (4, 5) -> (4, 8), dim 1 varies" in out
    assert "bucket_by_length(ds, boundaries=[8, 16, 24]" in out
    assert _line(out, "batch shapes:") == "[(4, 8), (4, 16), (4, 24)]"
    # GradientAuditor: the cut and the unused layer, with their reasons
    # (Keras before 3.15 does not track the spare layer, set on the built
    # functional model: see conftest.needs_layer_set_on_functional).
    missing = [("teacher/kernel", "teacher", "cut"), ("teacher/bias", "teacher", "cut")]
    if KERAS_VERSION >= (3, 15):
        missing += [("spare/kernel", "spare", "unused"), ("spare/bias", "spare", "unused")]
    for variable, layer, reason in missing:
        assert re.search(
            rf"^{re.escape(variable)}\s+layer {layer}\s+reason: {reason}$", out, re.MULTILINE
        ), variable
    assert "student/kernel" not in out
    # StepTimeMonitor: the step split into its four parts.
    parts = ast.literal_eval(_line(out, "split parts (ms):"))
    assert set(parts) == {"input wait + overhead", "forward", "backward", "optimizer"}
    assert parts["forward"] > 0 and min(parts.values()) >= 0
    assert re.fullmatch(r"\d+%", _line(out, "backward share:"))


def _check_02_gradboost_model(executed):
    nb = _result(executed, "02_gradboost_model.ipynb")
    out = _stdout(nb)
    rows = {}
    for name in ("baseline", "jit_compile", "precision_auto", "accumulate_4", "recompute_auto"):
        fields = _line(out, name).split()
        rows[name] = {"step_ms": float(fields[0]), "peak_mib": float(fields[2]), "rest": " ".join(fields[4:])}
        assert rows[name]["step_ms"] > 0
    # Every block but the last (whose rebuild would come first: no saving).
    assert rows["recompute_auto"]["rest"].endswith("/ block_0, block_1, block_2")
    assert rows["baseline"]["rest"] == "float32 (as built) / -"
    assert re.match(r"(mixed_bfloat16|float32) / -$", rows["precision_auto"]["rest"])
    # Recompute keeps the four blocks' insides out of memory: a lower
    # allocator peak (memory, not time).
    assert rows["recompute_auto"]["peak_mib"] < rows["baseline"]["peak_mib"]
    assert _line(out, "optimizer updates:") == "4 vs 4"
    assert _line(out, "same weights:") == "True"
    assert len(_images(nb)) == 1


def _check_03_recompute_budget(executed):
    nb = _result(executed, "03_recompute_budget.ipynb")
    out = _stdout(nb)
    assert "Recompute plan (recompute='auto')" in out
    # Every block but the last (whose rebuild would come first: no saving).
    assert len(re.findall(r"^  block_\d\s+yes ", out, re.MULTILINE)) == 5
    assert re.search(r"^  block_5\s+no ", out, re.MULTILINE)
    estimates = [float(e) for e in re.findall(
        r"^budget .* MiB -> estimate\s+([\d.]+) MiB", out, re.MULTILINE)]
    assert len(estimates) == 7
    assert estimates == sorted(estimates)  # a larger budget, a larger estimate
    assert _line(out, "every estimate within its budget:") == "True"
    counts = ast.literal_eval(_line(out, "blocks recomputed, smallest to largest budget:"))
    assert counts[0] == 5 and counts[-1] == 0
    assert _line(out, "recomputed blocks:") == str([f"block_{i}" for i in range(5)])
    assert _line(out, "same weights:") == "True"
    assert _line(out, "weights moved:") == "True"
    assert len(_images(nb)) == 1


CHECKS = {
    "01_callbacks.ipynb": _check_01_callbacks,
    "02_gradboost_model.ipynb": _check_02_gradboost_model,
    "03_recompute_budget.ipynb": _check_03_recompute_budget,
}


def test_each_notebook_shows_what_its_text_promises(executed):
    # One test for the three: a module-scoped fixture runs once in each
    # xdist worker that runs a test using it, and three tests split between
    # the two workers ran the three notebooks twice (45-70 s of CI).
    assert list(CHECKS) == list(NAMES)
    failed = []
    for name, check in CHECKS.items():
        try:
            check(executed)
        except Exception:  # noqa: BLE001 - each notebook's failure is reported
            failed.append(f"{name}:\n{traceback.format_exc()}")
    assert not failed, "\n\n".join(failed)
