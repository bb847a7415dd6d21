"""Every built-in step policy keeps the StepPolicy contract (step_policy.py) the core relies on:
a round kind the TP planner knows, cuts only among the outstanding requests, and verdicts the
shell sends as they are (the shell never asks which policy a step runs)."""

from __future__ import annotations

from rlharvest.services.rollout_manager.step import Step
from rlharvest.services.rollout_manager.step_policy import PlainStep, StepPolicy, Verdict
from rlharvest.services.rollout_manager.tail_batching import TailBatchingStep
from rlharvest.services.rollout_manager.tp_planner import ROUND_KINDS

REQUESTS = ("a0", "a1", "b0", "b1")


def built_in() -> list[StepPolicy]:
    return [PlainStep(), TailBatchingStep({r: r[0] for r in REQUESTS}, 1, 2)]


def test_every_built_in_step_policy_keeps_the_contract():
    for policy in built_in():
        step = Step(0, "s", 0, REQUESTS, policy, True, 0.0)
        assert policy.round_kind in ROUND_KINDS, policy.name
        verdicts: list[Verdict] = []
        for rid in ("a0", "a1"):
            step.delivered(rid, True)
            verdicts += policy.verdicts(step)
            assert set(policy.cut(step, 0.0)) <= set(step.outstanding), policy.name
        assert all(isinstance(v, Verdict) for v in verdicts), policy.name
        groups = [v.group_id for v in verdicts]
        assert len(groups) == len(set(groups)), f"{policy.name}: a group judged twice"
