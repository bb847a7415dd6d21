"""The inference engine interface the worker core drives.

An engine is synchronous and single-threaded from its caller's view: the core calls ``add``,
``abort``, ``load`` and ``load_weights`` only between ``step`` calls, and runs ``step`` (and a
weight load) in a dedicated thread so gRPC I/O goes on while the batch computes. The built-in
implementation is ``rlharvest/services/rollout_worker/torch_engine.TorchEngine``; vLLM is the GPU one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rlharvest.common.engine_types import EngineLoad, EngineRequest, RequestOutput

if TYPE_CHECKING:  # the core runs without torch; only engines need it
    import torch


class Engine(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def weight_version(self) -> int: ...

    @property
    def start_weights(self) -> str:
        """The fingerprint (rlharvest/common/start_weights.py) of the version-0 weights the engine holds
        or last held: a manager sends a job's version-0 requests only where it is the job's."""
        ...

    @property
    def batch_admission(self) -> str:
        """How queued requests enter the running batch: "slots" (up to a fixed number of
        sequences, ``max_running``), or "kv_memory" (while KV-cache blocks last, as vLLM does). The
        worker publishes it in its member record; the manager reads it (worker_pool.Admission)."""
        ...

    @property
    def last_step_prefill_tokens(self) -> int:
        """Prompt and resume tokens the last ``step()`` prefilled (0 before the first step)."""
        ...

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


@runtime_checkable
class SelfTimed(Protocol):
    """An engine whose ``step`` may hand out a step computed earlier (``EngineProcess``: in
    another process, ahead of its caller), so the caller's clock around ``step`` does not time
    it: it says what the step it returned took and which weight version computed it."""

    @property
    def last_step_seconds(self) -> float: ...

    @property
    def last_step_weight_version(self) -> int: ...
