"""The container stage where no container engine can start (`make test-containers`, CI's last
stage): tools/containers.sh says why and exits 0, so CI goes on. Run for real, with the machine's
tools taken away: a PATH with no docker, dockerd or apt-get, then a dockerd that dies at its
start. Neither needs a container engine, and the skip comes before any wheel or image."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "containers.sh"
# What the script runs before it knows whether an engine can start.
TOOLS = ["bash", "dirname", "id", "mkdir", "seq", "sleep", "tail", "tr", "cat", "ps"]


def _bin_with(tmp_path: Path, fakes: dict[str, str]) -> Path:
    """A folder for PATH holding the tools the script needs and the given stand-ins."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is not on this machine's PATH"
        (folder / tool).symlink_to(found)
    for name, body in fakes.items():
        (folder / name).write_text("#!/bin/bash\n" + body + "\n")
        (folder / name).chmod(0o755)
    return folder


def _stage(tmp_path: Path, folder: Path) -> subprocess.CompletedProcess:
    env = {"PATH": str(folder), "HOME": str(tmp_path), "RLH_CONTAINER_OUT": str(tmp_path / "out")}
    return subprocess.run(["/bin/bash", str(SCRIPT), "stage", "compose"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(os.geteuid() != 0 and shutil.which("sudo") is not None,
                    reason="the script runs dockerd through sudo when not root")
def test_no_docker_on_path_and_none_installable_skips_the_stage_with_the_reason(tmp_path):
    run = _stage(tmp_path, _bin_with(tmp_path, {}))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("test-containers: skipped: no container engine can start here")
    assert "no docker and dockerd on PATH, and Debian's docker.io did not install" in run.stderr


@pytest.mark.skipif(os.geteuid() != 0 and shutil.which("sudo") is not None,
                    reason="the script runs dockerd through sudo when not root")
def test_a_dockerd_that_cannot_start_skips_the_stage_with_its_own_words(tmp_path):
    fakes = {"docker": "exit 1",  # `docker info`: no daemon answers
             "dockerd": 'echo "failed to start daemon: a stand-in that cannot start" >&2; exit 1'}
    run = _stage(tmp_path, _bin_with(tmp_path, fakes))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("test-containers: skipped: no container engine can start here")
    assert "dockerd did not start: failed to start daemon: a stand-in that cannot start" in \
        run.stderr
    assert (tmp_path / "out" / "dockerd.log").is_file()
