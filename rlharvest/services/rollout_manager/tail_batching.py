"""RollPacker's tail batching, the manager's half (§3, §4.1): the short round's acceptance rule.

A short round launches P = ceil(eta_P * P0) prompts x R = ceil(eta_R * R0) responses. A prompt
(a group) is *accepted* when R0 of its responses have finished; its other responses are not
needed and are cancelled at once. Once P0 prompts are accepted the round is over: every request
still running is cancelled, and the prompts not accepted are *deferred* (the trainer runs them
again in a long round, on a newer weight version — their partial tokens are discarded, never
resumed: training on them would be off-policy). A long round is a plain step (no rule).

Acceptance follows delivery order: a group's time is when its R0-th finished completion was
delivered, and the first P0 groups by that time are accepted (ties within a tick by the order in
which the step listed its groups). A request that failed does not count towards its group; a
round in which fewer than P0 groups can reach R0 ends when its last request does, every group
not accepted by then deferred. Pure: the step's progress in, request ids to cancel out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from rlharvest.common.errors import InvalidArgument
from rlharvest.services.rollout_manager.step_policy import StepProgress, Verdict

__all__ = ["AcceptanceError", "TailBatchingStep", "Verdict"]


class AcceptanceError(InvalidArgument):
    """The rule cannot be met by the step as submitted."""


class TailBatchingStep:
    name = "tail_batching"
    round_kind = "short"

    def __init__(self, groups: Mapping[str, str], prompts: int, responses: int) -> None:
        """``groups``: request id -> group id, in the step's order; accept ``prompts`` (P0)
        groups of ``responses`` (R0) finished responses each."""
        if prompts < 1 or responses < 1:
            raise AcceptanceError(f"acceptance needs prompts >= 1 and responses >= 1, got "
                                  f"{prompts} and {responses}")
        self._members: dict[str, list[str]] = {}
        for rid, gid in groups.items():
            self._members.setdefault(gid, []).append(rid)
        short = sorted(g for g, m in self._members.items() if len(m) < responses)
        if short:
            raise AcceptanceError(f"group {short[0]!r} has {len(self._members[short[0]])} "
                                  f"responses, fewer than the {responses} a prompt needs")
        if len(self._members) < prompts:
            raise AcceptanceError(f"the step has {len(self._members)} prompts, fewer than the "
                                  f"{prompts} it must accept")
        self.prompts, self.responses = prompts, responses
        self._order = {gid: i for i, gid in enumerate(self._members)}
        self.accepted: list[str] = []  # in acceptance order
        self._told = 0  # verdicts handed out so far (accepted ones), and the deferred ones after
        self._deferred_told = False

    @property
    def closed(self) -> bool:
        """P0 prompts are accepted: the round is over."""
        return len(self.accepted) >= self.prompts

    def cut(self, step: StepProgress, now: float) -> Collection[str]:
        self._accept(step)
        outstanding = step.outstanding
        if self.closed:
            return list(outstanding)
        return [rid for gid in self.accepted for rid in self._members[gid] if rid in outstanding]

    def verdicts(self, step: StepProgress) -> list[Verdict]:
        """Verdicts not handed out yet: each accepted group once it is accepted; the deferred
        ones once the round is over (closed, or nothing of it outstanding). Asked after each
        delivery, so a group's verdict goes out with its R0-th finished response."""
        self._accept(step)
        out = [Verdict(gid, True) for gid in self.accepted[self._told:]]
        self._told = len(self.accepted)
        if not self._deferred_told and (self.closed or not step.outstanding):
            self._deferred_told = True
            taken = set(self.accepted)
            out += [Verdict(gid, False) for gid in self._members if gid not in taken]
        return out

    def _accept(self, step: StepProgress) -> None:
        """Accept groups in the order their R0-th finished response was delivered."""
        if self.closed:
            return
        finished = step.succeeded  # request id -> delivery sequence number
        taken = set(self.accepted)
        ready = []
        for gid, members in self._members.items():
            if gid in taken:
                continue
            seqs = sorted(finished[rid] for rid in members if rid in finished)
            if len(seqs) >= self.responses:
                ready.append((seqs[self.responses - 1], self._order[gid], gid))
        for *_, gid in sorted(ready)[:self.prompts - len(self.accepted)]:
            self.accepted.append(gid)
