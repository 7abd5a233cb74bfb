"""Training that survives a killed worker and a preemption: two workers on
127.0.0.1 with kgb.callbacks.BackupAndRestore on one shared `backup_dir`
(tests/workers/fault_fit.py). A worker SIGKILLed mid-epoch: the job stops,
bounded in time; restarted, it finishes with the weights of one process's
uninterrupted large-batch steps on the same global batches (so does a fit
stopped there by an error, with accumulate_steps=1). A SIGTERM to
one worker: every worker saves at the same step (for accumulate_steps=4,
the next update boundary) and exits; restarted, the same."""

import io
import json
import pathlib
import time

import numpy as np
import pytest

import keras
from keras_gradboost.launcher import launch
from test_multi_worker import _env
from test_multi_worker import _worker_module
from test_multi_worker import load_script

WORKERS = 2
TIMEOUT = 120.0
SCRIPT = pathlib.Path(__file__).parent / "workers" / "fault_fit.py"


def _reference(ef, k, init, epochs):
    """One process's steps on the windows' concatenated global batches."""
    model = ef.build("dense", keras.Model)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.set_weights(init)
    x, y, batch = ef.data("dense")
    for _ in range(epochs):
        for start in range(0, len(x), batch * k):
            model.train_on_batch(x[start : start + batch * k], y[start : start + batch * k])
    return model.get_weights(), int(model.optimizer.iterations.numpy())


def _run(tmp_path, jobs):
    out = io.StringIO()
    started = time.monotonic()
    codes = launch(SCRIPT, [str(tmp_path)] + jobs, workers=WORKERS, timeout=TIMEOUT,
                   env=_env(), output=out)
    return codes, time.monotonic() - started, out.getvalue()


def _metadata(tmp_path, name):
    with open(tmp_path / name / "training_metadata.json") as f:
        return json.load(f)


@pytest.mark.multiworker
def test_a_killed_worker_and_a_preemption_resume_exactly(tmp_path):
    ff, ef = load_script(SCRIPT), _worker_module()
    # k=1 stopped by an error on every worker at (1, 5), after the backup
    # of (1, 3) (on disk what a kill there leaves); then k=4's worker 1
    # SIGKILLed at the same point (its backups wait for update boundaries:
    # (0, 3), (0, 7), (1, 3)). (A job per kill: 13-20 s each.)
    codes, seconds, log = _run(tmp_path, ["k1:interrupt", "k4:kill"])
    assert "k1 interrupt done" in log, log[-3000:]
    assert codes[1] == -9 and codes[0] != 0, log[-3000:]  # the job stopped, both workers
    assert seconds < TIMEOUT, log[-3000:]
    for name in ("k1", "k4"):
        saved = _metadata(tmp_path, name)
        assert (saved["epoch"], saved["batches_done"]) == (1, 4), (name, saved)
    # Both restarted to their end; then a SIGTERM to worker 1 at the end of
    # (1, 1): the agreed step (1, 2) is inside a window, so every worker
    # saves at (1, 3).
    codes, seconds, log = _run(tmp_path, ["k1:resume", "k4:resume", "k4_term:term"])
    assert "k1 resume done" in log and "k4 resume done" in log, log[-3000:]
    # Both saved and exited with 143; the launcher may SIGTERM (-15) the
    # later one after the first has exited, during its own exit.
    assert 143 in codes and set(codes) <= {143, -15}, log[-3000:]
    saved = _metadata(tmp_path, "k4_term")
    assert (saved["epoch"], saved["batches_done"]) == (1, 4), saved
    codes, seconds, log = _run(
        tmp_path, ["k4_term:resume", "k4:midwindow", "split:interrupt", "split:resume"]
    )
    assert codes == [0, 0], log[-3000:]
    # Backup directories that are not shared: the chief restored its backup,
    # worker 1 none; refused on both before the first step.
    for i in range(WORKERS):
        text = (tmp_path / f"split-worker{i}.txt").read_text()
        assert "Worker 1 restored no backup" in text and "chief restored epoch0-batch4" in text, text
    # A save in the middle of a window is refused on every worker (each
    # holds only its part of the window), not written wrong.
    for i in range(WORKERS):
        text = (tmp_path / f"midwindow-worker{i}.txt").read_text()
        assert "1 of 4 micro-batches are pending" in text, text

    for name, (k, _) in ff.CASES.items():
        init_file = np.load(tmp_path / f"{name}-init.npz")
        init = [init_file[f"arr_{i}"] for i in range(len(init_file.files))]
        weights, iterations = _reference(ef, k, init, ff.EPOCHS)
        update = max(float(np.max(np.abs(w - i))) for w, i in zip(weights, init))
        finals = [np.load(tmp_path / f"{name}-worker{i}.npz") for i in range(WORKERS)]
        for final in finals:
            assert int(final["iterations"]) == iterations, name
            got = [final[f"arr_{i}"] for i in range(len(weights))]
            diff = max(float(np.max(np.abs(g - w))) for g, w in zip(got, weights))
            assert diff <= 1e-5 * update, (name, diff, update)
            print(f"{name}: {diff / update:.1e} of the update off one process")
            for i in range(len(weights)):  # every worker the same
                np.testing.assert_array_equal(final[f"arr_{i}"], finals[0][f"arr_{i}"])
        assert not (tmp_path / name).exists()  # completed: the chief deleted it
