"""`rlharvest up` and `rlharvest status` as a user runs them: real processes, Ctrl-C to stop."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from rlharvest.common import keys, registry, tls
from rlharvest.common.local_etcd import free_port

from .worker_client import listening

pytestmark = pytest.mark.integration
ENV = {**os.environ, "COLUMNS": "240", "TERM": "dumb", "NO_COLOR": "1"}
CLI = [sys.executable, "-m", "rlharvest.cli.main"]


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float,
                seen: list[str] | None = None) -> re.Match:
    """The first line matching ``pattern``; every line read is appended to ``seen``."""
    deadline = time.monotonic() + timeout
    seen = [] if seen is None else seen
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    raise AssertionError(f"no {pattern!r} in the output of rlharvest up:\n{''.join(seen)}")



async def _endpoints(etcd: str) -> dict[str, str]:
    client = await registry.connect(etcd)
    try:
        members = await registry.list_members(client)
    finally:
        await client.close()
    return {key: info["endpoint"] for key, info in members.items()}


def test_up_starts_the_stack_status_shows_it_and_ctrl_c_stops_everything(tmp_path):
    http = free_port()
    up = subprocess.Popen([*CLI, "up", "--workers", "1", "--spot", "1", "--agents", "1",
                           "--coexecutors", "1", "--coexec-http-port", str(http),
                           "--log-dir", str(tmp_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        etcd = _read_until(up, r"etcd at (127\.0\.0\.1:\d+)", timeout=180).group(1)
        endpoints = asyncio.run(_endpoints(etcd))
        assert {k.rsplit("/", 2)[-2] for k in endpoints} == {
            "rollout_worker", "rollout_manager", "transfer_agent", "coexecutor"}
        assert len(endpoints) == 6  # the job's manager and its standby
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models",
                                                   timeout=10).read())
        assert [m["id"] for m in models["data"]] == ["small"]  # the co-executor serves

        shown = subprocess.run([*CLI, "status", "--etcd", etcd], capture_output=True,
                               text=True, env=ENV, timeout=60)
        assert shown.returncode == 0, shown.stderr
        for member in ("worker-0", "worker-1", "manager-0", "manager-1", "agent-0", "spot",
                       "dedicated", "standby"):
            assert member in shown.stdout, shown.stdout
        deadline = time.monotonic() + 60  # the job's manager borrows the co-executor
        while "lent to default" not in shown.stdout:
            assert time.monotonic() < deadline, shown.stdout
            time.sleep(0.5)
            shown = subprocess.run([*CLI, "status", "--etcd", etcd], capture_output=True,
                                   text=True, env=ENV, timeout=60)
        assert "rollout managers" in shown.stdout and "default" in shown.stdout

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert "stopped" in up.stdout.read()
        assert not any(listening(e) for e in [*endpoints.values(), etcd])
    finally:
        if up.poll() is None:
            up.kill()


def test_up_replays_a_spot_trace_under_the_jobs_instance_cap_with_mutual_tls(tmp_path):
    """App. C's replayer on real processes: the trace's instances start, the cap in etcd stops
    the latest one, a preemption SIGKILLs its instance and an available one starts at once.
    With --tls every instance serves with a certificate of the stack's CA, and etcd wants one
    too (an https endpoint; this test writes the cap as `up`'s operator)."""
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,event,instance\n0,add,spot-a\n0,add,spot-b\n2,add,spot-c\n"
                     "3,remove,spot-a\n5,remove,spot-c\n")
    up = subprocess.Popen([*CLI, "up", "--workers", "0", "--agents", "0", "--no-manager",
                           "--spot-trace", str(trace), "--trace-seconds", "20", "--tls",
                           "--log-dir", str(tmp_path / "logs")], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=ENV)
    pki = tmp_path / "logs" / "pki"
    try:
        etcd = _read_until(up, r"etcd at (https://127\.0\.0\.1:\d+)", timeout=180).group(1)
        tls.configure(str(pki / "operator.pem"), str(pki / "operator.key"), str(pki / "ca.pem"))
        seen: list[str] = []
        _read_until(up, r"1 allocations, 2 preemptions", timeout=30, seen=seen)
        _read_until(up, r"start spot-a", timeout=30, seen=seen)
        _read_until(up, r"start spot-b", timeout=30, seen=seen)
        asyncio.run(_put_cap(etcd, 1))
        _read_until(up, r"stop spot-b", timeout=30, seen=seen)  # the latest started leaves
        _read_until(up, r"kill spot-a", timeout=30, seen=seen)  # preempted at 3/5 of 20 s
        _read_until(up, r"start spot-b", timeout=30, seen=seen)  # at once, the first available
        # spot-c was available from 8 s, but the cap of 1 never let it run.
        assert not any("start spot-c" in line for line in seen), seen
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        # Every instance got a certificate of the stack's CA for its role, and none failed to
        # start with it (whether one served before the trace stopped it is the CPU's timing;
        # test_tls.py runs a whole job over TLS).
        assert (pki / "ca.pem").is_file()
        for name in ("spot-a", "spot-b"):
            assert (pki / f"{name}.pem").is_file() and (pki / f"{name}.key").is_file(), name
            log = (tmp_path / "logs" / f"{name}.log").read_text()
            assert "failed to start" not in log, log[-2000:]
    finally:
        tls.configure("", "", "")
        if up.poll() is None:
            up.kill()


async def _put_cap(etcd: str, n_prem: int) -> None:
    client = await registry.connect(etcd)
    try:
        await client.put(keys.instance_cap_key("default").encode(),
                         registry.instance_cap_record(n_prem))
    finally:
        await client.close()


def test_status_without_etcd_says_so():
    shown = subprocess.run([*CLI, "status", "--etcd", "127.0.0.1:1", "--timeout", "1"],
                           capture_output=True, text=True, env=ENV, timeout=60)
    assert shown.returncode == 1
    assert "etcd at 127.0.0.1:1 did not answer" in shown.stdout
    assert "Traceback" not in shown.stdout + shown.stderr
