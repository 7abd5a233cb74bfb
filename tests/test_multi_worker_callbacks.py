"""The four callbacks under MultiWorkerMirroredStrategy, two workers on
127.0.0.1 (tests/workers/callbacks_fit.py), against the same fit in one
process on the same global batches: a NaN in worker 1's part of a micro-
batch is restored from on every worker at the same step, and the weights
after it equal one process's; GradientAuditor names the same cut variables
on each worker and RetraceCounter counts the same traces; StepTimeMonitor
times each worker's own steps and only the chief writes TensorBoard's
`log_dir`; NaNWatcher's dumps are one file per worker (each holds its own
part of the bad batch). With `action="warn"` every worker drops the bad
micro-batch and goes on, as one process does."""

import io
import json
import os
import pathlib

import numpy as np
import pytest

import tensorflow as tf
from keras_gradboost.launcher import launch
from test_multi_worker import _env
from test_multi_worker import load_script

WORKERS = 2
TIMEOUT = 100.0
SCRIPT = pathlib.Path(__file__).parent / "workers" / "callbacks_fit.py"


@pytest.mark.multiworker
def test_callbacks_agree_across_workers_and_with_one_process(tmp_path):
    out = io.StringIO()
    codes = launch(SCRIPT, [str(tmp_path)], workers=WORKERS, timeout=TIMEOUT, env=_env(), output=out)
    assert codes == [0] * WORKERS, out.getvalue()[-4000:]
    cf = load_script(SCRIPT)
    one_dir = tmp_path / "one"
    weights, report = cf.run(tf.distribute.get_strategy(), str(one_dir), shard=False)
    init = cf.build().get_weights()
    update = max(float(np.max(np.abs(w - i))) for w, i in zip(weights, init))
    # Global batch 3 of each epoch.
    assert report["nan_events"] == [[0, 3, "restored"], [1, 3, "restored"]], report
    assert report["missing"] and all("cut" in v for v in report["missing"]), report
    for i in range(WORKERS):
        saved = np.load(tmp_path / f"callbacks-worker{i}.npz")
        got = json.loads(str(saved["report"]))
        for key in ("nan_events", "missing", "retraces", "iterations", "steps_timed"):
            assert got[key] == report[key], (i, key, got[key], report[key])
        final = [saved[f"arr_{j}"] for j in range(len(weights))]
        diff = max(float(np.max(np.abs(f - w))) for f, w in zip(final, weights))
        assert diff <= 1e-5 * update, (i, diff)
    # TensorBoard: the chief's scalars only (one process wrote the same kind).
    assert os.listdir(tmp_path / "tensorboard") and os.listdir(one_dir / "tensorboard")
    assert len(os.listdir(tmp_path / "tensorboard")) == len(os.listdir(one_dir / "tensorboard"))
    # The dumps: each worker its own part of the bad batch; the NaN in worker 1's.
    dumps = sorted(os.listdir(tmp_path / "dumps"))
    assert dumps == [
        f"nonfinite_epoch{e}_step3_worker{i}.npz" for e in range(2) for i in range(WORKERS)
    ], dumps
    x_parts = [np.load(tmp_path / "dumps" / d)["arr_0"] for d in dumps]
    assert [bool(np.isnan(p).any()) for p in x_parts] == [False, True] * 2
    # NaNWatcher(action="warn"): every worker drops the bad micro-batch and
    # goes on, as one process does.
    weights, report = cf.run(tf.distribute.get_strategy(), str(tmp_path / "one-warn"),
                             shard=False, action="warn")
    assert report["nan_events"] == [[0, 3, "warned"], [1, 3, "warned"]], report
    for i in range(WORKERS):
        saved = np.load(tmp_path / f"warn-worker{i}.npz")
        got = json.loads(str(saved["report"]))
        assert got["nan_events"] == report["nan_events"] and got["iterations"] == report["iterations"]
        final = [saved[f"arr_{j}"] for j in range(len(weights))]
        diff = max(float(np.max(np.abs(f - w))) for f, w in zip(final, weights))
        assert diff <= 1e-5 * update, (i, diff)
