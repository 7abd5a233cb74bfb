"""GradBoostModel.fit under MultiWorkerMirroredStrategy, two workers on
127.0.0.1, against one process's large-batch steps on the same global
batches.

The workers (tests/workers/exact_fit.py, started by `keras_gradboost.launch`)
shard the dataset with `AutoShardPolicy.DATA`; the test checks that each
global batch is the two workers' parts together, then computes the reference here, in
this process, with a plain `keras.Model` from each case's initial weights:
one `train_on_batch` per update on the concatenated global batches of its
window.
"""

import importlib.util
import io
import json
import os
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_gradboost
from keras_gradboost.launcher import launch

WORKERS = 2
# Seconds for the whole job; it took 55-79 s on 2 cores with the rest of
# the suite running beside it (the callbacks' fits about 10 more).
TIMEOUT = 150.0
SCRIPT = pathlib.Path(__file__).parent / "workers" / "exact_fit.py"
CALLBACKS_SCRIPT = SCRIPT.parent / "callbacks_fit.py"
# Relative to the update: the mixed-precision cases' matmuls reduce over
# each replica's rows in 16 bits, the reference's over the global batch.
TOLERANCE = {"k2_bf16": 3e-2, "k2_f16": 3e-3}


def load_script(script):
    """A worker script (tests/workers/) imported as a module, for its cases,
    data and model builders."""
    spec = importlib.util.spec_from_file_location(pathlib.Path(script).stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker_module():
    return load_script(SCRIPT)


def _env():
    """The workers import this checkout's package, quietly, on the CPU."""
    root = str(pathlib.Path(keras_gradboost.__file__).parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["TF_NUM_INTRAOP_THREADS"] = "1"  # tiny steps: no thread pool contention on 2 cores
    env["TF_NUM_INTEROP_THREADS"] = "1"
    return env


def _reference(ef, name, init):
    """A plain keras.Model's steps on the windows' concatenated global
    batches: `(weights, epoch mean of the window losses)`."""
    kind, kwargs = ef.CASES[name]
    k = kwargs["accumulate_steps"]
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(kwargs.get("precision") or "float32")
    try:  # (Keras wraps a mixed_float16 model's optimizer in a loss scale)
        model = ef.build(kind, keras.Model)
        model.compile(optimizer=ef.optimizer(kwargs["optimizer"]), loss=ef.loss(kind))
    finally:
        keras.config.set_dtype_policy(before)
    model.set_weights(init)
    xs, ys, batch = ef.data(kind)
    if name == "k4_nan_stop":  # stopped at the first micro-batch: no update
        return init, 0, None
    losses = []
    for start in range(0, len(xs), batch * k):
        rows = np.arange(start, min(start + batch * k, len(xs)))
        if kind == "nan":  # the skipped micro-batch is not in the large batch
            rows = rows[rows // batch != ef.NAN_ROW // batch]
        model.reset_metrics()
        logs = model.train_on_batch(xs[rows], ys[rows], return_dict=True)
        losses.append((len(rows), logs["loss"]))
    mean_loss = sum(n * l for n, l in losses) / len(xs)
    return model.get_weights(), int(model.optimizer.iterations.numpy()), mean_loss


@pytest.mark.multiworker
def test_multi_worker_fits_and_callbacks_equal_one_process(tmp_path):
    """Two workers, thirteen cases (accumulate_steps 1, 4, an uneven 3 with Adam, 3
    with a last global batch split 5 + 4 and 1 + 0 between the workers, 4
    with a dynamic loss scale, 4 with a NaN in one worker's part of a
    micro-batch found by the loss scale's check or by a NaNWatcher
    (action="skip", and "stop": every worker stops there, no update), 2 with
    recompute, a masked loss with 2, mixed_bfloat16 and mixed_float16 with
    2, the float16 one with a dynamic loss scale): both workers hold the same weights,
    equal to the single-process reference within float32 round-off relative
    to the update; the logged loss is the mean over all replicas (the same
    on both workers); the NaN micro-batch is skipped on every worker, and
    only it; the gradients are all-reduced once per update (2 for 8
    micro-batches with accumulate_steps=4). XLA, which TensorFlow cannot
    compile with CPU collectives, is off with the reason given. Then, in the
    same job, the four callbacks agree across workers and with one process
    (`_assert_callbacks_agree`)."""
    out = io.StringIO()
    codes = launch(
        SCRIPT, [str(tmp_path)], workers=WORKERS, timeout=TIMEOUT, env=_env(), output=out
    )
    assert codes == [0] * WORKERS, out.getvalue()[-4000:]
    ef = _worker_module()
    saved = [np.load(tmp_path / f"worker{i}.npz") for i in range(WORKERS)]
    assert int(saved[0]["replicas"]) == WORKERS
    # jit_compile=True: XLA is off, and says why (no collectives on a CPU).
    for w in saved:
        assert not bool(w["jit_compile"])
        assert "MultiWorkerMirroredStrategy over 2 CPU replicas" in str(w["xla_blocked"])
        assert "XLA is off" in str(w["xla_warning"])

    # AutoShardPolicy.DATA: global batch s is worker 0's part, then worker 1's.
    x, _ = ef.regression_data()
    steps = ef.N // ef.GLOBAL_BATCH
    for s in range(steps):
        parts = [w[f"shard/{s}"] for w in saved]
        assert [len(p) for p in parts] == [ef.GLOBAL_BATCH // WORKERS] * WORKERS
        np.testing.assert_array_equal(
            np.concatenate(parts), x[s * ef.GLOBAL_BATCH : (s + 1) * ef.GLOBAL_BATCH]
        )
    assert f"shard/{steps}" not in saved[0]

    for name, (kind, _) in ef.CASES.items():
        count = sum(1 for key in saved[0].files if key.startswith(f"{name}/init/"))
        init = [saved[0][f"{name}/init/{i}"] for i in range(count)]
        for w in saved[1:]:  # the same start on every worker
            for i in range(count):
                np.testing.assert_array_equal(w[f"{name}/init/{i}"], init[i])
        weights, iterations, mean_loss = _reference(ef, name, init)
        # The reference's update (the run moved the weights), or for a
        # stopped run the k4_sgd one, the scale of an update.
        ref = weights if iterations else _reference(ef, "k4_sgd", init)[0]
        update = max(float(np.max(np.abs(r - i0))) for r, i0 in zip(ref, init))
        assert update > 1e-3, name
        for w in saved:
            assert int(w[f"{name}/iterations"]) == iterations, name
            # The gradients cross the network once per update, not once per
            # micro-batch: accumulation also cuts communication k-fold.
            assert int(w[f"{name}/gradient_all_reduces"]) == iterations, name
            final = [w[f"{name}/final/{i}"] for i in range(count)]
            diff = max(float(np.max(np.abs(f - r))) for f, r in zip(final, weights))
            assert diff <= TOLERANCE.get(name, 1e-5) * update, (name, diff, update)
            print(f"{name}: max weight difference {diff:.2e} = {diff / update:.1e} of the update")
            # Every worker holds bitwise the same weights and logs.
            for i in range(count):
                np.testing.assert_array_equal(final[i], saved[0][f"{name}/final/{i}"])
            np.testing.assert_array_equal(w[f"{name}/loss"], saved[0][f"{name}/loss"])
            assert int(w[f"{name}/skipped"]) == (1 if kind == "nan" else 0), name
            if kind == "nan" and name != "k4_nan_stop":  # the dropped step's NaN stays out
                assert np.isfinite(w[f"{name}/loss"]).all(), (name, w[f"{name}/loss"])
            assert bool(w[f"{name}/stopped"]) == (name == "k4_nan_stop"), name
        if kind.startswith("tail:"):  # the last global batch, split unevenly
            tail = len(ef.data(kind)[0]) % ef.GLOBAL_BATCH
            parts = [int(w[f"{name}/last_part"]) for w in saved]
            assert sum(parts) == tail and parts[0] != parts[1], (name, parts)
        if name == "k2_recompute":
            assert len(saved[0][f"{name}/recomputed"]) > 0  # blocks were recomputed
        if kind == "dense":  # (a partial batch weighs less in Keras' mean)
            # Keras' loss log: each micro-batch's mean at its window's start.
            np.testing.assert_allclose(
                float(saved[0][f"{name}/loss"][-1]), mean_loss, rtol=TOLERANCE.get(name, 1e-5)
            )
    _assert_callbacks_agree(tmp_path / "callbacks")


def _assert_callbacks_agree(tmp_path):
    """The four callbacks' fits of the job (tests/workers/callbacks_fit.py,
    in `tmp_path`) against the same fit in this process on the same global
    batches: a NaN in worker 1's part of a micro-batch is restored from on
    every worker at the same step, and the weights after it equal one
    process's; GradientAuditor names the same cut variables on each worker
    and RetraceCounter counts the same traces; StepTimeMonitor times each
    worker's own steps and only the chief writes TensorBoard's `log_dir`;
    NaNWatcher's dumps are one file per worker (each holds its own part of
    the bad batch). With `action="warn"` every worker drops the bad
    micro-batch and goes on, as one process does."""
    cf = load_script(CALLBACKS_SCRIPT)
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
