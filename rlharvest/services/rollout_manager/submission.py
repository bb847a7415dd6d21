"""A step as its client submitted it: what the shell admits, and what the observers (observer.py)
may read of the request beyond the core's step."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from rlharvest.common.engine_types import sampling_from_proto
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager.step import check_seed_window
from rlharvest.services.rollout_manager.tracker import NewRequest


@dataclass(frozen=True)
class Submission:
    """A SubmitStep, or a Generate (``profiled`` False: not a step of the RL loop, its end never
    freezes P)."""

    step_id: str
    requests: Sequence[mpb.RolloutRequest]
    weight_version: int
    profiled: bool
    acceptance: mpb.Acceptance | None = None
    deadline_s: float = 0.0  # the client's no-worker deadline; 0: the manager's
    seed_window_s: float = 0.0

    @classmethod
    def of_step(cls, request: mpb.SubmitStepRequest) -> Submission:
        return cls(request.step_id, list(request.requests), request.weight_version, True,
                   request.acceptance if request.HasField("acceptance") else None,
                   request.no_worker_deadline_s, request.seed_window_s)

    @classmethod
    def of_generate(cls, request: mpb.GenerateRequest) -> Submission:
        return cls(request.request.request_id, [request.request], request.weight_version, False,
                   deadline_s=request.no_worker_deadline_s)

    def check(self) -> None:
        """What needs no state, refused before any etcd read (InvalidArgument)."""
        check_seed_window(self.seed_window_s)

    def new_requests(self) -> list[NewRequest]:
        """The requests as the core admits them."""
        return [NewRequest(r.request_id, r.group_id, tuple(r.prompt_token_ids),
                           sampling_from_proto(r.sampling), self.weight_version,
                           self.deadline_s or None, tuple(r.resume_token_ids),
                           tuple(r.resume_logprobs), r.trajectory_id, r.turn, r.last_turn)
                for r in self.requests]

    @cached_property
    def fingerprint(self) -> bytes:
        """What a re-submission must repeat to be the same step (reattach.py): the version and
        every request (ids, prompts, sampling, resume tokens), in order."""
        sha = hashlib.sha256(str(self.weight_version).encode())
        for r in self.requests:
            sha.update(r.SerializeToString(deterministic=True))
        return sha.digest()
