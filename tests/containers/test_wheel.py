"""The wheel as a user gets it (part of `make test-containers`; no container engine needed):
`python -m build`, the wheel installed into a fresh virtual environment outside the checkout
(its dependencies from the wheelhouse `make image` made, no index), and from there `rlharvest up`
brings the local stack up and stops it on Ctrl-C, and the demo trains."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(os.environ.get("RLH_WHEELHOUSE", ROOT / "build" / "containers" / "wheelhouse"))

pytestmark = pytest.mark.skipif(
    os.environ.get("RLH_CONTAINER_STAGE") != "1",
    reason="the container stage: `make test-containers` makes the wheelhouse and runs this")


@pytest.fixture(scope="module")
def venv() -> Iterator[Path]:
    """A fresh venv, outside the checkout, holding the wheel `python -m build` made. In a folder
    of its own, not pytest's tmp_path: other pytest runs on the machine prune those."""
    work = Path(tempfile.mkdtemp(prefix="rlharvest-wheel-"))
    assert not work.resolve().is_relative_to(ROOT)
    try:
        yield _install(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _install(work: Path) -> Path:
    # Run from the work folder: the checkout's build/ folder would shadow the `build` module.
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(work / "dist"),
                    str(ROOT)], check=True, capture_output=True, timeout=600, cwd=work,
                   env=_env(None))
    (wheel,) = (work / "dist").glob("rlharvest-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True, timeout=120)
    subprocess.run([str(work / "venv" / "bin" / "pip"), "install", "-q", "--no-index",
                    "--find-links", str(WHEELHOUSE), str(wheel)], check=True, timeout=900,
                   cwd=work, env=_env(None))
    return work / "venv"


def _env(venv: Path | None) -> dict[str, str]:
    """This environment without the checkout: tests/conftest.py puts it on PYTHONPATH for the
    processes tests start, which would hand pip and Python the checkout's rlharvest instead."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    path = f"{venv / 'bin'}:{env['PATH']}" if venv else env["PATH"]
    return {**env, "PATH": path, "PYTHONUNBUFFERED": "1"}


def test_the_installed_wheel_is_what_runs(venv: Path):
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import rlharvest, rlharvest.common.pb.rollout_manager_pb2 as pb;"
                            "print(rlharvest.__file__)"],
                           cwd=venv.parent, env=_env(venv), capture_output=True, text=True,
                           check=True).stdout.strip()
    assert Path(where).is_relative_to(venv), where


def test_rlharvest_up_from_the_wheel_starts_the_stack_and_stops_on_ctrl_c(venv: Path):
    log = venv.parent / "up.log"
    with log.open("w") as out:
        up = subprocess.Popen([str(venv / "bin" / "rlharvest"), "up", "--workers", "1",
                               "--spot", "0", "--coexecutors", "0", "--log-dir",
                               str(venv.parent / "up-logs")], cwd=venv.parent, env=_env(venv),
                              stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while "rlharvest is up" not in log.read_text():
                assert up.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(1)
        finally:
            up.send_signal(signal.SIGINT)
            rc = up.wait(timeout=90)
    assert rc == 0 and "stopped" in log.read_text(), log.read_text()


def test_the_demo_from_the_wheel_trains(venv: Path):
    """`make run`'s demo as it ships (20 steps, a spot worker killed mid-step): it exits 0 only
    if the reward rose."""
    demo = subprocess.run([str(venv / "bin" / "python"), "-m", "rlharvest.cli.demo"],
                          cwd=venv.parent, env=_env(venv), capture_output=True, text=True,
                          timeout=600)
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    assert (venv.parent / "demo-out" / "steps.json").is_file()
