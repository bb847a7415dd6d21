"""RollPacker's tail batching, the trainer's half (§3, §4.1): which round each step runs.

A *short round* launches P = ceil(eta_P * P0) fresh prompts x R = ceil(eta_R * R0) responses
and trains the first P0 prompts to finish R0 responses each (the manager's acceptance rule,
``rollout_manager/tail_batching.py``); the other prompts are *deferred*. When the deferred queue
holds P0 prompts — or the data is used up (the flush) — the step is a *long round*: P0 deferred
prompts x R0 responses, nothing speculative, nothing cancelled. A deferred prompt starts over in
its long round (on a newer weight version: its first attempt's tokens are discarded).

Note eta_R > 1 keeps the R0 shortest of R draws of a prompt: it changes the sample distribution
(towards shorter responses), not only their order. eta_P > 1 changes which prompts a step trains
first, not which are trained: every prompt drawn is trained exactly once by the end of the data.

Pure: ``plan`` says what the next step runs and changes nothing; ``commit`` applies a step's
outcome after its optimizer step, so a failed or retried step leaves the queue and the data
position as they were. ``state_dict`` goes into the trainer's checkpoint.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Round:
    kind: str  # "short" | "long"
    prompts: tuple[int, ...]  # dataset indices, in launch order
    responses: int  # per prompt
    accept_prompts: int  # P0 (a long round accepts all of its prompts)
    accept_responses: int  # R0

    @property
    def speculative(self) -> bool:
        return self.kind == "short"


class TailBatcher:
    def __init__(self, prompts: int, responses: int, dataset_size: int | None, *,
                 eta_prompts: float = 1.25, eta_responses: float = 1.25) -> None:
        """``dataset_size``: prompts in the data; None: unbounded (no flush: a run that stops
        leaves its deferred prompts in the checkpoint for the next)."""
        checks = {"prompts": prompts >= 1, "responses": responses >= 1,
                  "dataset_size": dataset_size is None or dataset_size >= 1,
                  "eta_prompts": eta_prompts >= 1,
                  "eta_responses": eta_responses >= 1}
        bad = [key for key, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"tail batching setting {bad[0]} is out of range (counts >= 1, "
                             "eta >= 1)")
        self.p0, self.r0 = prompts, responses
        self.size = dataset_size if dataset_size is not None else sys.maxsize
        self.p = math.ceil(eta_prompts * prompts)
        self.r = math.ceil(eta_responses * responses)
        self.position = 0  # the next fresh prompt
        self.deferred: list[int] = []  # oldest first

    @property
    def done(self) -> bool:
        """Every prompt of the data drawn and trained."""
        return self.position >= self.size and not self.deferred

    def plan(self) -> Round:
        """The next step's round (nothing changes until ``commit``)."""
        if self.done:
            raise ValueError("the data is used up and the deferred queue is empty")
        flush = self.position >= self.size
        if len(self.deferred) >= self.p0 or flush:
            return Round("long", tuple(self.deferred[:self.p0]), self.r0,
                         min(self.p0, len(self.deferred)), self.r0)
        fresh = tuple(range(self.position, min(self.position + self.p, self.size)))
        return Round("short", fresh, self.r, min(self.p0, len(fresh)), self.r0)

    def commit(self, round_: Round, accepted: Collection[int]) -> None:
        """The step ran ``round_`` and trained the ``accepted`` prompts (a short round's
        verdicts; a long round trains all of its prompts)."""
        accepted = set(accepted)
        if not accepted <= set(round_.prompts):
            raise ValueError(f"accepted prompts {sorted(accepted - set(round_.prompts))[:5]} "
                             "were not in the round")
        if round_.kind == "long":
            if accepted != set(round_.prompts):
                raise ValueError("a long round trains every prompt it ran")
            self.deferred = self.deferred[len(round_.prompts):]
            return
        self.position = max(self.position, round_.prompts[-1] + 1) if round_.prompts else \
            self.position
        self.deferred += [i for i in round_.prompts if i not in accepted]

    def state_dict(self) -> dict:
        return {"position": self.position, "deferred": list(self.deferred)}

    def load_state_dict(self, state: dict) -> None:
        position, deferred = state["position"], state["deferred"]
        if not (isinstance(position, int) and 0 <= position <= self.size
                and all(isinstance(i, int) and 0 <= i < position for i in deferred)):
            raise ValueError(f"tail batcher state {state!r} does not fit a dataset of "
                             f"{self.size} prompts")
        self.position, self.deferred = position, list(deferred)

