"""A worker the manager lost while its etcd record stands is joined again once its endpoint
answers (the manager's shell, workers.py, over real sockets): a first connection that timed out
while hundreds of workers joined at once no longer leaves it out for good."""

from __future__ import annotations

import asyncio
import socket

from rlharvest.services.rollout_manager import workers as workers_module
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.workers import Workers
from tests.builders import Clock


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shell() -> tuple[Workers, RolloutControl]:
    control = RolloutControl(ControlConfig(job="j"), Clock())

    async def on_event(worker_id, event):
        return None

    workers = Workers(control, None, job="j", max_message_bytes=1 << 20, on_event=on_event,
                      execute=lambda commands: None, wake=lambda: None, observers=())
    return workers, control


def record(port: int) -> dict:
    return {"job": "j", "endpoint": f"127.0.0.1:{port}", "weight_version": 0, "capacity": 4}


async def until(predicate, timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_a_lost_worker_whose_record_stands_is_joined_once_it_answers(monkeypatch):
    monkeypatch.setattr(workers_module, "REJOIN_FIRST_S", 0.05)
    monkeypatch.setattr(workers_module, "REJOIN_MAX_S", 0.2)
    workers, control = shell()
    port = free_port()  # nothing listens yet: the link breaks at once
    workers._note_record("w0", record(port))
    await workers._join("w0", record(port))
    assert await until(lambda: "w0" not in workers.links, 10), "the refused link was not lost"
    await asyncio.sleep(0.5)  # several tries, each refused: not put back in the core's pool
    assert "w0" not in workers.links
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
    try:
        assert await until(lambda: "w0" in workers.links, 5), "not joined once it answered"
        assert "w0" in control.pool
    finally:
        server.close()
        for task in list(workers._rejoins.values()):
            task.cancel()
        for link in list(workers.links.values()):
            await link.close()


async def test_a_worker_whose_record_left_is_not_tried_again(monkeypatch):
    monkeypatch.setattr(workers_module, "REJOIN_FIRST_S", 0.05)
    workers, _ = shell()
    port = free_port()
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
    try:
        workers._note_record("w0", record(port))
        await workers._join("w0", record(port))
        workers.lose("w0", "stream broke")  # its record stands: a rejoin is scheduled
        assert "w0" in workers._rejoins
        workers._note_record("w0", None)  # then etcd says it left
        assert "w0" not in workers._rejoins
        await asyncio.sleep(0.3)
        assert "w0" not in workers.links
    finally:
        server.close()
