"""The admission interface the worker core calls: whether an add is taken, and what a weight swap
does to the requests a worker holds.

A policy is pure: synchronous, no I/O, no clock it does not own, deciding from its arguments and
its own configuration only, so it is unit-tested without a worker. The rollout worker's policy is
``rlharvest/services/rollout_worker/admission.py``; the serving co-executor brings its own (ROSE's dual SLO).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from rlharvest.common.engine_types import EngineRequest
from rlharvest.common.errors import FailedPrecondition, ServiceError


@dataclass(frozen=True)
class Wanted:
    """The weights an add asks for. A weight version is a job's: two jobs at the same
    version number hold different policies, so the job is part of every fence."""

    job: str
    version: int
    start_weights: str = ""  # version 0: the job's start-weights fingerprint ("" = unchecked)


@dataclass(frozen=True)
class WorkerView:
    """What an admission decision may read about the worker, as of the decision."""

    weight_version: int  # the engine's loaded version
    held: Collection[str]  # ids of the requests the worker holds: running, queued or starting
    draining: bool  # the worker is about to go away
    job: str = ""  # whose weights the engine holds ("" before any job's are loaded)
    start_weights: str = ""  # the fingerprint of the engine's version-0 weights


def weights_refusal(wanted: Wanted, view: WorkerView) -> ServiceError | None:
    """The fence every admission policy starts from: the add's job and version are exactly the
    ones whose weights the engine holds (and at version 0, the job's start weights are the
    worker's), else FAILED_PRECONDITION saying which differs."""
    if wanted.job != view.job:
        held = f"job {view.job!r}'s weights" if view.job else "no job's weights yet"
        return FailedPrecondition(f"request is job {wanted.job!r}'s; this worker holds {held}")
    if wanted.version != view.weight_version:
        return FailedPrecondition(f"request wants weight version {wanted.version}, this "
                                  f"worker holds {view.weight_version}")
    if wanted.version == 0 and wanted.start_weights and \
            wanted.start_weights != view.start_weights:
        return FailedPrecondition(
            f"job {wanted.job!r} starts from weights {wanted.start_weights}; this worker's "
            f"version 0 is {view.start_weights or 'unfingerprinted'}")
    return None


class Admission(Protocol):
    def admit(self, request: EngineRequest, wanted: Wanted,
              view: WorkerView) -> ServiceError | None:
        """None to take ``request`` (which asks to be generated with the ``wanted`` weights), or
        the refusal its session receives as a ``CommandError`` (the error's code and message)."""
        ...

    def on_weight_swap(self, version: int, held: Mapping[str, int]) -> Collection[str]:
        """The ids, among ``held`` (request id -> the weight version it was admitted for), that
        end with finish reason "abort" now that ``version`` is loaded. ``held`` includes requests
        not yet started in the engine; those kept run on the new weights."""
        ...
