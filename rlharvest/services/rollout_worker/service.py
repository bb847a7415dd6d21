"""The rollout worker's gRPC shell: the worker core (``rlharvest/common/worker_core/``) composed with the
rollout admission policy and served as the ``RolloutWorker`` contract. Receive, call the core,
send: the session protocol, the step loop and the policy live in their own modules."""

from __future__ import annotations

import asyncio

from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import grpc

from rlharvest.common import errors
from rlharvest.common.confined_path import descriptor_path, open_confined
from rlharvest.common.engine_types import SESSION_JOB_METADATA, EngineInputError
from rlharvest.common.pb import rollout_worker_pb2 as pb, rollout_worker_pb2_grpc
from rlharvest.common.worker_core import metrics
from rlharvest.common.worker_core.admission import Admission
from rlharvest.common.worker_core.engine import Engine
from rlharvest.common.worker_core.engine_pump import EnginePump
from rlharvest.common.worker_core.session_commands import SessionCommands
from rlharvest.common.worker_core.session_hub import RoutedStep, SessionHub
from rlharvest.services.rollout_worker.admission import RolloutAdmission

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class WorkerService(rollout_worker_pb2_grpc.RolloutWorkerServicer):
    """``capacity`` requests run at once and ``max_pending`` more may wait; ``session_queue`` step
    messages are buffered per session; ``on_version_change`` hears every weight swap;
    ``step_delay_s`` (benchmarks only) emulates slower hardware; ``admission`` replaces the
    rollout worker's own policy (the co-executor adds its memory budget); ``LoadWeights`` reads
    only files under ``weights_dir`` (none: it is refused); ``keep_s``: a broken session's
    requests run on this long for a successor manager to adopt (session_hub.py); ``job``: whose
    weights the engine starts with ("" for none yet; every later load names its job)."""

    def __init__(self, engine: Engine, worker_id: str, endpoint: str, model: str, kind: int,
                 capacity: int, max_len: int, session_queue: int = 256,
                 on_version_change: Callable[[int], None] | None = None,
                 step_delay_s: float = 0.0, max_pending: int = 4096,
                 admission: Admission | None = None, weights_dir: str = "",
                 keep_s: float = 0.0, job: str = ""):
        self._engine = engine
        self._weights_dir = weights_dir
        self._info: dict[str, Any] = dict(worker_id=worker_id, endpoint=endpoint, model=model,
                                          kind=kind, capacity=capacity, max_len=max_len)
        self.hub = SessionHub(session_queue, keep_tokens=keep_s > 0)
        self.pump: EnginePump[RoutedStep] = EnginePump(engine, self.hub, step_delay_s=step_delay_s)
        self.commands = SessionCommands(engine, self.hub, self.pump,
                                        admission or RolloutAdmission(capacity, max_pending),
                                        on_version_change=on_version_change, keep_s=keep_s,
                                        job=job)
        metrics.WEIGHT_VERSION.set(engine.weight_version)

    async def run_engine(self) -> None:
        """The engine loop; runs until cancelled, raises if the engine breaks."""
        await self.pump.run()

    # ---- RPCs ----------------------------------------------------------------------------------

    async def Session(self, request_iterator: AsyncIterator[pb.WorkerCommand],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WorkerEvent]:
        metadata = dict(context.invocation_metadata() or ())
        events = self.commands.serve(request_iterator, str(metadata.get(SESSION_JOB_METADATA, "")))
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # the session's requests leave the engine now, not at GC

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.WorkerInfo:
        return pb.WorkerInfo(**self._info, vocab_size=self._engine.vocab_size,
                             weight_version=self._engine.weight_version,
                             load=self.pump.last_load, draining=self.hub.draining,
                             job=self.commands.job, start_weights=self._engine.start_weights)

    async def LoadWeights(self, request: pb.LoadWeightsRequest, context) -> pb.LoadWeightsResponse:
        if request.version < 0:
            await errors.abort(context, errors.InvalidArgument("version must be >= 0"))
        try:  # only files under weights_dir, opened now: an RPC must not read the host's files
            # (its checks resolve the name on the filesystem: off the event loop, so a hostile
            # name never stalls the worker's other RPCs and its OpenAI API)
            file = await asyncio.to_thread(open_confined, self._weights_dir, request.path,
                                           "weights file")
        except errors.ServiceError as exc:
            await errors.abort(context, exc)
        try:
            count = await self.load_weights_file(file, request.version, request.path,
                                                 request.job or None)
        except EngineInputError as exc:
            await errors.abort(context, errors.InvalidArgument(str(exc)))
        except Exception as exc:  # e.g. not a safetensors file: the worker keeps its weights
            await errors.abort(context, errors.InvalidArgument(
                f"could not load {errors.quoted(request.path)}: {errors.quoted(str(exc), 300)}"))
        return pb.LoadWeightsResponse(weight_version=self._engine.weight_version,
                                      tensors_loaded=count)

    # ---- weights, drain, health ----------------------------------------------------------------

    async def load_weights_file(self, file: BinaryIO, version: int, source: str,
                                job: str | None = None) -> int:
        """Read an open safetensors file (the one checked, whatever its name leads to by now)
        and load it between engine steps as ``job``'s (None: the job served now), closing it;
        requests of the old version end (continuing them would mix weight versions inside one
        completion)."""
        return await self.commands.swap_weights(partial(_read_safetensors, file), version,
                                                source, job)

    async def load_weights_tensors(self, tensors: Mapping[str, torch.Tensor], version: int,
                                   source: str = "a transfer agent",
                                   job: str | None = None) -> int:
        """Load an in-memory tensor dict (a pull from a transfer agent, a job's resident
        weights) between engine steps as ``job``'s weights (None: the job served now); returns
        the number of tensors loaded. Raises EngineInputError, loading nothing, when a name,
        shape or value does not fit the model."""
        return await self.commands.swap_weights(lambda: tensors, version, source, job)

    async def read_between_steps(self, read: Callable[[], T]) -> T:
        """``read`` in the engine's thread between two steps, after every weight swap queued
        before it: a consistent view (a placed worker's copy of a job's weights and version)."""
        return await self.pump.run_between_steps(lambda: self.pump.in_engine_thread(read))

    @property
    def draining(self) -> bool:
        return self.hub.draining

    async def drain(self, timeout: float, reason: str = "worker shutting down") -> bool:
        """Refuse new work, tell every manager to migrate, and wait for the requests to leave.
        Returns True when none were left behind."""
        return await self.hub.drain(timeout, reason)

    def set_endpoint(self, endpoint: str) -> None:
        self._info["endpoint"] = endpoint

    def health(self) -> dict:
        load = self.pump.last_load
        return {"status": "ok", "draining": self.hub.draining, "job": self.commands.job,
                "weight_version": load.weight_version, "pending": load.pending,
                "executing": load.executing, "sessions": self.hub.session_count}

    def close(self) -> None:
        self.pump.close()


def _read_safetensors(file: BinaryIO) -> dict[str, torch.Tensor]:
    """The tensors of an open safetensors file, which this closes. The swap owns the file: it
    runs later, even when the caller has gone away."""
    from safetensors.torch import load_file

    with file:
        return load_file(descriptor_path(file))
