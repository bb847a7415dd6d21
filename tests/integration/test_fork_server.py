"""The fork server starts real processes that behave as `python -m <module>` would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlharvest.common.fork_server import ForkServer
from rlharvest.cli.launcher import child_environment

TARGET = "tests.integration.fork_target"


@pytest.fixture(scope="module")
def server():
    started = ForkServer([TARGET], child_environment()).start()
    yield started
    started.close()


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_forked_module_runs_as_main_with_its_argv_env_cwd_session_and_log(server, tmp_path,
                                                                           monkeypatch):
    log = tmp_path / "out.log"
    log.write_text("earlier line\n")
    env = {**child_environment(), "RLH_FORK_PROBE": "probe-value"}
    monkeypatch.chdir(tmp_path)  # the server's cwd is not the child's: the caller's is
    proc = server.spawn(TARGET, ["exit", "0"], env, log)
    assert os.getpgid(proc.pid) == proc.pid  # its session exists when spawn returns: killpg works
    assert proc.wait(timeout=20) == 0
    text = log.read_text()
    assert text.startswith("earlier line\n")  # appended, like the launcher's own logs
    assert f"argv=['exit', '0'] cwd={tmp_path} env=probe-value" in text
    assert f"sid={proc.pid} pid={proc.pid} main=__main__" in text  # its own session


@pytest.mark.parametrize(("args", "code"), [(["exit", "3"], 3), (["raise"], 1)])
def test_exit_codes_are_a_fresh_interpreters(server, tmp_path, args, code):
    log = tmp_path / "out.log"
    proc = server.spawn(TARGET, args, child_environment(), log)
    assert proc.wait(timeout=20) == code
    assert proc.poll() == code  # asked again: the same answer, not a reaped pid's
    if code == 1:
        assert "ValueError: the module failed" in log.read_text()


def test_exit_waits_for_non_daemon_threads_as_an_interpreter_does(server, tmp_path):
    proc = server.spawn(TARGET, ["thread"], child_environment(), tmp_path / "out.log")
    assert proc.wait(timeout=20) == 0
    assert "thread done" in (tmp_path / "out.log").read_text()


def test_sigterm_is_handled_by_the_module_and_sigkill_kills(server, tmp_path):
    graceful = server.spawn(TARGET, ["serve"], child_environment(), tmp_path / "a.log")
    killed = server.spawn(TARGET, ["serve"], child_environment(), tmp_path / "b.log")
    _wait_for(lambda: "main=__main__" in (tmp_path / "a.log").read_text(errors="ignore"))
    assert graceful.poll() is None and killed.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        graceful.wait(timeout=0.1)
    graceful.terminate()
    os.killpg(killed.pid, signal.SIGKILL)  # what ServiceProcess.kill does
    assert graceful.wait(timeout=20) == 0
    assert killed.wait(timeout=20) == -signal.SIGKILL


def test_only_environments_that_cannot_change_the_imports_are_forked(server):
    env = child_environment()
    assert server.can_fork(env)
    assert server.can_fork({**env, "RLH_ETCD_USERNAME": "root"})
    assert not server.can_fork({**env, "OMP_NUM_THREADS": "1"})
    assert not server.can_fork({**env, "PYTHONPATH": "/elsewhere"})


CLIENT = """
import sys, time
from rlharvest.common.fork_server import ForkServer
from rlharvest.cli.launcher import child_environment
server = ForkServer(["json"], child_environment()).start()
print(server._process.pid, flush=True)
time.sleep(600)
"""


def test_the_server_leaves_when_its_client_is_sigkilled():
    client = subprocess.Popen([sys.executable, "-c", CLIENT], stdout=subprocess.PIPE, text=True,
                              env=child_environment())
    assert client.stdout is not None
    server_pid = int(client.stdout.readline())
    client.kill()
    client.wait()
    _wait_for(lambda: not Path(f"/proc/{server_pid}").exists()
              or "Z" in Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1][:3])


def test_a_preload_that_imports_grpc_is_refused():
    with pytest.raises(RuntimeError, match="fork server failed to start"):
        ForkServer(["grpc"], child_environment()).start()
