"""Which serving co-executors a rollout manager borrows (ROSE §5). Pure: no I/O, no clock.

The paper: the user caps the serving GPUs an RL job may borrow (N_serving); the GPUs with the
lowest KV use over a recent window are lent, each to at most one job. Here each co-executor
publishes ``serving_kv_recent`` (its serving model's mean share of the KV pool over its usage
window) in its member record; a manager with ``max_serving_workers`` > 0 tops its claims up to
that many, lowest recent use first (ties by id, so two managers reading the same state try the
same order and one of them wins each co-executor's create-if-absent claim). [vague in the paper;
ours:] a claim is kept while its co-executor lives and is not draining — it is not moved to a
quieter co-executor later (moving would abort the rollout running there for a small gain).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlharvest.common.lending_record import Claim


@dataclass(frozen=True)
class Lendable:
    """What a co-executor's member record says about lending it."""

    coexec_id: str
    serving_kv_recent: float  # share of its KV pool serving used recently, in [0, 1]
    model: str  # the rollout model it has deployed
    draining: bool = False
    by_claim: bool = True  # False: pinned to a job by its operator (``--job``), never claimed

    @classmethod
    def from_member(cls, coexec_id: str, info: Mapping) -> Lendable:
        return cls(coexec_id, float(info.get("serving_kv_recent", 1.0)), str(info.get("model", "")),
                   bool(info.get("draining", False)), bool(info.get("lendable", False)))


@dataclass(frozen=True)
class LendingPlan:
    wanted: int = 0  # claims to add
    candidates: list[str] = field(default_factory=list)  # try in this order until ``wanted`` hold
    release: list[str] = field(default_factory=list)  # this manager's claims to drop
    kept: list[str] = field(default_factory=list)


def plan_claims(members: Mapping[str, Lendable], claims: Mapping[str, Claim], mine: Claim, *,
                limit: int, model: str = "") -> LendingPlan:
    """``members``: live co-executors by id; ``claims``: every lending record by co-executor id;
    ``mine``: this manager's claim (job, manager id); ``limit``: max_serving_workers; ``model``:
    when set, only co-executors that deployed this rollout model are borrowed."""
    held = sorted(cid for cid, claim in claims.items() if claim == mine)
    usable = [cid for cid in held if cid in members and not members[cid].draining]
    kept = usable[:limit]
    release = [cid for cid in held if cid not in kept]
    free = [m for cid, m in members.items()
            if cid not in claims and m.by_claim and not m.draining
            and (not model or m.model == model)]
    free.sort(key=lambda m: (m.serving_kv_recent, m.coexec_id))
    wanted = max(0, limit - len(kept))
    return LendingPlan(wanted, [m.coexec_id for m in free] if wanted else [], release, kept)
