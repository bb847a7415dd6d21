"""The admission interface the worker core calls: whether an add is taken, and what a weight swap
does to the requests a worker holds.

A policy is pure: synchronous, no I/O, no clock it does not own, deciding from its arguments and
its own configuration only, so it is unit-tested without a worker. The rollout worker's policy is
``services/rollout_worker/admission.py``; the serving co-executor brings its own (ROSE's dual SLO).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from rlharvest.common.engine_types import EngineRequest
from rlharvest.common.errors import ServiceError


@dataclass(frozen=True)
class WorkerView:
    """What an admission decision may read about the worker, as of the decision."""

    weight_version: int  # the engine's loaded version
    held: Collection[str]  # ids of the requests the worker holds: running, queued or starting
    draining: bool  # the worker is about to go away


class Admission(Protocol):
    def admit(self, request: EngineRequest, weight_version: int,
              view: WorkerView) -> ServiceError | None:
        """None to take ``request`` (which asks to be generated with ``weight_version``), or the
        refusal its session receives as a ``CommandError`` (the error's code and message)."""
        ...

    def on_weight_swap(self, version: int, held: Mapping[str, int]) -> Collection[str]:
        """The ids, among ``held`` (request id -> the weight version it was admitted for), that
        end with finish reason "abort" now that ``version`` is loaded. ``held`` includes requests
        not yet started in the engine; those kept run on the new weights."""
        ...
