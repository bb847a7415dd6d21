"""The chaos soak's pure parts: which fault comes when, and what the trained lineage
must look like afterwards. No I/O, no clock: ``rlharvest/cli/chaos.py`` runs them."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# What the soak kills: a worker (replaced by a new one), the leading manager (a new standby
# starts), the transfer agent (started again), etcd (SIGKILLed, started again on its data after
# a pause), the trainer at a random instant and between a step's optimizer step and its
# checkpoint (started again: it resumes from its checkpoint, redoing that step), and the serving
# co-executor the job borrows (started again).
KINDS: tuple[str, ...] = ("worker", "leader", "agent", "etcd", "trainer", "trainer-before-save",
                          "coexecutor")


@dataclass(frozen=True)
class Fault:
    after_s: float  # since the previous fault (or the start)
    kind: str
    down_s: float = 0.0  # etcd only: how long it stays down
    pick: float = 0.0  # in [0, 1): which of several targets (a worker) is hit


class FaultPlan:
    """Seeded faults: one every ``every`` seconds (uniform), kinds drawn in turn from a shuffled
    cycle of ``kinds`` so each appears as often as the others; etcd stays down ``etcd_down``
    seconds (uniform)."""

    def __init__(self, seed: int, every: tuple[float, float] = (3.0, 7.0),
                 kinds: Sequence[str] = KINDS, etcd_down: tuple[float, float] = (2.0, 5.0)):
        if not 0 < every[0] <= every[1] or not 0 <= etcd_down[0] <= etcd_down[1]:
            raise ValueError(f"need 0 < every[0] <= every[1] and 0 <= etcd_down[0] <= "
                             f"etcd_down[1], got every={every}, etcd_down={etcd_down}")
        unknown = set(kinds) - set(KINDS)
        if not kinds or unknown:
            raise ValueError(f"kinds must be among {KINDS}, got {list(kinds)}")
        self._rng = random.Random(seed)
        self._every, self._down, self._kinds = every, etcd_down, list(kinds)
        self._cycle: list[str] = []

    def next(self) -> Fault:
        if not self._cycle:
            self._cycle = self._rng.sample(self._kinds, len(self._kinds))
        kind = self._cycle.pop()
        down = self._rng.uniform(*self._down) if kind == "etcd" else 0.0
        return Fault(self._rng.uniform(*self._every), kind, down, self._rng.random())


STEP_LINE = re.compile(r"^step (\d+) on version (\d+):")


def applied_lineage(messages: Iterable[str]) -> list[tuple[int, int]]:
    """(step, version) of the steps the final model went through, from the trainer's log
    messages of all its incarnations in order: a step logged again (redone after a restart from
    an earlier checkpoint) replaces the one before, and so do all steps after it."""
    lineage: list[tuple[int, int]] = []
    for message in messages:
        found = STEP_LINE.match(message)
        if found is None:
            continue
        step, version = int(found.group(1)), int(found.group(2))
        while lineage and lineage[-1][0] >= step:
            lineage.pop()
        lineage.append((step, version))
    return lineage


def lineage_problems(lineage: Sequence[tuple[int, int]]) -> list[str]:
    """What is wrong with a lineage: steps 1..N each once, in order, on strictly increasing
    versions (a resumed trainer may skip version numbers a dead incarnation announced)."""
    problems = []
    steps = [step for step, _ in lineage]
    if steps != list(range(1, len(steps) + 1)):
        problems.append(f"steps are not 1..{len(steps)}: {steps}")
    versions = [version for _, version in lineage]
    if any(b <= a for a, b in zip(versions, versions[1:])):
        problems.append(f"versions do not increase: {versions}")
    return problems


_CHECKPOINT_LINE = re.compile(r"^checkpoint of step (\d+) ")


def unsaved_step(messages: Iterable[str]) -> int | None:
    """The step the trainer's log says it trained (its optimizer step done) but has not yet
    checkpointed, from its latest messages; None when every trained step is saved."""
    trained = saved = 0
    for message in messages:
        if (found := STEP_LINE.match(message)) is not None:
            trained = int(found.group(1))
        elif (found := _CHECKPOINT_LINE.match(message)) is not None:
            saved = int(found.group(1))
    return trained if trained > saved else None
