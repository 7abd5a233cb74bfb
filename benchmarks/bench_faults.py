"""Fault-tolerance benchmark: how long two workers on 127.0.0.1 take to
notice a killed worker, and to resume from kgb.callbacks.BackupAndRestore.

Each round (benchmarks/fault_worker.py; GradBoostModel's MLP
784-1024-1024-10, accumulate_steps=4, MultiWorkerMirroredStrategy):

1. `fresh`: both workers fit `--steps` micro-batches from the start, no
   backup; the time from a process's start to its first step end is the
   start-up (TensorFlow's import, the cluster, the first trace);
2. `kill`: the same fit with backups every `--save-freq` batches; worker 1
   SIGKILLs itself at the end of batch `--kill-at`. The workers are started
   here with `subprocess` (not `keras_gradboost.launch`, which would stop
   the survivor at once): the detection time is from the kill to the
   survivor's fit raising (TensorFlow's heartbeat check);
3. `resume`: both workers restarted with the same backup: the time from a
   process's start to its first trained step end after the skipped batches,
   against the fresh start-up: what the restore and the skipping cost.

Medians over `--rounds` rounds. About 1.5 minutes a round on 2 cores.

    python benchmarks/bench_faults.py [--rounds 3] [--steps 40]
        [--save-freq 8] [--kill-at 21] [--batch 64]
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from bench_multi_worker import _env
from keras_gradboost.launcher import free_ports
from keras_gradboost.launcher import tf_config

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "fault_worker.py"
WORKERS = 2


def run_phase(out_dir, phase, settings, timeout):
    """Starts the workers of one phase and waits for every one of them
    (at most `timeout` s; then they are killed and the round fails)."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(WORKERS)]
    env = dict(_env(), PYTHONPATH=os.pathsep.join([str(HERE), _env().get("PYTHONPATH", "")]))
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), out_dir, phase, json.dumps(settings)],
            env=dict(env, TF_CONFIG=tf_config(i, addresses)),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for i in range(WORKERS)
    ]
    deadline = time.monotonic() + timeout
    try:
        for p in processes:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        sys.exit(f"{phase}: a worker did not exit within {timeout:g} s")
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    records = []
    for i in range(WORKERS):
        with open(os.path.join(out_dir, f"{phase}-worker{i}.json")) as f:
            records.append(json.load(f))
    return [p.returncode for p in processes], records


def first_step_after(record, skipped):
    """Seconds from the process's start to its first step end after the
    first `skipped` batches (skipped ones end too, without training)."""
    for batch, at in record["batch_ends"]:
        if batch >= skipped:
            return at - record["started"]
    raise ValueError("no trained step")


def one_round(settings, timeout):
    with tempfile.TemporaryDirectory() as tmp:
        codes, fresh = run_phase(tmp, "fresh", settings, timeout)
        assert codes == [0, 0], codes
        codes, killed = run_phase(tmp, "kill", settings, timeout)
        assert codes[1] == -9 and codes[0] != 0 and "error" in killed[0], (codes, killed[0])
        with open(os.path.join(tmp, "backup", "training_metadata.json")) as f:
            resumed_at = json.load(f)["batches_done"]
        codes, resumed = run_phase(tmp, "resume", settings, timeout)
        assert codes == [0, 0], codes
    return {
        "detect": killed[0]["error_at"] - killed[1]["killed"],
        "error": killed[0]["error"],
        "fresh_start": first_step_after(fresh[0], 0),
        "resume_start": first_step_after(resumed[0], resumed_at),
        "resumed_at": resumed_at,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="micro-batches of the fit")
    parser.add_argument("--save-freq", type=int, default=8, help="batches between backups")
    parser.add_argument("--kill-at", type=int, default=21, help="the batch worker 1 dies after")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per phase")
    args = parser.parse_args(argv)
    if not 0 <= args.kill_at < args.steps or args.save_freq > args.kill_at:
        parser.error(
            f"Invalid value for argument `--kill-at`. Received: --kill-at={args.kill_at}. "
            f"Expected a batch after the first backup (--save-freq={args.save_freq}) "
            f"and before the last (--steps={args.steps})."
        )
    settings = {"batch": args.batch, "steps": args.steps, "save_freq": args.save_freq,
                "kill_at": args.kill_at}
    rounds = []
    for r in range(args.rounds):
        rounds.append(one_round(settings, args.timeout))
        print(f"round {r}: {rounds[-1]}", file=sys.stderr, flush=True)

    def med(key):
        return statistics.median(r[key] for r in rounds)

    import keras
    import tensorflow as tf

    print(f"TF {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPUs; "
          f"{WORKERS} workers on 127.0.0.1; MLP 784-1024-1024-10, accumulate_steps=4, "
          f"global batch {args.batch}; medians of {args.rounds} rounds")
    each = ", ".join(f"{r['detect']:.1f}" for r in rounds)
    errors = sorted({r["error"] for r in rounds})
    print(f"  worker 1 killed after batch {args.kill_at}; the survivor's fit raised "
          f"{errors} after {med('detect'):.1f} s (rounds: {each})")
    print(f"  start to first step: fresh {med('fresh_start'):.1f} s; resumed from the "
          f"backup after batch {rounds[0]['resumed_at']}: {med('resume_start'):.1f} s "
          f"(restore + {rounds[0]['resumed_at']} skipped batches: "
          f"{med('resume_start') - med('fresh_start'):+.1f} s)")


if __name__ == "__main__":
    main()
