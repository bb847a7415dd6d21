"""A rollout worker whose engine runs in its own process (``--engine-process``): it
serves sessions as the single-process worker does; SIGKILL of the worker takes the engine
process with it (no orphan holding the GPU), and SIGKILL of the engine process stops the worker
(a broken engine must not look like a healthy worker)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from rlharvest.models.tokenizer import CharTokenizer

from tests.worker_sessions import add

from .worker_client import WorkerSession, start_worker

pytestmark = pytest.mark.integration
PROMPT = CharTokenizer().encode("12+7=")


def engine_child(worker_pid: int) -> psutil.Process:
    """The worker's spawned engine process (not multiprocessing's resource tracker)."""
    children = [c for c in psutil.Process(worker_pid).children()
                if "spawn_main" in " ".join(c.cmdline())]
    assert len(children) == 1, [c.cmdline() for c in psutil.Process(worker_pid).children()]
    return children[0]


def gone_within(process: psutil.Process, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


async def test_a_worker_with_its_engine_in_a_process_serves_the_same_tokens(stack):
    split = start_worker(stack, "split", "--max-running", "4", "--engine-process")
    plain = start_worker(stack, "plain", "--max-running", "4")
    got = {}
    for handle in (split, plain):
        session = WorkerSession(handle.endpoint)
        ids = [f"r{i}" for i in range(3)]
        await session.send(*(add(r, PROMPT, max_tokens=12, seed=i) for i, r in enumerate(ids)))
        collected = await session.finish(ids)
        got[handle.endpoint] = {r: collected.completions[r].tokens for r in ids}
        await session.close()
    assert got[split.endpoint] == got[plain.endpoint]
    assert all(len(tokens) == 12 for tokens in got[split.endpoint].values())


def test_sigkill_of_the_worker_takes_its_engine_process_with_it(stack):
    handle = start_worker(stack, "killed", "--engine-process")
    child = engine_child(handle.process.process.pid)
    os.kill(handle.process.process.pid, signal.SIGKILL)  # the worker alone, not its group
    handle.process.process.wait()
    assert gone_within(child, 10), "the engine process outlived its worker"


def test_sigkill_of_the_engine_process_stops_the_worker(stack):
    handle = start_worker(stack, "broken", "--engine-process")
    engine_child(handle.process.process.pid).send_signal(signal.SIGKILL)
    # The pump's next call fails: the worker stops (nonzero) instead of serving nothing.
    deadline = time.monotonic() + 20
    while handle.process.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not handle.process.alive() and handle.process.process.poll() != 0
    assert "engine process is gone" in handle.process.log_tail(200)
