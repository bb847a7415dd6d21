"""The inference engine interface behind a rollout worker (ARCHITECTURE.md, "Models, data and engines").

An engine is synchronous and single-threaded from its caller's view: the async worker shell calls
``add``/``abort``/``load_weights`` only between ``step`` calls, and runs ``step`` in a worker thread
so gRPC I/O goes on while the batch computes. The built-in implementation is
``torch_engine.TorchEngine``; vLLM is the GPU implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from rlharvest.common.engine_types import EngineLoad, EngineRequest, RequestOutput


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
