"""The manager's step: one client's batch of requests, from admission to its one end.

A step is what a ``SubmitStep`` (or a single ``Generate``) asks for: its requests, the weight
version every token must come from, and its policy (step_policy.py). It is *outstanding* while
some completion has not been delivered to its client, and it ends exactly once: finished when the
last completion is delivered, abandoned when the client goes away first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from enum import Enum

from rlharvest.common.errors import InvalidArgument
from rlharvest.services.rollout_manager.batching_profile import ProfileSamples
from rlharvest.services.rollout_manager.remote_timing import RemoteStepTimings
from rlharvest.services.rollout_manager.step_policy import StepPolicy


class StepOutcome(str, Enum):
    FINISHED = "finished"  # every completion was delivered (finished, failed or cut requests)
    ABANDONED = "abandoned"  # the client went away before


def check_seed_window(window_s: float) -> None:
    """A seeding window a client asked for (SubmitStep's ``seed_window_s``, HoldSeedWindow's)."""
    if not math.isfinite(window_s) or window_s < 0:
        raise InvalidArgument(f"a seeding window must be a finite number of seconds >= 0, got "
                              f"{window_s}")


class Step:
    """One step as the core holds it. ``profiled``: its engine-step samples become the batching
    profile P when it finishes (step_book.py); a single-request Generate is not profiled."""

    def __init__(self, key: int, step_id: str, weight_version: int, request_ids: Sequence[str],
                 policy: StepPolicy, profiled: bool, started_at: float,
                 seed_window_s: float = 0.0) -> None:
        if not request_ids:
            raise ValueError(f"step {step_id!r} has no requests; a step holds at least one")
        self.key = key  # unique per manager; clients may reuse step ids
        self.step_id = step_id
        self.weight_version = weight_version
        self.request_ids = tuple(request_ids)
        self.policy = policy
        self.profiled = profiled
        self.started_at = started_at
        self.seed_window_s = seed_window_s  # RLBoost's T_seed (seed_window.py); 0: none
        # Worker kind -> engine-step samples taken while this step was in flight.
        self.samples: dict[str, ProfileSamples] = {}
        self.outcome: StepOutcome | None = None
        self.remote: RemoteStepTimings | None = None  # set when it finishes (remote_timing.py)
        self._outstanding = set(self.request_ids)
        self._succeeded: dict[str, int] = {}  # finished (not failed), in delivery order
        # Generated lengths of the finished ones, in delivery order: the TP planner's and the
        # stream scaler's history.
        self.finished_lengths: list[int] = []
        self._deliveries = 0

    @property
    def outstanding(self) -> Set[str]:
        """Requests whose completion has not been delivered to the client yet."""
        return self._outstanding

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    @property
    def succeeded(self) -> Mapping[str, int]:
        """Requests whose finished (not failed) completion was delivered -> delivery order."""
        return self._succeeded

    def delivered(self, request_id: str, succeeded: bool = True) -> bool:
        """Note a delivered completion; True when it was the last one (the step should end)."""
        if self.outcome is not None:
            raise ValueError(f"step {self.step_id!r} already {self.outcome.value}; nothing of it "
                             "is delivered any more")
        self._outstanding.remove(request_id)
        self._deliveries += 1
        if succeeded:
            self._succeeded[request_id] = self._deliveries
        return not self._outstanding

    def withdrawn(self, request_id: str) -> bool:
        """The request left the step (moved to another shard: no completion comes here); True
        when it was the last outstanding one (the step should end)."""
        if self.outcome is not None:
            raise ValueError(f"step {self.step_id!r} already {self.outcome.value}")
        self._outstanding.remove(request_id)
        return not self._outstanding

    def end(self, outcome: StepOutcome) -> None:
        """End the step; a step ends once, and a step with outstanding requests only abandoned."""
        if self.outcome is not None:
            raise ValueError(f"step {self.step_id!r} already ended ({self.outcome.value}); a "
                             "step ends once")
        if outcome is StepOutcome.FINISHED and self._outstanding:
            raise ValueError(f"step {self.step_id!r} has {len(self._outstanding)} outstanding "
                             "requests; it finishes when the last completion is delivered")
        self.outcome = outcome
        self._outstanding.clear()

    def __repr__(self) -> str:
        state = self.outcome.value if self.outcome else f"{len(self._outstanding)} outstanding"
        return f"Step({self.step_id!r}#{self.key}, v{self.weight_version}, {state})"
