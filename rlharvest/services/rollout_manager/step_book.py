"""The manager's steps in flight and the batching profile P they capture (RLBoost §4.2.1).

Which step each request belongs to, which steps are in flight, which may start (their weight
version), and when each ends. Synchronous and I/O-free, like the rest of the core.

When P is frozen. The paper captures P "online during the previous step's rollout". Every
profiled step collects the engine-step samples taken while it is in flight, from every worker,
per worker kind; when it finishes, its samples become P, once. With two steps in flight
(pipelined steps, two weight versions) each freezes P when it ends, from its own lifetime: a
sample taken while both ran counts for both, and the later step's P is not just the tail left
after the first ended (small batches only, which would make B small and migrate executing
requests for nothing). P is never frozen by an abandoned step (its samples stop wherever its
client left) nor by a single-request Generate (not a step of the RL loop: how long it ran says
nothing about a step's batching).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from rlharvest.common.errors import FailedPrecondition
from rlharvest.services.rollout_manager.batching_profile import ProfileSamples, ThroughputProfile
from rlharvest.services.rollout_manager.step import Step, StepOutcome
from rlharvest.services.rollout_manager.step_policy import StepPolicy
from rlharvest.services.rollout_manager.tracker import StepError


class UnknownVersion(FailedPrecondition):
    """A step for a weight version no worker holds and nobody announced."""


def admit_version(version: int, held: Collection[int], announced: int | None) -> None:
    """Refuse a step whose version cannot be served: negative (StepError), or neither held by a
    worker nor announced (UnknownVersion). ``announced`` is the newest version the job announced
    (None: none); every version up to it may still reach workers, so its requests wait for one."""
    if version < 0:
        raise StepError(f"weight_version {version} is negative; versions are >= 0")
    if version in held or (announced is not None and version <= announced):
        return
    raise UnknownVersion(f"weight version {version} is unknown: no worker holds it and it was "
                         f"never announced (workers hold {sorted(set(held)) or 'nothing'}); "
                         "publish it first or ask for a version a worker holds")


class StepBook:
    """The steps in flight, the step of each outstanding request, and P per worker kind."""

    def __init__(self, clock: Callable[[], float], profile_epsilon: float) -> None:
        self._clock = clock
        self._epsilon = profile_epsilon
        self.profiles: dict[str, ThroughputProfile] = {}  # worker kind -> P
        self._live: dict[int, Step] = {}
        self._step_of: dict[str, Step] = {}
        self._capturing: list[Step] = []  # live profiled steps: where samples go
        self._next_key = 0

    def open(self, step_id: str, weight_version: int, request_ids: Sequence[str],
             policy: StepPolicy, profiled: bool, seed_window_s: float = 0.0) -> Step:
        """Start a step over requests the tracker has just admitted."""
        step = Step(self._next_key, step_id, weight_version, request_ids, policy, profiled,
                    self._clock(), seed_window_s)
        self._next_key += 1
        self._live[step.key] = step
        for request_id in step.request_ids:
            self._step_of[request_id] = step
        if profiled:
            self._capturing.append(step)
        return step

    def live(self) -> list[Step]:
        """Steps in flight, oldest first."""
        return list(self._live.values())

    def live_step(self, key: int) -> Step | None:
        return self._live.get(key)

    def step_of(self, request_id: str) -> Step | None:
        return self._step_of.get(request_id)

    def delivered(self, request_id: str, succeeded: bool = True) -> Step | None:
        """A completion (``succeeded``: finished, not failed) reached its client; returns its
        step when that finished it."""
        step = self._step_of.pop(request_id, None)
        if step is None or not step.delivered(request_id, succeeded):
            return None
        self._end(step, StepOutcome.FINISHED)
        return step

    def withdrawn(self, request_id: str) -> Step | None:
        """The request left its step for another shard; returns its step when that ended it."""
        step = self._step_of.pop(request_id, None)
        if step is None or not step.withdrawn(request_id):
            return None
        self._end(step, StepOutcome.FINISHED)
        return step

    def abandon(self, step: Step) -> list[str]:
        """The client went away: end the step and return its outstanding requests (the caller
        drops them). A step that already ended gives nothing: it ends once."""
        if step.ended:
            return []
        outstanding = sorted(step.outstanding)
        for request_id in outstanding:
            del self._step_of[request_id]
        self._end(step, StepOutcome.ABANDONED)
        return outstanding

    def add_kind(self, kind: str) -> None:
        self.profiles.setdefault(kind, ThroughputProfile(self._epsilon))

    def sample(self, kind: str, batch_size: int, tokens_per_s: float, context: float) -> None:
        """One engine step of a worker of ``kind``: a sample for every profiled step in flight.
        On the relay's hot path (bench/manager_relay.py): a few float additions per step."""
        for step in self._capturing:
            samples = step.samples.get(kind)
            if samples is None:
                samples = step.samples[kind] = ProfileSamples()
            samples.record(batch_size, tokens_per_s, context)

    @property
    def capturing(self) -> bool:
        """Whether a sample would be kept (some profiled step is in flight)."""
        return bool(self._capturing)

    def _end(self, step: Step, outcome: StepOutcome) -> None:
        step.end(outcome)
        del self._live[step.key]
        if step.profiled:
            self._capturing.remove(step)
            if outcome is StepOutcome.FINISHED:
                for kind, samples in step.samples.items():
                    self.profiles.setdefault(kind, ThroughputProfile(self._epsilon)).freeze(
                        samples)
        step.samples = {}
