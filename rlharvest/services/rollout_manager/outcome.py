"""What the core hands its shell for one event: everything the shell must do, at once.

Like vLLM's ``Scheduler.update_from_output``: the shell gives ``RolloutControl`` a worker's event
(or commands decided elsewhere: a tick, a loss) and gets back an ``Outcome``. Everything in it has
already happened in the core: commands are applied to the tracker, deliveries are counted as
delivered (the request is forgotten, its step may have ended). The shell only carries it out, in
this order: commands to the workers, rows to the steps' streams, then each delivery (its
completion, the policy's verdicts after it, the step's end when it was the last one).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlharvest.common import delta_batch
from rlharvest.common.delta_batch import Rows
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager.commands import Command
from rlharvest.services.rollout_manager.step import Step
from rlharvest.services.rollout_manager.step_policy import Verdict
from rlharvest.services.rollout_manager.tracker import (
    ApplyReport,
    DroppedDelta,
    RequestState,
    ResumePayload,
    TrackedRequest,
)


@dataclass(frozen=True)
class Delivery:
    """A completion the core counted as delivered: its client's stream must get it now."""

    step: Step
    completion: mpb.Completion
    outcome: str  # "finished" | "failed" | "cancelled"
    verdicts: tuple[Verdict, ...] = ()  # the step policy's, after this completion
    ended: bool = False  # the step's last one: the step ended (finished) with it
    discarded_tokens: int = 0  # a cancelled request's tokens, never trained on


@dataclass
class Outcome:
    commands: list[Command] = field(default_factory=list)  # applied; the workers must hear them
    payloads: dict[str, ResumePayload] = field(default_factory=dict)  # what each send carries
    rows: list[tuple[int, Rows]] = field(default_factory=list)  # by step key, named by index
    deliveries: list[Delivery] = field(default_factory=list)
    accepted_tokens: int = 0
    dropped: list[DroppedDelta] = field(default_factory=list)
    preemptions: int = 0  # new ones the worker reported
    malformed: str = ""  # why the worker's batch was dropped whole
    lost: str = ""  # the worker was lost (why): the shell lets its link go
    wake: bool = False  # the tick should run soon: something was freed or finished


def decode(batch: common_pb2.DeltaBatch) -> tuple[Rows, str]:
    """A worker's batch as rows; a malformed one as none, with why."""
    try:
        return delta_batch.decode(batch), ""
    except delta_batch.MalformedBatch as exc:
        return delta_batch.empty(), str(exc)


def client_rows(report: ApplyReport) -> list[tuple[int, Rows]]:
    """Accepted rows by step key, renamed by their index in the step, in the order the tracker
    took them."""
    accepted = report.accepted
    if not len(accepted):
        return []
    if accepted.ends:  # the client must not read "ended" on a request the worker aborted
        accepted = replace(accepted, ends={r: why for r, why in accepted.ends.items()
                                           if why != "abort"})
    return delta_batch.by_key(accepted, report.tags, report.indices)


def completion_of(req: TrackedRequest, cancelled: bool = False) -> mpb.Completion:
    """The request's completion as its client gets it."""
    if cancelled:  # not needed: its partial tokens are discarded, never trained on
        return mpb.Completion(request_id=req.request_id, group_id=req.group_id,
                              weight_version=req.weight_version,
                              finish_reason=req.finish_reason, failed=True, cancelled=True,
                              migrations=req.migrations)
    return mpb.Completion(request_id=req.request_id, group_id=req.group_id,
                          token_ids=req.token_ids, logprobs=req.logprobs,
                          weight_version=req.weight_version, finish_reason=req.finish_reason,
                          failed=req.state is RequestState.FAILED, migrations=req.migrations)
