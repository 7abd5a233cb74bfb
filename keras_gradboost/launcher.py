"""Local multi-worker jobs: N worker processes on this machine, each with
its own `TF_CONFIG`, the way `torchrun` serves PyTorch users.

`launch(script, args, workers=N)` starts N Python processes running
`script` on 127.0.0.1, with ports picked free at run time, one
`TF_CONFIG` each (`{"cluster": {"worker": [...]}, "task": {"type":
"worker", "index": i}}`), so that `tf.distribute.MultiWorkerMirroredStrategy()`
in the script forms one cluster of N workers. Each line a worker prints is
shown with a `[worker i]` prefix. Every worker is bounded in time: at the
timeout, or as soon as one worker fails, the others are stopped (SIGTERM,
then SIGKILL after a grace period). The exit codes are returned, in worker
order. The same script runs on several machines unchanged, where the
cluster manager sets `TF_CONFIG`.

Nothing here imports TensorFlow: the launcher is a plain process manager.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time

HOST = "127.0.0.1"

DEFAULT_TIMEOUT = 600.0

# Seconds a worker has to exit after SIGTERM before it gets SIGKILL.
_GRACE_SECONDS = 5.0


def free_ports(count, host=HOST):
    """`count` distinct TCP ports free on `host` right now.

    All sockets are held open until every port is picked, so no port is
    returned twice; another process may still take one before the worker
    binds it (TensorFlow then fails to start its server, loudly).

    Args:
        count: how many ports. An int >= 1.
        host: the address to bind. Defaults to `"127.0.0.1"`.

    Returns:
        A list of `count` ints.
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(index, addresses):
    """The `TF_CONFIG` of worker `index` in a cluster of `addresses`
    (`"host:port"` strings), as a JSON string."""
    return json.dumps(
        {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}
    )


def _check_args(workers, timeout, script):
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(
            "Invalid value for argument `workers`. Received: "
            f"workers={workers!r}. Expected an int >= 1."
        )
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not timeout > 0
    ):
        raise ValueError(
            "Invalid value for argument `timeout`. Received: "
            f"timeout={timeout!r}. Expected a number of seconds > 0 (every "
            "worker is bounded in time)."
        )
    if not isinstance(script, (str, os.PathLike)) or not os.path.isfile(script):
        raise ValueError(
            "Invalid value for argument `script`. Received: "
            f"script={script!r}. Expected the path of an existing Python file."
        )


class _Output:
    """Writes whole lines from several threads to one stream, prefixed."""

    def __init__(self, stream):
        self.stream = stream
        self.lock = threading.Lock()

    def line(self, prefix, text):
        with self.lock:
            self.stream.write(f"{prefix} {text.rstrip(chr(10))}\n")
            self.stream.flush()

    def pump(self, prefix, pipe):
        for text in iter(pipe.readline, ""):
            self.line(prefix, text)
        pipe.close()


def _stop(processes, output, reason):
    """SIGTERM to every worker still running, SIGKILL to those that have not
    exited after the grace period."""
    running = [(i, p) for i, p in enumerate(processes) if p.poll() is None]
    if not running:
        return
    output.line("[launch]", f"{reason}: stopping worker(s) {[i for i, _ in running]}")
    for _, p in running:
        p.terminate()
    deadline = time.monotonic() + _GRACE_SECONDS
    for _, p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(
    script, args=(), workers=2, timeout=DEFAULT_TIMEOUT, env=None, output=None, python=None
):
    """Runs `script` in `workers` local worker processes of one cluster.

    Each worker gets a `TF_CONFIG` naming all workers on 127.0.0.1 (ports
    picked free at run time) and its own index, so a
    `tf.distribute.MultiWorkerMirroredStrategy()` in `script` spans them.
    Output lines are prefixed `[worker i]`. The launcher stops every worker
    still running when one exits with a non-zero status, and all of them at
    the timeout: no worker outlives the call.

    Args:
        script: path of the Python script each worker runs.
        args: the script's command-line arguments (strings). Defaults to
            `()`.
        workers: the number of worker processes, an int >= 1. Defaults to
            `2`.
        timeout: seconds the whole job may run; then every worker still
            running is stopped. Defaults to `600.0`.
        env: the environment of the workers (each adds its `TF_CONFIG`);
            `None` for this process's. Defaults to `None`.
        output: a text stream for the prefixed lines; `None` for
            `sys.stdout`. Defaults to `None`.
        python: the Python executable; `None` for this one
            (`sys.executable`). Defaults to `None`.

    Returns:
        The workers' exit codes, in worker order: 0 for success; a worker
        the launcher stopped has the negative signal number (-15 for
        SIGTERM, -9 for SIGKILL).

    Raises:
        ValueError: for a bad `workers`, `timeout` or `script`.

    Example:

    ```python
    import pathlib, tempfile
    from keras_gradboost import launch

    script = pathlib.Path(tempfile.mkdtemp()) / "hello.py"
    script.write_text(
        "import json, os\\n"
        "print(json.loads(os.environ['TF_CONFIG'])['task']['index'])\\n"
    )
    assert launch(str(script), workers=2, timeout=60) == [0, 0]
    ```
    """
    _check_args(workers, timeout, script)
    args = [str(a) for a in args]
    addresses = [f"{HOST}:{port}" for port in free_ports(workers)]
    base_env = dict(os.environ if env is None else env)
    out = _Output(output if output is not None else sys.stdout)
    processes, pumps = [], []
    try:
        for index in range(workers):
            worker_env = dict(base_env, TF_CONFIG=tf_config(index, addresses))
            worker_env.setdefault("PYTHONUNBUFFERED", "1")
            process = subprocess.Popen(
                [python or sys.executable, str(script), *args],
                env=worker_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            )
            processes.append(process)
            pump = threading.Thread(
                target=out.pump, args=(f"[worker {index}]", process.stdout), daemon=True
            )
            pump.start()
            pumps.append(pump)
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in processes]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                _stop(processes, out, f"worker {failed[0]} exited with status {codes[failed[0]]}")
                break
            if all(c is not None for c in codes):
                break
            if time.monotonic() > deadline:
                _stop(processes, out, f"timeout after {timeout:g} s")
                break
            time.sleep(0.05)
    finally:
        _stop(processes, out, "launcher interrupted")
        for pump in pumps:
            pump.join(timeout=_GRACE_SECONDS)
    return [p.returncode for p in processes]
