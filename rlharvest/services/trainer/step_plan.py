"""The pure parts of one RL step: the requests it submits, the groups it assembles from the
manager's completions, and which weight version a resumed run continues with.

Synchronous and I/O-free (docs/architecture.md, "pure core"); ``loop.py`` drives them.
"""

from __future__ import annotations

import array
import hashlib

from collections.abc import Sequence
from dataclasses import dataclass, field

from rlharvest.common import delta_batch
from rlharvest.common.delta_batch import Row
from rlharvest.common.engine_types import natural_end
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb
from rlharvest.services.trainer.load_model import LengthModel
from rlharvest.services.trainer.tasks import TaskItem


class OnPolicyViolation(RuntimeError):
    """A completion (or one of its deltas) carries a weight version other than the step's.
    Training on it would break the on-policy invariant, so the step is refused."""


class StreamIncomplete(RuntimeError):
    """The step's stream ended before every request resolved (or, in a short round, before the
    round's groups were decided): retried whole."""


class RolloutFailed(RuntimeError):
    """The manager gave up on a request (e.g. no worker held the step's version in time).
    Every prompt trains, so the step cannot finish without it: it is retried whole."""


def request_id(step: int, group: int, sample: int) -> str:
    return f"s{step}-g{group}-r{sample}"


def sample_seed(data_seed: int, step: int, group: int, sample: int) -> int:
    """Sampling seed of one sample: a pure function of its place in the run, so a step that is
    retried or resumed after a crash samples exactly what it would have sampled the first time."""
    return (data_seed * 1_000_003 + step * 10_007 + group * 101 + sample) % (1 << 63)


@dataclass(frozen=True)
class Acceptance:
    """A short round's rule (tail batching): train the first ``prompts`` groups whose first
    ``responses`` responses finish; the manager cancels the rest."""

    prompts: int
    responses: int


@dataclass(frozen=True)
class StepSpec:
    step: int
    weight_version: int
    items: tuple[TaskItem, ...]
    prompts: tuple[tuple[int, ...], ...]  # token ids, one per item
    samples_per_prompt: int  # responses launched per prompt
    accept: Acceptance | None = None  # a short round of tail batching; None: all trains
    round: str = ""  # tail batching: "short" | "long"; "" without it

    @property
    def samples(self) -> int:
        """Requests the step launches."""
        return len(self.items) * self.samples_per_prompt

    @property
    def train_groups(self) -> int:
        return self.accept.prompts if self.accept else len(self.items)

    @property
    def group_size(self) -> int:
        """Responses that train per group."""
        return self.accept.responses if self.accept else self.samples_per_prompt


def submit_request(spec: StepSpec, *, max_new_tokens: int, temperature: float, top_p: float,
                   stop_token_ids: Sequence[int], data_seed: int,
                   no_worker_deadline_s: float,
                   lengths: LengthModel | None = None,
                   seed_window_s: float = 0.0) -> mpb.SubmitStepRequest:
    """The SubmitStep of a step: R0 samples of each of the P0 prompts, one GRPO group each.
    ``lengths`` (benchmarks only): each request runs exactly its modelled length."""
    requests = []
    for g, prompt in enumerate(spec.prompts):
        for r in range(spec.samples_per_prompt):
            max_tokens = lengths.tokens(spec.items[g].index, spec.step, r) if lengths else \
                max_new_tokens
            requests.append(mpb.RolloutRequest(
                request_id=request_id(spec.step, g, r), group_id=f"s{spec.step}-g{g}",
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(
                    temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                    stop_token_ids=[] if lengths else list(stop_token_ids),
                    seed=sample_seed(data_seed, spec.step, g, r))))
    acceptance = (mpb.Acceptance(prompts=spec.accept.prompts, responses=spec.accept.responses)
                  if spec.accept else None)
    return mpb.SubmitStepRequest(step_id=f"step-{spec.step}", weight_version=spec.weight_version,
                                 requests=requests, acceptance=acceptance,
                                 seed_window_s=seed_window_s,
                                 no_worker_deadline_s=no_worker_deadline_s)


@dataclass
class _Group:
    completions: dict[int, mpb.Completion] = field(default_factory=dict)  # by sample index
    training: list[int] = field(default_factory=list)  # samples that train, as they finished
    rewards: dict[int, float] = field(default_factory=dict)
    accepted: bool | None = None  # a short round's verdict; a plain step trains every group


@dataclass(frozen=True)
class ReadyGroup:
    group: int
    completions: tuple[mpb.Completion, ...]  # by sample index
    rewards: tuple[float, ...]


@dataclass
class _Partial:
    """One request's tokens as streamed. A delta that leaves a gap breaks the record (the
    request then resumes from its prompt); one that overlaps rewrites from its position (the same
    seeded tokens)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""  # "stop" | "length" once its final delta came
    broken: bool = False

    def add(self, row: Row) -> None:
        if row.position > len(self.token_ids):
            self.broken = True
            return
        del self.token_ids[row.position:], self.logprobs[row.position:]
        self.token_ids.extend(row.token_ids)
        self.logprobs.extend(row.logprobs)
        if row.end in ("stop", "length"):
            self.finish_reason = row.end

    def ended(self, sampling: common_pb2.SamplingParams) -> str:
        """Why these tokens are a whole completion ("" when not): the final delta said so, or
        the manager's own rule (``natural_end``)."""
        return self.finish_reason or natural_end(self.token_ids, sampling.max_tokens,
                                                 sampling.stop_token_ids)


class GroupAssembler:
    """Collects one step's completions and rewards into complete GRPO groups.

    Checks the on-policy invariant on every delta and completion it sees, and that each sample
    arrives once. A group is ready when it trains (a plain step's every group; a short round's
    accepted ones, by the manager's verdict) and its training samples are rewarded: all of them,
    or in a short round its first R0 to finish. A short round's other completions — cancelled,
    beyond R0, or of a deferred group — never train; their tokens count as discarded."""

    def __init__(self, spec: StepSpec) -> None:
        self._spec = spec
        plain = spec.accept is None
        self._groups = [_Group(accepted=True if plain else None) for _ in spec.items]
        self.completions = 0  # finished ones
        self.cancelled = 0  # a short round's cancelled and failed requests
        self.tokens_generated = 0
        self.tokens_discarded = 0
        self.migrations = 0
        # Groups that train, in the order of their verdicts (a plain step: all, from the start).
        self.accepted: list[int] = list(range(len(spec.items))) if plain else []
        self.deferred: list[int] = []
        self._partial: dict[str, _Partial] = {}  # tokens streamed per request: resume payloads

    def parse(self, rid: str) -> tuple[int, int]:
        prefix = f"s{self._spec.step}-g"
        group, sep, sample = rid.removeprefix(prefix).partition("-r")
        if not rid.startswith(prefix) or not sep or not group.isdigit() or not sample.isdigit() \
                or int(group) >= len(self._groups) or int(sample) >= self._spec.samples_per_prompt:
            raise ValueError(f"request id {rid!r} is not one of step {self._spec.step}'s")
        return int(group), int(sample)

    def group_of(self, group_id: str) -> int:
        """The index of one of the step's group ids (``s<step>-g<index>``)."""
        return self.parse(f"{group_id}-r0")[0]

    def rows(self, batch: common_pb2.DeltaBatch, request_ids: Sequence[str]) -> None:
        """One event's rows; ``request_ids``: the submission's, which the rows index."""
        if not batch.requests:
            return
        rows = delta_batch.decode(batch)
        if rows.weight_version != self._spec.weight_version:
            raise OnPolicyViolation(
                f"request {request_ids[int(rows.requests[0])]}: tokens came from weight version "
                f"{rows.weight_version}, the step runs on {self._spec.weight_version}")
        self.tokens_generated += len(rows.token_ids)
        partial = self._partial
        for row in rows.iter():
            partial.setdefault(request_ids[row.request], _Partial()).add(row)

    def resume(self, request: mpb.SubmitStepRequest
               ) -> tuple[mpb.SubmitStepRequest, list[mpb.Completion]]:
        """The step's manager died: ``request`` again with only the requests that have no
        completion yet, each carrying the tokens already streamed (a resume payload: the next
        manager continues after the last token), and completions for those whose final delta
        came but whose completion did not."""
        pending, finished = [], []
        for original in request.requests:
            group, sample = self.parse(original.request_id)
            if sample in self._groups[group].completions:
                continue
            part = self._partial.get(original.request_id)
            reason = None if part is None or part.broken else part.ended(original.sampling)
            if part is not None and reason:
                finished.append(mpb.Completion(
                    request_id=original.request_id, token_ids=part.token_ids,
                    logprobs=part.logprobs, weight_version=self._spec.weight_version,
                    finish_reason=reason))
                continue
            resumed = mpb.RolloutRequest()
            resumed.CopyFrom(original)
            if part is not None and not part.broken:
                resumed.resume_token_ids.extend(part.token_ids)
                resumed.resume_logprobs.extend(part.logprobs)
            pending.append(resumed)
        again = mpb.SubmitStepRequest()
        again.CopyFrom(request)
        del again.requests[:]
        again.requests.extend(pending)
        return again, finished

    def completion(self, completion: mpb.Completion) -> tuple[int, int] | None:
        """Record a completion; returns its (group, sample) when it is to be rewarded, None when
        it will not train. Raises on a failed, foreign, duplicate or off-policy completion."""
        group, sample = self.parse(completion.request_id)
        g = self._groups[group]
        if sample in g.completions:
            raise ValueError(f"request {completion.request_id} completed twice")
        self._partial.pop(completion.request_id, None)  # a completion carries its own tokens
        if (completion.cancelled or completion.failed) and self._spec.accept is not None:
            # A short round: cancelled by the rule, or failed — which, by the manager's rule,
            # does not count towards its group (too few accepted groups: check_complete).
            g.completions[sample] = completion
            self.cancelled += 1
            return None
        if completion.failed:
            raise RolloutFailed(f"request {completion.request_id} failed: "
                                f"{completion.finish_reason}")
        if completion.weight_version != self._spec.weight_version:
            raise OnPolicyViolation(
                f"request {completion.request_id} completed on weight version "
                f"{completion.weight_version}, the step runs on {self._spec.weight_version}")
        if len(completion.logprobs) != len(completion.token_ids):
            raise ValueError(f"request {completion.request_id}: {len(completion.logprobs)} "
                             f"logprobs for {len(completion.token_ids)} tokens")
        g.completions[sample] = completion
        self.completions += 1
        self.migrations += completion.migrations
        if g.accepted is False or len(g.training) >= self._spec.group_size:
            self.tokens_discarded += len(completion.token_ids)  # beyond R0, or deferred
            return None
        g.training.append(sample)
        return group, sample

    def verdict(self, group_id: str, accepted: bool) -> ReadyGroup | None:
        """A short round's verdict on a group; returns the group if it is ready now."""
        group = self.group_of(group_id)
        g = self._groups[group]
        if self._spec.accept is None or g.accepted is not None:
            raise ValueError(f"group {group_id} was already given a verdict, or the step has no "
                             "acceptance rule")
        g.accepted = accepted
        if not accepted:
            self.deferred.append(group)
            self.tokens_discarded += sum(len(g.completions[s].token_ids) for s in g.training)
            return None
        if len(self.accepted) >= self._spec.train_groups:
            raise ValueError(f"group {group_id} accepted beyond the round's "
                             f"{self._spec.train_groups}")
        self.accepted.append(group)
        return self._ready(group)

    def reward(self, group: int, sample: int, reward: float) -> ReadyGroup | None:
        """Record a sample's reward; returns the group once it trains and is rewarded."""
        self._groups[group].rewards[sample] = reward
        return self._ready(group)

    def _ready(self, group: int) -> ReadyGroup | None:
        g = self._groups[group]
        if not g.accepted or len(g.rewards) < self._spec.group_size:
            return None
        order = sorted(g.training)  # sample order: with eta = 1 exactly the plain step's groups
        return ReadyGroup(group, tuple(g.completions[i] for i in order),
                          tuple(g.rewards[i] for i in order))

    def digest(self) -> str:
        """SHA-256 of every completion's token ids, by group then sample ("" before any)."""
        if not any(g.completions for g in self._groups):
            return ""
        sha = hashlib.sha256()
        for index, g in enumerate(self._groups):
            for sample in sorted(g.completions):
                ids = g.completions[sample].token_ids
                sha.update(f"{index}:{sample}:{len(ids)};".encode())
                sha.update(array.array("i", ids).tobytes())
        return sha.hexdigest()

    def check_complete(self) -> None:
        """At the end of the stream: every request resolved, every group given its verdict."""
        resolved = self.completions + self.cancelled
        if resolved != self._spec.samples:
            raise StreamIncomplete(f"the step stream ended after {resolved} of "
                                   f"{self._spec.samples} completions")
        undecided = sum(g.accepted is None for g in self._groups)
        if undecided or len(self.accepted) != self._spec.train_groups:
            raise StreamIncomplete(f"the step stream ended with {len(self.accepted)} of "
                                   f"{self._spec.train_groups} groups accepted and {undecided} "
                                   "without a verdict")


def resume_version(checkpoint_version: int, announced_version: int | None) -> tuple[int, bool]:
    """Which version the restored weights carry, and whether they must be published.

    Versions only move forward (workers pull the newest announced one). After a crash the trainer
    may have published versions its last checkpoint does not hold; the restored weights then
    become a NEW version above them, never an old number workers have moved past. Returns
    ``(version, publish)``; ``publish`` is False only when the announced version is the
    checkpoint's own (the agents and workers already have these exact weights)."""
    if announced_version is None or announced_version < checkpoint_version:
        return checkpoint_version, checkpoint_version > 0
    if announced_version == checkpoint_version:
        return checkpoint_version, False
    return announced_version + 1, True
