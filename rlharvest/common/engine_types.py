"""Wire-neutral types of the engine contract: sampling parameters, an engine request, one step's
output per request, an engine's load, and their proto conversion.

The control plane (rollout manager, simulator, benchmarks of the control plane) uses these without
importing torch; the engine interface itself (``rlharvest/common/worker_core/engine.py``) adds the
torch-typed parts. Like vLLM's ``sampling_params.py``: one definition every side shares.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from rlharvest.common.pb import common_pb2


class EngineInputError(ValueError):
    """A request the engine refuses; the message says what is wrong. The engine keeps serving."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    max_tokens: int = 64  # total generated tokens, counting those generated before a resume
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0  # randomness is keyed by (seed, token position): resumes continue identically


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Resume: tokens this request already generated elsewhere. They are prefilled with the prompt
    # in one pass and count towards max_tokens; sampling continues at position len(generated).
    generated_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]  # a stop token that ends the request is included
    # Per token: log-softmax of the model's raw logits (temperature 1, before top-k/top-p) at the
    # chosen token, i.e. the policy's own logprob, which the trainer's importance ratio needs.
    new_logprobs: list[float]
    finished: bool = False
    finish_reason: str = ""  # "" while running, else "length" | "stop" | "abort"


@dataclass(frozen=True)
class EngineLoad:
    pending: int  # admitted but waiting for a batch slot
    executing: int  # in the running batch
    kv_used_tokens: int
    kv_capacity_tokens: int
    weight_version: int
    preemptions: int = 0  # requests preempted for KV memory and recomputed, since start
    prefix_lookups: int = 0  # prefix cache, totals since start: requests looked up,
    prefix_hits: int = 0  # those that started after a cached prefix,
    prefix_cached_tokens: int = 0  # and the prefill tokens they skipped;
    prefix_cache_pages: int = 0  # pages the cache holds now


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k,
                          max_tokens=msg.max_tokens, stop_token_ids=tuple(msg.stop_token_ids),
                          seed=msg.seed)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p,
                                     top_k=params.top_k, max_tokens=params.max_tokens,
                                     stop_token_ids=params.stop_token_ids, seed=params.seed)


def natural_end(token_ids: Sequence[int], max_tokens: int, stop_token_ids: Collection[int]) -> str:
    """Why these generated tokens are a whole completion by themselves ("" when they are not):
    a stop token last, else max_tokens reached. The manager's rule, which a client resuming a
    request applies too."""
    if token_ids and token_ids[-1] in stop_token_ids:
        return "stop"
    if len(token_ids) >= max_tokens:
        return "length"
    return ""

# The gRPC metadata key of a Session stream naming the job of the manager that opens it: the
# worker announces kept requests only to that job's manager, and adopts them only for it.
SESSION_JOB_METADATA = "rlh-job"
