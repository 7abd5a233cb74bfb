"""The rows of `keras-gradboost compare`, forked from one process that
imported TensorFlow once.

Each row used to start `python -m keras_gradboost.compare SPEC`: a fresh
interpreter that spent about 5 s of CPU importing TensorFlow and Keras
before its first op (a 2-core AMD EPYC: half of a default row's time).
The server (`python -m keras_gradboost.row_server`) imports them once and
then forks one child per row. Importing creates no TensorFlow runtime (no
op runs, no device is listed: `serve` checks), so each child still starts
its own: allocator pools, XLA caches and traced functions never leak from
one row into the next, as with a fresh interpreter.

The server starts with the environment and interpreter the row would have
had (TensorFlow reads some variables while importing), and `RowServer.run`
starts a new one when they change; each child takes the row's environment
and working directory.
Where there is no `os.fork` (not POSIX), `RowServer.run` returns None and
the caller starts an interpreter per row as before; so it does, with a
warning that says why, where the server cannot start or stops answering
(a row it was running then starts again in an interpreter).
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

# Seconds the server may take to import TensorFlow and Keras before it
# answers its first request (about 5 s on a 2-core CPU; more under load).
START_TIMEOUT_S = 300
# The server answers within a child's timeout plus this (it kills a child
# at its timeout and reports it).
REPLY_GRACE_S = 60
# How often the server looks whether its child has ended.
POLL_S = 0.02
READY = "ready"
# Variables that may change from one row to the next without a new server:
# nothing reads them while importing (pytest names the running test in
# PYTEST_CURRENT_TEST); each child still gets the row's own value.
PER_CALL_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


class RowServer:
    """A server process that forks one child per row (see the module's
    docstring). One per parent process; `close()` stops it (also at exit).
    `keras_gradboost.compare` keeps one (`_run_child`).
    """

    def __init__(self):
        self._process = None
        self._key = None
        self._failed = set()  # keys whose server failed: not tried again
        self._requests = 0
        self._log = None  # the server's standard error (`_start`)
        atexit.register(self.close)

    def run(self, argv, env, timeout):
        """Runs `compare.child_main(argv)` in a child forked from the server.

        Args:
            argv: the child's arguments (`[SPEC]`).
            env: the environment the child would have had; a server started
                with another one is replaced.
            timeout: seconds after which the child is killed.

        Returns:
            `(returncode, stdout, stderr)` as `subprocess.run` gives them
            (a child killed by signal N: -N), `"timeout"` when the child was
            killed at `timeout`, or None when the server cannot run it (the
            caller then starts an interpreter; a warning says why, once).
        """
        if not hasattr(os, "fork"):
            return None
        key = (sys.executable, tuple(sorted(
            (name, value) for name, value in env.items() if name not in PER_CALL_VARIABLES
        )))
        if key in self._failed:
            return None
        if self._process is None or self._process.poll() is not None or key != self._key:
            self.close()
            self._key = None
            try:
                started = self._start(env, key)
            except BaseException:  # (KeyboardInterrupt) not left half started
                self.close(kill=True)
                raise
            if not started:
                return None
            self._key = key
        with tempfile.TemporaryDirectory(prefix="kgb-row-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            self._requests += 1
            request = {"id": self._requests, "argv": argv, "cwd": os.getcwd(),
                       "env": {n: env.get(n) for n in PER_CALL_VARIABLES},
                       "stdout": out, "stderr": err, "timeout": timeout}
            try:
                reply = self._ask(request, timeout + REPLY_GRACE_S)
            except BaseException:  # (KeyboardInterrupt) no child may run on
                self.close(kill=True)
                raise
            if reply is None or reply.get("id") != request["id"]:
                status = self._process.poll()
                how = f" (exit status {status})" if status is not None else ""
                self._fail(key, f"stopped answering during a row{how}", quote=False)
                return None
            if reply.get("timed_out"):
                return "timeout"
            try:
                with open(out, errors="replace") as f_out, open(err, errors="replace") as f_err:
                    return reply["returncode"], f_out.read(), f_err.read()
            except OSError:
                self._fail(key, "forked a child that wrote no output", quote=False)
                return None

    def close(self, kill=False):
        """Stops the server (and removes its log); with `kill=True`, or when
        it does not end within 5 s, kills it and the child running a row (its
        process group)."""
        process, self._process = self._process, None
        log, self._log = self._log, None
        if log is not None:
            _remove(log)
        if process is None:
            return
        try:
            process.stdin.close()  # the server ends at the end of its input
            if not kill:
                process.wait(timeout=5)
                return
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
        process.wait()

    def _fail(self, key, reason, quote=True):
        """Stops the server, and says once why each row of `key` starts an
        interpreter of its own from now on (with `quote`, the last line the
        server wrote to its standard error: why it did not start)."""
        detail = ""
        if quote and self._log is not None:
            try:
                with open(self._log, errors="replace") as f:
                    lines = [line.strip() for line in f if line.strip()]
            except OSError:  # (removed meanwhile) the warning all the same
                lines = []
            detail = f" ({lines[-1][:200]})" if lines else ""
        self.close(kill=True)
        self._failed.add(key)
        warnings.warn(
            f"keras-gradboost compare: the row server {reason}{detail}; each row "
            "starts a Python interpreter of its own instead (about 5 s of CPU "
            "more per row).",
            stacklevel=4,
        )

    def _start(self, env, key):
        # The server's standard error (what it said before failing) goes to
        # a file: the warning quotes its last line.
        log = tempfile.NamedTemporaryFile(prefix="kgb-row-server-", suffix=".log", delete=False)
        self._log = log.name  # removed by `close`
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "keras_gradboost.row_server"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
                start_new_session=True,  # a process group: `close` kills its child too
            )
        except OSError as error:
            self._process = None
            self._fail(key, f"could not start: {error}")
            return False
        finally:
            log.close()
        # (What importing writes to standard output before `main` moves it
        # comes first: skipped.)
        deadline = time.monotonic() + START_TIMEOUT_S
        line = ""
        while line is not None and line != READY:
            line = self._read_line(max(0.0, deadline - time.monotonic()))
        if line != READY:
            self._fail(key, "did not start")
            return False
        return True

    def _ask(self, request, timeout):
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except OSError:
            return None
        line = self._read_line(timeout)
        try:
            return json.loads(line) if line else None
        except json.JSONDecodeError:
            return None

    def _read_line(self, timeout):
        """The server's next line, or None at its end or after `timeout`
        (one request, one reply: nothing waits in the stream's buffer)."""
        ready, _, _ = select.select([self._process.stdout], [], [], timeout)
        if not ready:
            return None
        return self._process.stdout.readline().strip() or None


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _run_forked(request, requests, replies):
    """Forks a child that runs `compare.child_main(request["argv"])` with its
    output in the request's files; returns the reply for the parent."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            # Its output first (a failure below is then reported in it);
            # the replies' descriptor closed, so that the parent sees the
            # server's end even while this child runs.
            os.close(replies.fileno())
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(target, fd)
                os.close(target)
            os.chdir(request["cwd"])
            # The environment is the server's (the same but for these, and
            # for what importing TensorFlow set).
            for name, value in request["env"].items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            from keras_gradboost import compare

            code = compare.child_main(request["argv"])
        except BaseException:  # noqa: BLE001 - the parent reads it as the row's reason
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + request["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"id": request["id"], "returncode": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"id": request["id"], "timed_out": True}
        # The parent sends nothing before this reply: its input readable now
        # is its end (the parent is gone), and the row with it.
        readable, _, _ = select.select([requests], [], [], POLL_S)
        if readable:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os._exit(1)


def serve(requests, replies):
    """The server's loop: imports what a row needs, says `READY`, then one
    reply line per request line until its input ends."""
    import keras  # noqa: F401 - imported once, for every child
    import tensorflow as tf  # noqa: F401

    from keras_gradboost import compare  # noqa: F401
    from keras_gradboost import flops  # noqa: F401
    from keras_gradboost import hooks
    from keras_gradboost import zoo  # noqa: F401

    # A runtime made here would be shared by every child (its thread pools
    # do not survive a fork): then answer nothing, and the parent starts an
    # interpreter per row.
    if hooks.tensorflow_runtime_started():
        print("importing TensorFlow and Keras started TensorFlow's runtime", file=sys.stderr)
        return
    replies.write(READY + "\n")
    replies.flush()
    for line in iter(requests.readline, ""):
        replies.write(json.dumps(_run_forked(json.loads(line), requests, replies)) + "\n")
        replies.flush()


def main():
    # Replies go to a descriptor of their own: what imported code writes to
    # standard output goes to standard error instead.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
