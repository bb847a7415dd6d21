"""Shared test builders: a clock that moves only when a test says so, rollout requests, and steps
(requests in GRPO groups), for the manager's core, its wire, and the trainer.

One place, like vLLM's ``create_requests``/``create_scheduler``: when a request's shape changes,
the builders change, not every test file. Builders take keywords for what a test cares about and
default the rest to small valid values.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING

from rlharvest.common.engine_types import SamplingParams, sampling_to_proto
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.common.registry import Membership
from rlharvest.models.tokenizer import CharTokenizer
from rlharvest.services.rollout_manager.tracker import NewRequest
from rlharvest.services.trainer.step_plan import Acceptance, StepSpec
from rlharvest.services.trainer.tasks import TaskDataset

if TYPE_CHECKING:  # the stream trainer imports torch; the manager's tests need not
    from rlharvest.models.decoder_weights import DecoderWeights
    from rlharvest.services.trainer.stream_trainer import RewardedGroup


def decoder_of(model) -> DecoderWeights:
    """The rollout engine's weight store holding a copy of a transformers module's weights."""
    import torch

    from rlharvest.models.decoder_weights import DecoderConfig, DecoderWeights

    dtype = next(model.parameters()).dtype
    weights = DecoderWeights(DecoderConfig.from_dict(model.config.to_dict()), dtype)
    with torch.no_grad():
        weights.load_state_dict(model.state_dict())
    return weights


class Clock:
    """Seconds that pass only when a test says so. Pass it where a core takes ``clock``; set
    ``now`` to jump to an instant, or ``advance`` by a duration."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move time forward (never back: the cores read it as a monotonic clock)."""
        if seconds < 0:
            raise ValueError(f"a clock only moves forward; advance({seconds}) would go back")
        self.now += seconds
        return self.now


# ---- requests and steps as the manager's core sees them --------------------------------------

def request(request_id: str = "r0", *, group: str = "g", prompt: Sequence[int] = (1, 2, 3),
            max_tokens: int = 16, version: int = 0, stop: Sequence[int] = (),
            temperature: float = 1.0, seed: int = 0,
            no_worker_timeout_s: float | None = None) -> NewRequest:
    """One rollout request for the manager's core."""
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                              stop_token_ids=tuple(stop), seed=seed)
    return NewRequest(request_id, group, tuple(prompt), sampling, version, no_worker_timeout_s)


def step(n: int, *, group_size: int = 4, prefix: str = "r",
         prompts: Sequence[Sequence[int]] = ((1, 2, 3),), max_tokens: int | Sequence[int] = 16,
         version: int = 0, seed: int = 0) -> list[NewRequest]:
    """``n`` requests ``{prefix}0..{prefix}{n-1}`` in GRPO groups of ``group_size``: request i is
    in group ``g{i // group_size}``, whose samples share a prompt (the groups take ``prompts`` in
    turn) and differ by seed. ``max_tokens`` is one budget for all or one per request."""
    budgets = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    if len(budgets) != n:
        raise ValueError(f"{len(budgets)} max_tokens for {n} requests; give one or one each")
    return [request(f"{prefix}{i}", group=f"g{i // group_size}",
                    prompt=prompts[(i // group_size) % len(prompts)], max_tokens=budgets[i],
                    version=version, seed=seed + i)
            for i in range(n)]


def submit_step(requests: Sequence[NewRequest], step_id: str = "s",
                no_worker_deadline_s: float = 0.0) -> mpb.SubmitStepRequest:
    """The same requests on the wire: what a trainer sends to ``RolloutManager.SubmitStep``.
    Every request must share one weight version (a step runs on one)."""
    versions = {r.weight_version for r in requests}
    if len(versions) > 1:
        raise ValueError(f"a step runs on one weight version; these requests hold {versions}")
    return mpb.SubmitStepRequest(
        step_id=step_id, weight_version=versions.pop() if versions else 0,
        no_worker_deadline_s=no_worker_deadline_s, requests=[
            mpb.RolloutRequest(request_id=r.request_id, group_id=r.group_id,
                               prompt_token_ids=r.prompt_token_ids,
                               sampling=sampling_to_proto(r.sampling))
            for r in requests])


# ---- steps as the trainer sees them ------------------------------------------------------------

def step_spec(*, step_number: int = 5, version: int = 3, prompts: int = 2, samples: int = 2,
              data_seed: int = 0, accept: Acceptance | None = None) -> StepSpec:
    """A trainer step: ``prompts`` addition-task items, ``samples`` samples (one group) each;
    with ``accept``, a short round of tail batching."""
    tok = CharTokenizer()
    items = tuple(TaskDataset(seed=data_seed).next_batch(prompts))
    return StepSpec(step=step_number, weight_version=version, items=items,
                    prompts=tuple(tuple(tok.encode(i.prompt)) for i in items),
                    samples_per_prompt=samples, accept=accept,
                    round="short" if accept else "")


def rewarded_groups(seed: int, num_groups: int = 5, group_size: int = 3) -> list[RewardedGroup]:
    """Rewarded GRPO groups for the stream trainer: random prompts and completions, rollout
    logprobs off-policy enough to exercise clipping, and group 0 tied (zero advantage)."""
    # Imported here: the stream trainer pulls in torch, which the manager's tests never need.
    from rlharvest.services.trainer.stream_trainer import Completion, RewardedGroup

    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        completions, rewards = [], []
        for _ in range(group_size):
            prompt = [1] + [rng.randrange(3, 100) for _ in range(rng.randint(1, 3))]
            tokens = [rng.randrange(3, 100) for _ in range(rng.randint(1, 5))]
            old = [rng.uniform(-6.0, -3.0) for _ in tokens]
            completions.append(Completion(prompt, tokens, old))
            rewards.append(1.0 if g == 0 else rng.choice([0.0, 0.5, 1.0]))
        groups.append(RewardedGroup(g, completions, rewards))
    return groups


@dataclass
class PolicyProgress:
    """A manager step as a step policy sees it (``step_policy.StepProgress``), driven by a test:
    ``deliver`` is the manager handing a request's completion to the client."""

    request_ids: tuple[str, ...]
    outstanding: set[str] = field(default_factory=set)
    succeeded: dict[str, int] = field(default_factory=dict)
    delivered: int = 0
    step_id: str = "s"
    weight_version: int = 0
    started_at: float = 0.0

    def deliver(self, rid: str, ok: bool) -> None:
        self.outstanding.discard(rid)
        self.delivered += 1
        if ok:
            self.succeeded[rid] = self.delivered


def drain_tokens(engine) -> dict[str, list[int]]:
    """Step an engine (in-process, or any ``Engine``) until it has no work: each request's
    tokens, in order."""
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


class FlakyEtcd:
    """aetcd's put, failing while ``down`` and for its first ``failures`` calls; what reached
    etcd, in order. For a member record's writes (``stub_membership``). Its reads find no key
    (a keyspace no one wrote: no job declared its start weights, say)."""

    def __init__(self, failures: int = 0) -> None:
        self.down, self.failures, self.records = False, failures, []

    async def put(self, key: bytes, value: bytes, lease=None) -> None:
        if self.down or self.failures:
            self.failures = max(self.failures - 1, 0)
            raise ConnectionError("etcd unreachable")
        self.records.append(json.loads(value))

    async def get(self, key: bytes) -> None:
        if self.down:
            raise ConnectionError("etcd unreachable")
        return None


def stub_membership(etcd: FlakyEtcd, key: str, info: dict) -> Membership:
    """A real Membership writing through ``etcd`` (its lease a stand-in that never lapses);
    cancel its ``_keepalive`` when done."""
    return Membership(etcd, key, SimpleNamespace(ttl=60), info)  # type: ignore[arg-type]



def job_weights(seed: int, factor: float = 10.0) -> dict:
    """A job's own start weights: the tiny preset at ``seed`` with its projections and
    embedding scaled by ``factor``. Unscaled, every tiny seed's greedy tokens are one repeated
    token; scaled, two seeds' greedy completions differ at once, so a token of the other job's
    weights is seen."""
    from rlharvest.models.tiny_model import build_model

    return {name: (t * factor if "proj" in name or "embed" in name else t).contiguous()
            for name, t in build_model("tiny", seed=seed).state_dict().items()
            if name != "lm_head.weight"}  # tied to the embedding


def greedy_reference(weights: dict, prompts: dict[str, list[int]], max_tokens: int
                     ) -> tuple[dict[str, list[int]], str]:
    """What a worker holding only ``weights`` (as version 0) generates greedily for each prompt,
    and the fingerprint of those start weights as the worker reports it."""
    from rlharvest.common.engine_types import EngineRequest
    from rlharvest.services.rollout_worker.torch_engine import TorchEngine

    engine = TorchEngine("tiny", max_running=len(prompts), max_len=128)
    engine.load_weights(weights, 0)
    for rid, prompt in prompts.items():
        engine.add(EngineRequest(rid, prompt, SamplingParams(temperature=0.0,
                                                             max_tokens=max_tokens)))
    return drain_tokens(engine), engine.start_weights
