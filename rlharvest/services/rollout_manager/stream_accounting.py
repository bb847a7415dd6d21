"""What the rollout manager feeds RollPacker's stream-trainer scaling (stream_scaling.py), and the
record it publishes: pure, no clock, no I/O (stream_scaler.py does the rest).

**Which workers.** The candidates (to keep or to lend) are the job's own rollout workers that
could take the step's requests right now: healthy, on the step's weight version, not standing
by beyond the instance cap, with a KV capacity reported (``Load.kv_capacity_tokens``). Serving
co-executors lent to the job (kind ``serving``) are not candidates: they are the serving
fleet's GPUs, not the job's to give to its trainer, and their KV is shared with serving traffic
the manager does not see. A step's request on a worker that is not a candidate (a co-executor, a
draining worker) is passed as *waiting*: the projection places it on the kept workers, the
conservative side.

**Capacity.** A candidate's capacity for this step is its KV capacity less the contexts of the
requests of *other* steps (or single ``Generate`` calls) on it now, at least 1 token: the policy
projects one step's requests; the others' KV is taken as staying where it is.

**History.** The finished response lengths of the job's previous step (``SubmitStep`` that
finished with at least one finished response). Without one (the manager's first step) the
history is ``[max_tokens]``: every request is predicted to run to the step's ``max_tokens``, the
conservative prediction (``LengthPredictor`` needs a non-empty history).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from rlharvest.common.records import json_object
from rlharvest.services.rollout_manager.stream_scaling import (
    RemainingRequest,
    ScaleDown,
    WorkerKV,
)
from rlharvest.services.rollout_manager.worker_pool import SERVING_KIND

# Worker kinds that are never lent to training: serving co-executors borrowed from the serving
# fleet (ROSE §5); they serve on after the job gives them back, not train.
# Seed workers (the trainer's own engine, RLBoost §4.1) are lent by their seeding window
# (seed_window.py), never by this policy.
NOT_LENDABLE_KINDS = frozenset({SERVING_KIND, "seed"})


class RequestLike(Protocol):
    """What ``kv_view`` reads of a tracked request (``tracker.TrackedRequest``)."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def worker_id(self) -> str | None: ...
    @property
    def done(self) -> bool: ...


class WorkerLike(Protocol):
    """What ``candidates`` reads of a worker (``worker_pool.WorkerView``)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def kv_capacity_tokens(self) -> int: ...


def step_max_tokens(max_tokens: Iterable[int]) -> int:
    """The step's max_tokens: the largest of its requests' ``sampling.max_tokens``."""
    return max(max_tokens)


def scaling_history(last_lengths: Iterable[int], max_tokens: int) -> list[int]:
    """The history a step's decision predicts from: the previous step's finished lengths
    (empty responses left out), or ``[max_tokens]`` when there are none."""
    return [h for h in last_lengths if h >= 1] or [max_tokens]


def candidates(workers: Iterable[WorkerLike]) -> dict[str, int]:
    """Worker id -> KV capacity of the workers the decision may keep or lend, out of
    ``workers`` (already those eligible for the step's version): lendable kinds with a reported
    KV capacity."""
    return {w.worker_id: w.kv_capacity_tokens for w in workers
            if w.kind not in NOT_LENDABLE_KINDS and w.kv_capacity_tokens > 0}


@dataclass(frozen=True)
class KvView:
    """The step as ``StreamScaling.observe`` takes it."""

    completed: int
    workers: tuple[WorkerKV, ...]
    waiting: tuple[RemainingRequest, ...]


def kv_view(total: int, remaining: Iterable[RequestLike], capacities: Mapping[str, int],
            held_by_others: Mapping[str, int] | None = None) -> KvView:
    """``total`` requests in the step; ``remaining``: its requests whose completion is not
    delivered yet (done ones are skipped: they count as completed); ``capacities``: the
    candidates (``candidates``); ``held_by_others``: worker id -> context tokens of other steps'
    requests on it. Every candidate appears, with or without requests of the step."""
    others = held_by_others or {}
    running: dict[str, list[RemainingRequest]] = {w: [] for w in capacities}
    waiting: list[RemainingRequest] = []
    left = 0
    for r in remaining:
        if r.done:
            continue
        left += 1
        request = RemainingRequest(len(r.prompt_token_ids), len(r.token_ids))
        on = running.get(r.worker_id) if r.worker_id is not None else None
        (waiting if on is None else on).append(request)
    if left > total:
        raise ValueError(f"{left} requests remain of a step of {total}")
    workers = tuple(WorkerKV(w, max(1, capacity - others.get(w, 0)), tuple(running[w]))
                    for w, capacity in sorted(capacities.items()))
    return KvView(total - left, workers, tuple(waiting))


RecordState = Literal["lent", "returned"]


def scale_record(decision: ScaleDown, *, job: str, manager_id: str, step_id: str,
                 state: RecordState, completed: int, total: int, quantile: float,
                 headroom: float, decided_unix: float, returned_unix: float | None,
                 updated_unix: float) -> bytes:
    """What ``keys.stream_scale_key(job)`` holds (JSON)::

        {"job": "j", "manager": "manager-0", "step_id": "s", "state": "lent" | "returned",
         "milestone_percent": 20, "completed": 4, "total": 16,
         "drained": ["w0"], "kept": ["w1"],
         "projected_peak_tokens": 1900, "capacity_tokens": 2048, "usable_tokens": 2048,
         "quantile": 0.9, "headroom": 0.1,
         "decided_unix": 1700000000.0, "returned_unix": null | 1700000004.2,
         "updated_unix": 1700000000.0}

    ``state`` "lent": ``drained`` hold nothing and take no rollout work until the step ends;
    their capacity may go to training. "returned": the step ended, they are rollout workers
    again (unless lost or draining meanwhile). ``capacity_tokens``: the KV capacity of
    ``kept`` for the step; ``usable_tokens``: that less the headroom, which the projection fit.
    """
    return json.dumps({
        "job": job, "manager": manager_id, "step_id": step_id, "state": state,
        "milestone_percent": decision.milestone_percent, "completed": completed, "total": total,
        "drained": list(decision.drain), "kept": list(decision.keep),
        "projected_peak_tokens": decision.projected_peak_tokens,
        "capacity_tokens": decision.capacity_tokens, "usable_tokens": decision.usable_tokens,
        "quantile": quantile, "headroom": headroom, "decided_unix": decided_unix,
        "returned_unix": returned_unix, "updated_unix": updated_unix}).encode()


def parse_scale_record(raw: bytes | None) -> dict[str, object] | None:
    """A stored record as a dict, or None when absent; ValueError when it is not one."""
    if raw is None:
        return None
    data = json_object(raw, "stream scaling record")
    if data.get("state") not in ("lent", "returned") or not isinstance(data.get("drained"), list):
        raise ValueError(f"not a stream scaling record: {raw[:200]!r}")
    return data
