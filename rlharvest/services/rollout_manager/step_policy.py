"""Step policies: what a step does beyond running its requests, behind one interface.

The plain policy runs every request of a step to completion. Further policies plug in here:
RollPacker's tail batching (launch speculative prompts, end the step once enough responses are in
and defer the long tail) and RLBoost's seeding window (Algorithm 1: roll out on the training
cluster for T_seed, then hand the rest to remote workers).

What a policy may rely on: the core asks it, at every tick, which of a step's outstanding
requests the step no longer needs (``cut``), and after every delivered completion which verdicts
on the step's groups its client gets now (``verdicts``). Those fail with a reason that names the policy, are
aborted where they run, and reach the client as failed completions like any other; the step ends
when its last completion is delivered. A policy reads the step through ``StepProgress`` and never
changes it itself.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Verdict:
    """A policy's word on one group of a step, sent to the client with the step's events."""

    group_id: str
    accepted: bool  # False: deferred


class StepProgress(Protocol):
    """What a policy may read of a step (``step.Step`` provides it)."""

    @property
    def step_id(self) -> str: ...
    @property
    def weight_version(self) -> int: ...
    @property
    def started_at(self) -> float: ...
    @property
    def request_ids(self) -> tuple[str, ...]: ...
    @property
    def outstanding(self) -> Set[str]: ...  # not delivered to the client yet
    @property
    def succeeded(self) -> Mapping[str, int]: ...  # finished and delivered -> delivery order


class StepPolicy(Protocol):
    """One step's policy; the core keeps one instance per step, so a policy may keep state."""

    @property
    def name(self) -> str: ...

    @property
    def round_kind(self) -> str:
        """RollPacker's round kind of its steps, as the TP planner counts them: "short" under
        an acceptance rule, "long" for every other step (a long round cannot be told apart)."""
        ...

    def cut(self, step: StepProgress, now: float) -> Collection[str]:
        """Outstanding requests of ``step`` it no longer needs, decided at ``now`` (the core's
        clock). Only ids of ``step.outstanding``; empty to let every request run on."""
        ...

    def verdicts(self, step: StepProgress) -> Sequence[Verdict]:
        """Verdicts not handed out yet, asked after each delivered completion of ``step``."""
        ...


class PlainStep:
    """Every request runs until it finishes or fails: RLBoost's step as §4.2 describes it."""

    name = "plain"
    round_kind = "long"

    def cut(self, step: StepProgress, now: float) -> Collection[str]:
        return ()

    def verdicts(self, step: StepProgress) -> Sequence[Verdict]:
        return ()
