"""`keras-gradboost compare`'s rows forked from one server
(keras_gradboost/row_server.py) against rows in an interpreter of their
own: the same row, the server reused, another one for another
environment or interpreter, a child killed at its timeout, a server killed
during a row (its child with it), and the interpreter where the server
cannot start. (test_cli.py: a relative path in the parent's working
directory, and the Dropout seeds of a forked row and a fresh one.)"""

import os
import signal
import sys
import threading
import time
import warnings

import pytest

from keras_gradboost import compare
from keras_gradboost import row_server

SPEC = {"config": "baseline", "kwargs": compare.CONFIGS["baseline"], "model": "mlp",
        "batch_size": 8, "steps": 3}
# What a row measures the same way in any process (not its times or peak).
SAME = ("final_loss", "retraces", "step_flops", "step_flops_by_dtype", "policy",
        "xla", "notes")


@pytest.fixture
def server():
    """`compare`'s own server (each start imports TensorFlow, about 6 s:
    shared with the other tests of this worker that run rows)."""
    return compare._ROW_SERVER


def _row(server, env, timeout=600):
    result = server.run([compare.json.dumps(SPEC)], env, timeout)
    assert result is not None and result != "timeout", result
    returncode, stdout, stderr = result
    assert returncode == 0, stderr[-2000:]
    return compare.json.loads(stdout.splitlines()[-1])


def test_a_forked_row_is_the_row_of_a_fresh_interpreter(server, monkeypatch):
    env = dict(os.environ)
    forked = _row(server, env)
    pid = server._process.pid
    again = _row(server, env)
    assert server._process.pid == pid  # one server, a child per row
    monkeypatch.setattr(compare._ROW_SERVER, "run", lambda *args: None)
    fresh = compare.run_one(SPEC)
    for key in SAME:
        assert forked.get(key) == fresh.get(key) == again.get(key), key
    assert forked["step_ms"] > 0 and forked["peak_mib"] is not None


class _FakeServer:
    """Stands for the server process: alive, answers each request with exit
    status 0 and writes the child's output files."""

    def __init__(self, env):
        self.env = env

    def poll(self):
        return None


def test_another_environment_or_interpreter_starts_another_server(monkeypatch):
    server = row_server.RowServer()
    started = []

    def start(env, key):
        started.append(env)
        server._process = _FakeServer(env)
        return True

    def ask(request, timeout):
        for key in ("stdout", "stderr"):
            with open(request[key], "w") as f:
                f.write(key)
        return {"id": request["id"], "returncode": 0}

    monkeypatch.setattr(server, "_start", start)
    monkeypatch.setattr(server, "_ask", ask)
    monkeypatch.setattr(server, "close", lambda kill=False: None)
    env = {"A": "1"}
    assert server.run(["{}"], env, 60) == (0, "stdout", "stderr")
    server.run(["{}"], dict(env), 60)
    assert started == [env]  # the same environment: the same server
    server.run(["{}"], {"A": "2"}, 60)
    monkeypatch.setattr(sys, "executable", sys.executable + "-other")
    server.run(["{}"], {"A": "2"}, 60)
    assert started == [env, {"A": "2"}, {"A": "2"}]
    # pytest's name of the running test: not a new server (each test's rows
    # would start one).
    server.run(["{}"], {"A": "2", "PYTEST_CURRENT_TEST": "t"}, 60)
    assert len(started) == 3
    server._process = None  # nothing for the close registered at exit to stop


def test_closing_a_server_removes_its_log(tmp_path):
    # (`run` closes the server before starting one for another environment.)
    server = row_server.RowServer()
    log = tmp_path / "kgb-row-server-x.log"
    log.write_text("what the server said\n")
    server._log = str(log)
    server.close()
    assert not log.exists() and server._log is None


def test_a_child_past_its_timeout_is_killed_and_the_server_goes_on(server):
    env = dict(os.environ)
    slow = {**SPEC, "steps": 100_000}
    assert server.run([compare.json.dumps(slow)], env, timeout=3) == "timeout"
    pid = server._process.pid
    assert "error" not in _row(server, env)
    assert server._process.pid == pid


def _running_in_group(group):
    """The processes of process group `group` that still run (not zombies:
    here an orphan may wait for a parent that never reaps it)."""
    running = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                running.append(int(entry))
    return running


def test_a_server_that_dies_during_a_row_takes_its_child_along_and_says_so(tmp_path):
    # The child closes its copy of the replies' pipe: the parent sees the
    # server's end at once, stops the row's child with it (one process
    # group) and warns; the row then starts in an interpreter of its own.
    server = row_server.RowServer()
    env = dict(os.environ)
    timer = None
    try:
        assert "error" not in _row(server, env)  # started
        group = server._process.pid
        slow = compare.json.dumps({**SPEC, "steps": 100_000})
        timer = threading.Timer(2.0, os.kill, (group, signal.SIGKILL))
        timer.start()
        with pytest.warns(UserWarning, match="the row server stopped answering during a row"):
            assert server.run([slow], env, timeout=600) is None
        timer.join()
        deadline = time.monotonic() + 10  # (SIGKILL lands asynchronously)
        while _running_in_group(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running_in_group(group) == []  # the child too
        assert server.run([slow], env, timeout=600) is None  # not tried again
    finally:
        if timer is not None:
            timer.cancel()
        server.close(kill=True)


def test_where_the_server_cannot_start_the_row_runs_in_an_interpreter(tmp_path, monkeypatch):
    server = row_server.RowServer()
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no TensorFlow here' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    monkeypatch.setattr(row_server.tempfile, "tempdir", str(tmp_path))  # its log
    with pytest.warns(UserWarning, match=r"did not start \(no TensorFlow here\)"):
        assert server.run([compare.json.dumps(SPEC)], dict(os.environ), 60) is None
    assert list(tmp_path.glob("kgb-row-server-*")) == []  # quoted, then removed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: not again
        assert server.run([compare.json.dumps(SPEC)], dict(os.environ), 60) is None
    monkeypatch.delattr(os, "fork")  # not POSIX
    assert row_server.RowServer().run([compare.json.dumps(SPEC)], dict(os.environ), 60) is None
