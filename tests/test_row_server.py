"""`keras-gradboost compare`'s rows forked from one server
(keras_gradboost/row_server.py) against rows in an interpreter of their
own: the same row, the server reused, another one for another
environment or interpreter, a child killed at its timeout, and the interpreter where the
server cannot start. (test_cli.py: a relative path in the parent's working
directory, and the Dropout seeds of a forked row and a fresh one.)"""

import os
import sys

import pytest

from keras_gradboost import compare
from keras_gradboost import row_server

SPEC = {"config": "baseline", "kwargs": compare.CONFIGS["baseline"], "model": "mlp",
        "batch_size": 8, "steps": 3}
# What a row measures the same way in any process (not its times or peak).
SAME = ("final_loss", "retraces", "step_flops", "step_flops_by_dtype", "policy",
        "xla", "notes")


@pytest.fixture(scope="module")
def server():
    """One server for the module's tests (each start imports TensorFlow)."""
    started = row_server.RowServer()
    yield started
    started.close()


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

    def start(env):
        started.append(env)
        server._process = _FakeServer(env)
        return True

    def ask(request, timeout):
        for key in ("stdout", "stderr"):
            with open(request[key], "w") as f:
                f.write(key)
        return {"returncode": 0}

    monkeypatch.setattr(server, "_start", start)
    monkeypatch.setattr(server, "_ask", ask)
    monkeypatch.setattr(server, "close", lambda: None)
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


def test_a_child_past_its_timeout_is_killed_and_the_server_goes_on(server):
    env = dict(os.environ)
    slow = {**SPEC, "steps": 100_000}
    assert server.run([compare.json.dumps(slow)], env, timeout=3) == "timeout"
    pid = server._process.pid
    assert "error" not in _row(server, env)
    assert server._process.pid == pid


def test_where_the_server_cannot_start_the_row_runs_in_an_interpreter(tmp_path, monkeypatch):
    server = row_server.RowServer()
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    assert server.run([compare.json.dumps(SPEC)], dict(os.environ), 60) is None
    monkeypatch.delattr(os, "fork")  # not POSIX
    assert server.run([compare.json.dumps(SPEC)], dict(os.environ), 60) is None
