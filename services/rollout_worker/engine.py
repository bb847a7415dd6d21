"""The inference engine interface behind a rollout worker (ARCHITECTURE.md, "Models, data and engines").

An engine is synchronous and single-threaded from its caller's view: the async worker shell calls
``add``/``abort``/``load_weights`` only between ``step`` calls, and runs ``step`` in a worker thread
so gRPC I/O goes on while the batch computes. The built-in implementation is
``torch_engine.TorchEngine``; vLLM is the GPU implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch


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


class Engine(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def weight_version(self) -> int: ...

    def add(self, request: EngineRequest) -> None:
        """Queue a request (raises EngineInputError for bad input: empty prompt, ids outside the
        vocabulary, max_tokens <= 0, temperature < 0, top_p outside (0, 1], top_k < 0, a duplicate
        id, prompt + max_tokens beyond the context, or a resume with nothing left to generate)."""

    def abort(self, request_id: str) -> RequestOutput:
        """Drop a pending or executing request; returns its final output (finish_reason "abort").
        Raises KeyError for an unknown id."""

    def has_work(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Admit pending requests into free slots (prefill) and run one batched decode step.
        Every executing request appears at most once; finished ones leave the batch."""

    def load(self) -> EngineLoad: ...

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace weights in place (names as in the model's state_dict; any subset) and set the
        version. All tensors are validated first: on EngineInputError nothing was changed.
        Requests in flight keep KV computed by the old weights: the caller aborts them."""
