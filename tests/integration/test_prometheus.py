"""`rlharvest up --prometheus` as a user runs it: a real Prometheus (the Debian package)
discovers every member through etcd, the trainer's reward series reads back through its HTTP API
with the values the trainer reported for its steps, and a member that joins later is scraped
too."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from rlharvest.common.local_etcd import free_port
from rlharvest.cli.launcher import MODULES
from rlharvest.cli.prometheus_stack import api

from .test_cli import CLI, ENV, _endpoints, _read_until
from .test_trainer import trainer_status

pytestmark = pytest.mark.integration


async def eventually(query, check, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while True:
        result = await asyncio.to_thread(query)
        if check(result):
            return result
        assert time.monotonic() < deadline, result
        await asyncio.sleep(0.5)


def reward_points(url: str, since: float) -> list[float]:
    """The trainer's mean-reward series since ``since``, where at least one step is done (the
    gauge reads 0 before the first step)."""
    series = api(url, "query_range", query="rlh_trainer_mean_reward and rlh_trainer_step > 0",
                 start=since, end=time.time(), step="0.5")["result"]
    return [float(value) for s in series for _, value in s["values"]]


async def test_up_with_prometheus_reads_the_trainers_reward_series_back_and_finds_late_members(
        tmp_path):
    since = time.time()
    up = subprocess.Popen([*CLI, "up", "--workers", "1", "--agents", "1", "--trainer",
                           "--prometheus", "--prometheus-port", str(free_port()),
                           "--log-dir", str(tmp_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=ENV)
    late = None
    try:
        etcd = _read_until(up, r"etcd at (127\.0\.0\.1:\d+)", timeout=180).group(1)
        url = _read_until(up, r"Prometheus at (http://\S+)", timeout=30).group(1)
        members = await _endpoints(etcd)
        [trainer] = [endpoint for key, endpoint in members.items() if "/trainer/" in key]

        points = await eventually(lambda: reward_points(url, since), lambda p: len(p) >= 3)
        steps = (await trainer_status(trainer)).steps
        # Every scraped value is the mean reward the trainer reported for one of its steps.
        assert set(points) <= {s.mean_reward for s in steps}, (points, steps)
        every = {"trainer", "rollout_manager", "rollout_worker", "transfer_agent"}
        await eventually(lambda: api(url, "query", query="up == 1")["result"],
                         lambda up: every <= {r["metric"]["service"] for r in up})

        groups = api(url, "rules")["groups"]
        assert "RlharvestTokensRegenerated" in {r["name"] for g in groups for r in g["rules"]}

        late = subprocess.Popen(  # a member that joins is discovered through etcd
            [sys.executable, "-m", MODULES["rollout_worker"], "--etcd", etcd, "--worker-id",
             "late", "--port", str(free_port()), "--metrics-port", str(free_port()),
             "--torch-threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await eventually(lambda: api(url, "query", query='up{member="late"} == 1')["result"],
                         bool)
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        for proc in (late, up):
            if proc is not None and proc.poll() is None:
                proc.kill()
