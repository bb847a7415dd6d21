"""Many trainer ranks, one RL step: rank 0 leads, the other ranks follow.

The trainer runs under ``torchrun`` or the ``deepspeed`` launcher with N ranks (or alone, N = 1).
Rank 0 holds every control-plane role (it submits steps, reads the stream, runs rewards, answers
gRPC, registers in etcd); ranks 1..N-1 hold only a model replica (or a ZeRO partition) and do
what rank 0 tells them over a gloo control group:

- ``Backward``: each rank gets one contiguous share of a micro-batch's samples and runs forward
  and backward on it, its loss divided by the *step's* global denominator (the one
  ``StreamingStep`` computed), so the shares' losses sum to the monolithic batch's loss and their
  gradients to its gradient (docs/architecture.md, "Exact update"). A rank whose share is empty
  still runs a forward and backward, of a one-token sample times zero: ZeRO-2/3 reduce (and
  ZeRO-3 gathers parameters) inside them, so every rank must run as many.
- ``Step``: every rank steps once; the backend reduces gradients across ranks (a sum) first.
- ``Weights``: the whole model for publishing; under ZeRO-3 every rank joins the gather.
- ``PublishShard`` / ``AwaitPublished`` (``--publish-mode shards``): every rank copies its own
  flat shard in the serving dtype and sends it to the agent in the background (a delta against
  its last shard, with ``--publish-deltas``), then reports how that ended and what it changed
  (``shard_publish.py``).
- ``TimeForward``: every rank times a forward pass (the placement profile; ZeRO-3 gathers).
- ``Discard`` (a failed step's gradients), ``Save`` / ``Load`` (checkpoints of every rank), ``Stop``.

Every command ends with a gather of each rank's reply, so a follower's failure reaches rank 0
as an exception naming the rank instead of a hang. A rank that dies (SIGKILL) closes its gloo
sockets: the survivors' next collective raises, rank 0's step fails with nothing applied, and
the launcher restarts the group, which resumes from the newest complete checkpoint.

Pure of I/O except the collectives; the loss itself is ``micro_batch_loss``, shared by all ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed import ProcessGroup

from rlharvest.common.service_host import launch_rank
from rlharvest.services.trainer import metrics
from rlharvest.services.trainer.backend import TrainBackend, Where
from rlharvest.services.trainer.device import module_device, synchronize
from rlharvest.services.trainer.shard_publish import (
    RankPublisher,
    ShardPublished,
    ShardTarget,
    combined_stats,
)
from rlharvest.services.trainer.grpo import (
    LossConfig,
    aggregate_loss,
    completion_logprobs,
    per_token_loss,
)

if TYPE_CHECKING:
    from rlharvest.services.transfer_agent.delta_publish import DeltaStats

log = logging.getLogger(__name__)

# Followers wait in a broadcast while rank 0 waits for rollouts, which may take long (a manager
# outage, slow workers). A dead rank 0 still ends the wait at once (its sockets close).
_CONTROL_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True)
class Sample:
    """One completion to train on; ``rollout_logprobs`` None means "these very weights"."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    rollout_logprobs: Sequence[float] | None
    advantage: float
    # Per completion token: trained (True) or not (an agentic trajectory's environment
    # observations, between its turns: context the model reads, never its own action). None:
    # every token is trained.
    loss_mask: Sequence[bool] | None = None


@dataclass(frozen=True)
class MicroBatch:
    samples: tuple[Sample, ...]
    loss: LossConfig
    pad_id: int
    denominator: float  # the whole step's (aggregate_loss), never this batch's

    def split(self, parts: int) -> list[MicroBatch]:
        """``parts`` contiguous shares, sizes differing by at most one; some may be empty."""
        n = len(self.samples)
        return [MicroBatch(self.samples[i * n // parts:(i + 1) * n // parts], self.loss,
                           self.pad_id, self.denominator) for i in range(parts)]


def micro_batch_loss(module: torch.nn.Module, batch: MicroBatch,
                     ref_model: torch.nn.Module | None) -> torch.Tensor:
    prompts = [s.prompt_ids for s in batch.samples]
    outputs = [s.completion_ids for s in batch.samples]
    logprobs, mask = completion_logprobs(module, prompts, outputs, batch.pad_id)
    old = logprobs.detach().clone()
    device = logprobs.device  # the model's: every tensor of the loss is made there
    for i, s in enumerate(batch.samples):
        if s.rollout_logprobs is not None:
            old[i, :len(s.rollout_logprobs)] = torch.tensor(s.rollout_logprobs, device=device)
    ref = None
    if batch.loss.beta > 0:
        if ref_model is None:
            raise ValueError("loss.beta > 0 needs ref_model (a frozen copy of the initial policy)")
        with torch.no_grad():
            ref, _ = completion_logprobs(ref_model, prompts, outputs, batch.pad_id)
    for i, s in enumerate(batch.samples):
        if s.loss_mask is not None:
            mask[i, :len(s.loss_mask)] *= torch.tensor(s.loss_mask, dtype=mask.dtype,
                                                       device=device)
    advantages = torch.tensor([s.advantage for s in batch.samples], dtype=torch.float32,
                              device=device)
    token_loss = per_token_loss(logprobs, old, advantages, batch.loss, ref)
    return aggregate_loss(token_loss, mask, batch.loss.aggregation, batch.denominator)


def zero_loss(module: torch.nn.Module, batch: MicroBatch,
              ref_model: torch.nn.Module | None) -> torch.Tensor:
    """A loss of exactly zero through a real forward (one pad token), for a rank whose share is
    empty: ZeRO-3 gathers parameters in forward, ZeRO-2/3 reduce gradients in backward, and
    both are collectives every rank must join. Every parameter gets a gradient of exactly 0."""
    pad = Sample((batch.pad_id,), (batch.pad_id,), None, 0.0)
    dummy = MicroBatch((pad,), batch.loss, batch.pad_id, 1.0)
    return micro_batch_loss(module, dummy, ref_model) * 0.0


class Ranks(Protocol):
    """How a step's micro-batches and its one update spread over the trainer's ranks."""

    @property
    def world_size(self) -> int: ...

    def backward(self, batch: MicroBatch) -> float:
        """Accumulate the batch's gradients (spread over the ranks); returns its loss."""

    def step(self, grad_scale: float) -> float:
        """Every rank: reduce, rescale, clip and update once. Returns the global grad norm."""

    def discard(self) -> None:
        """Forget the pending gradients on every rank."""

    def weights(self, *, where: Where | None = None) -> dict[str, torch.Tensor]:
        """The whole model's weights (a copy, on the CPU unless ``where`` says), gathered from
        every rank under ZeRO-3."""

    def save(self, path: Path) -> None:
        """Every rank writes its part of the weights and optimizer state under ``path``."""

    def load(self, path: Path) -> None: ...

    def forward_seconds(self, rows: int, length: int) -> float:
        """Seconds of one forward pass without gradients over ``rows`` x ``length`` tokens (the
        placement profile's), every rank running it: under ZeRO-3 each forward gathers the
        parameters from all ranks."""

    def close(self) -> None: ...


class LocalRanks:
    """This process alone: the rank of a one-process trainer, and each rank's own work."""

    def __init__(self, backend: TrainBackend, ref_model: torch.nn.Module | None = None) -> None:
        self.backend = backend
        self.ref_model = ref_model
        self._publisher: RankPublisher | None = None

    @property
    def world_size(self) -> int:
        return 1

    def backward(self, batch: MicroBatch) -> float:
        module = self.backend.module
        loss = micro_batch_loss(module, batch, self.ref_model) if batch.samples \
            else zero_loss(module, batch, self.ref_model)
        self.backend.backward(loss)
        return float(loss.detach())

    def step(self, grad_scale: float) -> float:
        norm = self.backend.step(grad_scale)  # read before the optimizer's kernels are queued
        # On a GPU the update runs on after the call returns: a step's compute time (Algorithm
        # 1's input) must include it, not hand it to the next step's first backward.
        synchronize(module_device(self.backend.module))
        return norm

    def discard(self) -> None:
        self.backend.model.zero_grad(set_to_none=True)
        zero_grad = getattr(self.backend.optimizer, "zero_grad", None)
        if zero_grad is not None:
            zero_grad(set_to_none=True)

    def weights(self, keep: bool = True, *,
                where: Where | None = None) -> dict[str, torch.Tensor]:
        return self.backend.weights(keep, where)

    def save(self, path: Path) -> None:
        self.backend.save(path)

    def load(self, path: Path) -> None:
        self.backend.load(path)

    def forward_seconds(self, rows: int, length: int) -> float:
        from rlharvest.services.trainer.warmup_profile import time_forward

        return time_forward(self.backend.module, rows, length)

    def publish_shard(self, version: int, target: ShardTarget, rank: int, size: int) -> None:
        """Copy this rank's shard of the current weights now, in the target's dtype; send it in
        the background."""
        shard, shapes = self.backend.weights_shard(rank, size, target.dtype)
        if self._publisher is None:
            self._publisher = RankPublisher()
        self._publisher.start(version, shard, shapes, rank, size, target)

    def shard_published(self, version: int) -> ShardPublished:
        """How this rank's shard of ``version`` ended (whether it completed the version)."""
        if self._publisher is None:
            raise RuntimeError(f"this rank was never asked to publish version {version}")
        return self._publisher.wait(version)

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()


# ---- the control group -------------------------------------------------------------------------

@dataclass(frozen=True)
class Backward:
    shares: tuple[MicroBatch, ...]  # one per rank


@dataclass(frozen=True)
class Step:
    grad_scale: float


@dataclass(frozen=True)
class Discard:
    pass


@dataclass(frozen=True)
class Weights:
    where: Where | None = None  # rank 0's copy; the others only join the gather


@dataclass(frozen=True)
class PublishShard:
    version: int
    target: ShardTarget


@dataclass(frozen=True)
class AwaitPublished:
    version: int


@dataclass(frozen=True)
class Save:
    path: str


@dataclass(frozen=True)
class Load:
    path: str


@dataclass(frozen=True)
class TimeForward:
    rows: int
    length: int


@dataclass(frozen=True)
class Stop:
    pass


Command = Backward | Step | Discard | Weights | PublishShard | AwaitPublished | TimeForward | \
    Save | Load | Stop


@dataclass(frozen=True)
class Reply:
    value: float = 0.0
    error: str = ""
    published: ShardPublished | None = None  # AwaitPublished's answer


class RankFailed(RuntimeError):
    """A follower rank could not carry out a command; the step must not be applied."""


def control_group() -> ProcessGroup:
    """The gloo group the commands travel on (CPU objects, even when gradients use NCCL).
    Collective: every rank creates it in the same order, after the backend's process group."""
    return torch.distributed.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


Result = float | dict[str, torch.Tensor] | ShardPublished


def _run(local: LocalRanks, rank: int, command: Command) -> Result:
    if isinstance(command, Weights):
        # rank 0 publishes; the others only join the gather
        return local.weights(keep=rank == 0, where=command.where)
    if isinstance(command, Backward):
        return local.backward(command.shares[rank])
    if isinstance(command, Step):
        return local.step(command.grad_scale)
    if isinstance(command, AwaitPublished):
        return local.shard_published(command.version)
    if isinstance(command, TimeForward):
        return local.forward_seconds(command.rows, command.length)
    if isinstance(command, PublishShard):
        local.publish_shard(command.version, command.target, rank,
                            torch.distributed.get_world_size())
    if isinstance(command, Discard):
        local.discard()
    elif isinstance(command, Save):
        local.save(Path(command.path))
    elif isinstance(command, Load):
        local.load(Path(command.path))
    return 0.0


class LeaderRanks:
    """Rank 0 of N: runs its own share of every command and has the followers run theirs."""

    def __init__(self, backend: TrainBackend, ref_model: torch.nn.Module | None,
                 group: ProcessGroup) -> None:
        self._local = LocalRanks(backend, ref_model)
        self._group = group
        self._world = torch.distributed.get_world_size()
        self._stopped = False
        # What the last version ``await_published`` saw out changed, over every rank's shard
        # (None: sent without deltas).
        self.last_stats: DeltaStats | None = None

    @property
    def world_size(self) -> int:
        return self._world

    def backward(self, batch: MicroBatch) -> float:
        return sum(r.value for r in self._command(Backward(tuple(batch.split(self._world))))[1])

    def step(self, grad_scale: float) -> float:
        return self._command(Step(grad_scale))[1][0].value  # the same global norm on every rank

    def discard(self) -> None:
        self._command(Discard())

    def weights(self, *, where: Where | None = None) -> dict[str, torch.Tensor]:
        if not self._local.backend.weights_are_sharded:
            return self._local.weights(where=where)  # rank 0 holds them all: no one else copies
        mine = self._command(Weights(where))[0]
        assert isinstance(mine, dict)
        return mine

    def forward_seconds(self, rows: int, length: int) -> float:
        mine = self._command(TimeForward(rows, length))[0]  # rank 0's own timing
        assert isinstance(mine, float)
        return mine

    def publish_shards(self, version: int, target: ShardTarget) -> None:
        """Every rank copies its shard of the current weights and starts sending it."""
        self._command(PublishShard(version, target))

    def await_published(self, version: int) -> bool:
        """Every rank's shard of ``version`` was accepted (else RankFailed); True when one of
        them completed the version, so the agent holds it (and ``last_stats`` says what it
        changed)."""
        replies = self._command(AwaitPublished(version))[1]
        outcomes = [r.published for r in replies if r.published is not None]
        if len(outcomes) != len(replies):
            raise RankFailed(f"a rank answered AwaitPublished({version}) without its outcome")
        self.last_stats = combined_stats(outcomes)
        return any(o.completed for o in outcomes)

    def save(self, path: Path) -> None:
        self._command(Save(str(path)))

    def load(self, path: Path) -> None:
        self._command(Load(str(path)))

    def close(self) -> None:
        """Let the followers exit 0. Best effort: a dead follower has nothing left to stop."""
        if self._stopped:
            return
        self._stopped = True
        try:
            torch.distributed.broadcast_object_list([Stop()], src=0, group=self._group)
        except RuntimeError as exc:
            log.warning("could not tell the follower ranks to stop: %s", exc)
        self._local.close()

    def _command(self, command: Command) -> tuple[Result, list[Reply]]:
        """Rank 0's own result, and every rank's reply (rank 0's first)."""
        name = type(command).__name__
        started = time.perf_counter()
        try:
            return self._collective(command)
        except Exception:
            metrics.RANK_FAILURES.inc()
            raise
        finally:
            metrics.RANK_COMMAND_SECONDS.labels(name).observe(time.perf_counter() - started)

    def _collective(self, command: Command) -> tuple[Result, list[Reply]]:
        if self._stopped:
            raise RankFailed("the follower ranks were told to stop")
        torch.distributed.broadcast_object_list([command], src=0, group=self._group)
        result: Result = 0.0
        try:
            result = _run(self._local, 0, command)
            mine = _reply(result)
        except Exception as exc:
            mine = Reply(error=f"{type(exc).__name__}: {exc}")
        replies: list[Reply | None] = [None] * self._world
        torch.distributed.gather_object(mine, replies, dst=0, group=self._group)
        failed = [f"rank {r}: {reply.error}" for r, reply in enumerate(replies)
                  if reply is not None and reply.error]
        if failed:
            raise RankFailed(f"{type(command).__name__} failed on " + "; ".join(failed))
        return result, [reply for reply in replies if reply is not None]


def _reply(result: Result) -> Reply:
    if isinstance(result, ShardPublished):
        return Reply(published=result)
    return Reply(result if isinstance(result, float) else 0.0)


def follow(local: LocalRanks, group: ProcessGroup) -> None:
    """A follower rank's whole life: carry out rank 0's commands on ``local`` (this rank's
    backend and reference model) until it says stop. Raises when rank 0 is gone."""
    rank = torch.distributed.get_rank()
    log.info("rank %d of %d following rank 0", rank, torch.distributed.get_world_size())
    while True:
        box: list[Command | None] = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=group)
        command = box[0]
        if command is None or isinstance(command, Stop):
            log.info("rank %d: rank 0 says stop", rank)
            local.close()
            return
        try:
            reply = _reply(_run(local, rank, command))
        except Exception as exc:
            log.exception("rank %d: %s failed", rank, type(command).__name__)
            reply = Reply(error=f"{type(exc).__name__}: {exc}")
        torch.distributed.gather_object(reply, None, dst=0, group=group)


def check_world(backend_name: str) -> tuple[int, int]:
    """(rank, world size); refuses a multi-rank launch of a backend that cannot reduce."""
    rank, world = launch_rank()
    if world > 1 and backend_name != "deepspeed":
        raise ValueError(f"the trainer was launched with {world} ranks but backend "
                         f"{backend_name!r} trains one; use --backend deepspeed")
    return rank, world


def join(backend: TrainBackend, ref_model: torch.nn.Module | None) -> Ranks:
    """Rank 0's view of the job's ranks: itself alone, or the leader of the launched group.
    Call after the backend is built (it starts the process group)."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        ranks: Ranks = LeaderRanks(backend, ref_model, control_group())
    else:
        ranks = LocalRanks(backend, ref_model)
    metrics.RANKS.set(ranks.world_size)
    log.info("training on %d rank(s)", ranks.world_size)
    return ranks
