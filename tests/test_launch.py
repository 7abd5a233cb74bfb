"""The local launcher: TF_CONFIG per worker, prefixed output, a failing or
hung worker stops the job, the timeout bounds it. Plain Python workers (no
TensorFlow): each test takes well under a few seconds."""

import io
import json
import sys
import time

import pytest

from keras_gradboost import launcher as launch_lib
from keras_gradboost.launcher import launch


def _script(tmp_path, text):
    path = tmp_path / "worker.py"
    path.write_text(text)
    return path


def test_each_worker_gets_its_tf_config_and_prefixed_lines(tmp_path):
    script = _script(
        tmp_path,
        "import json, os, sys\n"
        "config = json.loads(os.environ['TF_CONFIG'])\n"
        "print(json.dumps(config))\n"
        "print('args', *sys.argv[1:])\n",
    )
    out = io.StringIO()
    assert launch(script, ["a", 3], workers=3, timeout=30, output=out) == [0, 0, 0]
    lines = out.getvalue().splitlines()
    configs = {}
    for i in range(3):
        mine = [l[len(f"[worker {i}] "):] for l in lines if l.startswith(f"[worker {i}] ")]
        assert mine[1] == "args a 3"
        configs[i] = json.loads(mine[0])
    cluster = configs[0]["cluster"]["worker"]
    assert len(set(cluster)) == 3 and all(a.startswith("127.0.0.1:") for a in cluster)
    for i, config in configs.items():
        assert config == {"cluster": {"worker": cluster}, "task": {"type": "worker", "index": i}}


def test_a_failing_worker_stops_the_others(tmp_path):
    script = _script(
        tmp_path,
        "import json, os, sys, time\n"
        "if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1:\n"
        "    sys.exit(3)\n"
        "time.sleep(60)\n",
    )
    out = io.StringIO()
    start = time.monotonic()
    codes = launch(script, workers=2, timeout=50, output=out)
    assert time.monotonic() - start < 20
    assert codes[1] == 3 and codes[0] < 0  # stopped by a signal
    assert "worker 1 exited with status 3: stopping worker(s) [0]" in out.getvalue()


def test_the_timeout_stops_a_worker_that_ignores_sigterm(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_lib, "_GRACE_SECONDS", 0.5)
    script = _script(
        tmp_path,
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n",
    )
    out = io.StringIO()
    start = time.monotonic()
    codes = launch(script, workers=1, timeout=2, output=out)
    assert time.monotonic() - start < 10
    assert codes == [-9]
    assert "timeout after 2 s" in out.getvalue()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(workers=0), r"argument `workers`\. Received: workers=0\. Expected an int >= 1"),
        (dict(workers=True), r"workers=True"),
        (dict(timeout=0), r"argument `timeout`\. Received: timeout=0\. Expected a number"),
        (dict(timeout=None), r"timeout=None"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, kwargs, match):
    script = _script(tmp_path, "")
    with pytest.raises(ValueError, match=match):
        launch(script, **kwargs)


def test_a_missing_script_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"argument `script`.*existing Python file"):
        launch(tmp_path / "missing.py")


def test_free_ports_are_distinct():
    ports = launch_lib.free_ports(4)
    assert len(set(ports)) == 4 and all(0 < p < 65536 for p in ports)


def test_launch_uses_this_python_by_default(tmp_path):
    script = _script(tmp_path, "import sys; print(sys.executable)\n")
    out = io.StringIO()
    assert launch(script, workers=1, timeout=30, output=out) == [0]
    assert out.getvalue().strip() == f"[worker 0] {sys.executable}"


def test_cli_launch_runs_the_workers_and_returns_a_failed_status(tmp_path, capsys):
    from keras_gradboost import cli

    script = _script(
        tmp_path,
        "import json, os, sys\n"
        "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "print('worker', index, 'of', sys.argv[1:])\n"
        "sys.exit(int(sys.argv[1]) if index == 1 else 0)\n",
    )
    assert cli.main(["launch", "--workers", "2", "--timeout", "30", str(script), "0"]) == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == ["[worker 0] worker 0 of ['0']", "[worker 1] worker 1 of ['0']"]
    assert cli.main(["launch", str(script), "5", "--flag"]) == 5
    assert "[worker 1] worker 1 of ['5', '--flag']" in capsys.readouterr().out
    assert cli.launch_status([-15, 3]) == 3 and cli.launch_status([-9, -15]) == 137


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["launch", "--workers", "0", "s.py"],
            "argument --workers: invalid value 0; expected an int >= 1",
        ),
        (
            ["launch", "--timeout", "-1", "s.py"],
            "argument --timeout: invalid value -1; expected a number of seconds > 0",
        ),
        (
            ["launch", "missing.py"],
            "argument script: invalid value 'missing.py'; expected the path of an "
            "existing Python file",
        ),
    ],
)
def test_cli_launch_bad_arguments_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    from keras_gradboost import cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
