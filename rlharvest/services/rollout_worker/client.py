"""The rollout worker's client: the manager's Session stream to one worker, commands down,
events up.

Writes go through a queue drained by one writer task (grpc.aio allows one write at a time) so
callers never block on a slow worker; commands keep their order, which is what makes an abort
followed by a re-add of the same request on the same worker safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc

from rlharvest.common import rpc
from rlharvest.common.engine_types import SESSION_JOB_METADATA, sampling_to_proto
from rlharvest.common.pb import rollout_worker_pb2 as pb, rollout_worker_pb2_grpc

if TYPE_CHECKING:  # the manager's type; the worker package does not import the manager
    from rlharvest.services.rollout_manager.tracker import ResumePayload

log = logging.getLogger(__name__)

EventHandler = Callable[[str, pb.WorkerEvent], Awaitable[None]]
BrokenHandler = Callable[[str, str], None]

# The role a worker's certificate must name, by the kind it registered as: co-executors serve
# rollouts under their own role, the trainer's seed role under the trainer's.
_ROLE_OF_KIND = {"serving": "coexecutor", "seed": "trainer"}


def session_role(kind: str) -> str:
    """The role the manager checks in the handshake with a worker of ``kind`` (under TLS):
    a peer of another role registered in etcd as a worker gets no session."""
    return _ROLE_OF_KIND.get(kind, "worker")


class WorkerLink:
    def __init__(self, worker_id: str, endpoint: str, on_event: EventHandler,
                 on_broken: BrokenHandler, max_message_bytes: int, peer_role: str = "worker",
                 job: str = "", start_weights: Callable[[], str] = lambda: ""):
        """``job``: the manager's, named on the session (the worker keeps requests per job)
        and on every add; ``start_weights()``: the job's start-weights fingerprint, sent with
        version-0 adds (the worker refuses them if its own differ)."""
        self.worker_id = worker_id
        self.job = job
        self._start_weights = start_weights
        self.endpoint = endpoint
        self._on_event = on_event
        self._on_broken = on_broken
        self.peer_role = peer_role
        self._channel = rpc.channel(endpoint, max_message_bytes=max_message_bytes,
                                    peer_role=peer_role)
        self._call = rollout_worker_pb2_grpc.RolloutWorkerStub(self._channel).Session(
            metadata=((SESSION_JOB_METADATA, job),))
        self._outbox: asyncio.Queue[pb.WorkerCommand] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._write(), name=f"write {worker_id}"),
                       asyncio.create_task(self._read(), name=f"read {worker_id}")]
        self.alive = True
        self.greeted = False  # its first event came (the requests it keeps come first)
        self.last_load: pb.WorkerEvent | None = None

    def add(self, payload: ResumePayload) -> None:
        self._outbox.put_nowait(pb.WorkerCommand(add=pb.AddRequest(
            request_id=payload.request_id, prompt_token_ids=payload.prompt_token_ids,
            generated_token_ids=payload.generated_token_ids,
            sampling=sampling_to_proto(payload.sampling), weight_version=payload.weight_version,
            handle=payload.handle, job=self.job,
            start_weights=self._start_weights() if payload.weight_version == 0 else "")))

    def abort(self, request_ids: list[str]) -> None:
        if self.alive and request_ids:
            self._outbox.put_nowait(
                pb.WorkerCommand(abort=pb.AbortRequest(request_ids=request_ids)))

    async def _write(self) -> None:
        try:
            while True:
                await self._call.write(await self._outbox.get())
                self._outbox.task_done()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader sees the same break and reports it
            log.debug("write to %s failed: %r", self.worker_id, exc)

    async def _read(self) -> None:
        reason = "stream ended"
        try:
            async for event in self._call:
                self.greeted = True
                await self._on_event(self.worker_id, event)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            reason = f"stream broke: {exc.code().name} {rpc.error_text(exc, self.peer_role)}"
        except Exception as exc:
            log.exception("handling an event of %s failed", self.worker_id)
            reason = f"event handling failed: {exc!r}"
        self.alive = False
        self._on_broken(self.worker_id, reason)

    async def close(self, flush_s: float = 1.0) -> None:
        """Close the session, after the commands queued (up to ``flush_s``): aborts of the
        requests a manager lets go of must reach a worker that is still there, or it would
        keep them running for a successor (rlharvest/common/worker_core/session_hub.py)."""
        if self.alive and not self._outbox.empty():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._outbox.join(), flush_s)
        self.alive = False
        for task in self._tasks:
            task.cancel()
        self._call.cancel()
        await self._channel.close()
