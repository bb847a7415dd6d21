"""The pure parts of one RL step: the requests it submits, the groups it assembles from the
manager's completions, and which weight version a resumed run continues with.

Synchronous and I/O-free (docs/architecture.md, "pure core"); ``loop.py`` drives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb
from rlharvest.services.trainer.tasks import TaskItem


class OnPolicyViolation(RuntimeError):
    """A completion (or one of its deltas) carries a weight version other than the step's.
    Training on it would break the on-policy invariant, so the step is refused."""


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
class StepSpec:
    step: int
    weight_version: int
    items: tuple[TaskItem, ...]
    prompts: tuple[tuple[int, ...], ...]  # token ids, one per item
    samples_per_prompt: int

    @property
    def samples(self) -> int:
        return len(self.items) * self.samples_per_prompt


def submit_request(spec: StepSpec, *, max_new_tokens: int, temperature: float, top_p: float,
                   stop_token_ids: Sequence[int], data_seed: int,
                   no_worker_deadline_s: float) -> mpb.SubmitStepRequest:
    """The SubmitStep of a step: R0 samples of each of the P0 prompts, one GRPO group each."""
    requests = []
    for g, prompt in enumerate(spec.prompts):
        for r in range(spec.samples_per_prompt):
            requests.append(mpb.RolloutRequest(
                request_id=request_id(spec.step, g, r), group_id=f"s{spec.step}-g{g}",
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(
                    temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                    stop_token_ids=list(stop_token_ids),
                    seed=sample_seed(data_seed, spec.step, g, r))))
    return mpb.SubmitStepRequest(step_id=f"step-{spec.step}", weight_version=spec.weight_version,
                                 requests=requests,
                                 no_worker_deadline_s=no_worker_deadline_s)


@dataclass
class _Group:
    completions: dict[int, mpb.Completion] = field(default_factory=dict)
    rewards: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ReadyGroup:
    group: int
    completions: tuple[mpb.Completion, ...]  # by sample index
    rewards: tuple[float, ...]


class GroupAssembler:
    """Collects one step's completions and rewards into complete GRPO groups.

    Checks the on-policy invariant on every delta and completion it sees, and that each sample
    arrives once. A group is ready when all R0 of its samples are rewarded."""

    def __init__(self, spec: StepSpec) -> None:
        self._spec = spec
        self._groups = [_Group() for _ in spec.items]
        self.completions = 0
        self.tokens_generated = 0
        self.migrations = 0

    def parse(self, rid: str) -> tuple[int, int]:
        prefix = f"s{self._spec.step}-g"
        group, sep, sample = rid.removeprefix(prefix).partition("-r")
        if not rid.startswith(prefix) or not sep or not group.isdigit() or not sample.isdigit() \
                or int(group) >= len(self._groups) or int(sample) >= self._spec.samples_per_prompt:
            raise ValueError(f"request id {rid!r} is not one of step {self._spec.step}'s")
        return int(group), int(sample)

    def delta(self, delta: common_pb2.TokenDelta) -> None:
        if delta.weight_version != self._spec.weight_version:
            raise OnPolicyViolation(
                f"request {delta.request_id}: tokens {delta.position}.. came from weight version "
                f"{delta.weight_version}, the step runs on {self._spec.weight_version}")
        self.tokens_generated += len(delta.token_ids)

    def completion(self, completion: mpb.Completion) -> tuple[int, int]:
        """Record a completion; returns its (group, sample). Raises on a failed, foreign,
        duplicate or off-policy completion."""
        group, sample = self.parse(completion.request_id)
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
        slot = self._groups[group].completions
        if sample in slot:
            raise ValueError(f"request {completion.request_id} completed twice")
        slot[sample] = completion
        self.completions += 1
        self.migrations += completion.migrations
        return group, sample

    def reward(self, group: int, sample: int, reward: float) -> ReadyGroup | None:
        """Record a sample's reward; returns the group once all its samples are rewarded."""
        g = self._groups[group]
        g.rewards[sample] = reward
        if len(g.rewards) < self._spec.samples_per_prompt:
            return None
        order = range(self._spec.samples_per_prompt)
        return ReadyGroup(group, tuple(g.completions[i] for i in order),
                          tuple(g.rewards[i] for i in order))


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
