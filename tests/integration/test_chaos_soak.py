"""The chaos soak, short (`make chaos MINUTES=N` runs it long): the whole local stack trains
while a seeded plan SIGKILLs a worker, the leading manager, the agent, etcd, the co-executor and
the trainer (once at a random instant, once between a step's optimizer step and its checkpoint),
and at the end the trained lineage is exact, no token was regenerated, no completion mixed
versions, one manager leads and no process exited by itself (rlharvest/cli/chaos.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_a_short_chaos_soak_keeps_every_promise(tmp_path) -> None:
    run = subprocess.run([sys.executable, "-m", "rlharvest.cli.chaos", "--minutes", "0.35",
                          "--seed", "5", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=400)
    out = run.stdout
    assert run.returncode == 0 and "chaos soak passed" in out, out + run.stderr[-3000:]
    assert "faults survived:" in out and "tokens regenerated: 0" in out, out
