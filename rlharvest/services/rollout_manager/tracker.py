"""Token-level request tracking (RLBoost §4.2, "Live Request Tracking and Migration").

The manager holds every token a worker has produced, so a request that leaves a worker (preemption,
drain, rebalancing) resumes elsewhere as prompt + tokens so far: the new worker only prefills.
Two rules keep every completion contiguous, with no gap and no duplicate:

* only the request's *current* assignee may append tokens: a late message from a worker the
  request was migrated away from is dropped, never appended;
* a delta is appended only at the position where the completion currently ends.

``tokens_regenerated`` counts tokens accepted at a position that was accepted before and later
discarded. Migration never discards, so it stays 0; only ``restart_from_prompt`` (the "recompute"
strategy RLBoost §6.4.3 compares against) makes it grow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np

from rlharvest.common import delta_batch
from rlharvest.common.delta_batch import Rows
from rlharvest.common.engine_types import EngineRequest, SamplingParams, natural_end
from rlharvest.common.errors import InvalidArgument
from rlharvest.services.rollout_manager.token_ledger import MASK, TokenLedger


class StepError(InvalidArgument):
    """A step the manager refuses; the message names the offending request and the limit."""


class RequestState(str, Enum):
    WAITING = "waiting"  # in the manager, on no worker (new, or released by a lost worker)
    PENDING = "pending"  # assigned to a worker, no token from it yet on this assignment
    EXECUTING = "executing"  # its assignee has produced tokens on this assignment
    FINISHED = "finished"
    FAILED = "failed"


_DONE = (RequestState.FINISHED, RequestState.FAILED)


@dataclass(frozen=True)
class StepLimits:
    max_requests: int = 65_536
    max_prompt_tokens: int = 32_768
    max_new_tokens: int = 32_768
    # Token ids must be below this. 0: not fixed by configuration; the job's workers tell it
    # (their etcd records carry their model's vocabulary size) through ``set_vocab_size``.
    vocab_size: int = 0


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    group_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    weight_version: int
    no_worker_timeout_s: float | None = None  # the client's own deadline; None: the manager's
    # A resume payload (a step resubmitted after its manager died): tokens already generated on
    # this version and their logprobs; generation continues after them.
    resume_token_ids: tuple[int, ...] = ()
    resume_logprobs: tuple[float, ...] = ()
    # Agentic rollout: the trajectory this request is a turn of ("" for none), and whether it
    # is the last turn (turn_routing.py routes turns by where their history's KV is).
    trajectory_id: str = ""
    turn: int = 0
    last_turn: bool = False


@dataclass(frozen=True)
class TokenDelta:
    """New tokens for one request from one engine step, as one object: what tests and the
    policy simulator write (``RequestTracker.apply_deltas`` turns them into a batch's rows)."""

    request_id: str
    position: int  # index in the completion of token_ids[0]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_version: int
    finished: bool = False
    finish_reason: str = ""  # "length" | "stop" | "abort" when finished


class DeltaLike(Protocol):
    """What ``apply_deltas`` reads of a delta."""

    @property
    def request_id(self) -> str: ...
    @property
    def position(self) -> int: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[float]: ...
    @property
    def weight_version(self) -> int: ...
    @property
    def finished(self) -> bool: ...
    @property
    def finish_reason(self) -> str: ...


@dataclass(frozen=True)
class ResumePayload:
    """What a worker needs to (re)start a request: it prefills prompt + generated, then decodes.

    ``sampling.max_tokens`` keeps counting the tokens generated before the resume (engine.py), so
    the worker decodes at most ``remaining_tokens`` more.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    generated_token_ids: tuple[int, ...]
    sampling: SamplingParams
    weight_version: int
    handle: int = 0  # the name the worker's step outputs give it (AddRequest.handle)

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.generated_token_ids)

    def to_engine_request(self) -> EngineRequest:
        return EngineRequest(self.request_id, list(self.prompt_token_ids), self.sampling,
                             list(self.generated_token_ids))


@dataclass
class TrackedRequest:
    """A request's state; its tokens live in the tracker's ledger (``handle``), appended a batch
    at a time, and are read out as lists here only off the hot path."""

    request_id: str
    group_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    weight_version: int
    created_at: float
    ledger: TokenLedger = field(repr=False, compare=False)
    handle: int = 0  # its current dispatch's (TokenLedger.assign), or its add's until the first
    added_as: int = 0  # its handle when added: a lower one names the slot's earlier request
    no_worker_timeout_s: float | None = None
    state: RequestState = RequestState.WAITING
    worker_id: str | None = None
    migrations: int = 0  # moves from one worker to another (or back to the manager)
    finished_at: float | None = None
    finish_reason: str = ""  # "length" | "stop" once finished; the failure reason once failed
    trajectory_id: str = ""  # agentic rollout (NewRequest)
    last_turn: bool = False
    finished_on: str | None = None  # the worker that produced its last token
    # Once forgotten its ledger slot goes to another request: its tokens are copied here first.
    forgotten: tuple[list[int], list[float]] | None = field(default=None, repr=False)

    @property
    def slot(self) -> int:
        return TokenLedger.slot(self.handle)

    @property
    def token_ids(self) -> list[int]:
        if self.forgotten is not None:
            return list(self.forgotten[0])
        return self.ledger.tokens(self.slot)

    @property
    def logprobs(self) -> list[float]:
        if self.forgotten is not None:
            return list(self.forgotten[1])
        return self.ledger.logprobs(self.slot)

    @property
    def generated(self) -> int:
        """len(token_ids), without reading them out."""
        if self.forgotten is not None:
            return len(self.forgotten[0])
        return self.ledger.length(self.slot)

    @property
    def context_length(self) -> int:
        return len(self.prompt_token_ids) + self.generated

    @property
    def done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.FAILED)


@dataclass(frozen=True)
class DroppedDelta:
    request_id: str
    worker_id: str
    reason: str  # "unknown" | "done" | "stale" | "version" | "position" | "malformed"
    tokens: int
    row: int = -1  # in the batch


@dataclass
class ApplyReport:
    """Outcome of one batch of step outputs: what to forward, what finished, what was refused."""

    accepted: Rows  # the rows appended (requests named by their handles)
    tags: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # step keys
    indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # in the step
    finished: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # the assignee aborted it: back to waiting
    dropped: list[DroppedDelta] = field(default_factory=list)

    @property
    def accepted_tokens(self) -> int:
        return len(self.accepted.token_ids)


@dataclass
class TrackerCounters:
    tokens_generated: int = 0  # accepted tokens, regenerated ones included
    tokens_regenerated: int = 0  # accepted at a position that had been held and discarded before
    tokens_dropped_stale: int = 0  # sent by a worker the request had already left
    migrations: int = 0
    finished: int = 0
    failed: int = 0


class RequestTracker:
    """Every request of every step, at token granularity. Synchronous and I/O-free."""

    def __init__(self, limits: StepLimits, clock: Callable[[], float]) -> None:
        self._limits = limits
        self._clock = clock
        self.vocab_size = limits.vocab_size  # 0 until configured or learnt from a worker
        self._requests: dict[str, TrackedRequest] = {}
        # Waiting requests, in dispatch order: released ones (they carry progress) before new ones.
        self._waiting_released: dict[str, None] = {}
        self._waiting_new: dict[str, None] = {}
        self._by_worker: dict[str, dict[str, None]] = {}  # assignment order kept
        # Sum of context_length over each worker's requests, kept as they change so that the
        # mean context (for P, on the relay's hot path) needs no walk over the requests.
        self._context: dict[str, int] = {}
        # How many of each worker's requests are EXECUTING, kept as states change, so that a
        # worker's load (Algorithm 2's counts) needs no walk over its requests.
        self._executing: dict[str, int] = {}
        self.counters = TrackerCounters()
        self.ledger = TokenLedger()
        self._by_slot: dict[int, TrackedRequest] = {}
        self._worker_index: dict[str, int] = {}  # the ledger names workers by number
        # Never reused: a forgotten worker's number must not name a live one.
        self._next_worker_number = 0

    @property
    def _vocab_limit(self) -> int:
        # Before any worker told its vocabulary only negative ids are refused here; the worker
        # that gets the request checks it against its model (and refuses it with the reason).
        return self.vocab_size or 2**63

    # ---- steps --------------------------------------------------------------------------------

    def add_step(self, requests: Sequence[NewRequest]) -> list[str]:
        """Validate a whole step, then track it; nothing is added when any request is refused."""
        self._validate_step(requests)
        now = self._clock()
        for new in requests:
            handle = self.ledger.add(new.sampling.max_tokens, new.weight_version,
                                     new.sampling.stop_token_ids, new.resume_token_ids,
                                     new.resume_logprobs)
            req = self._requests[new.request_id] = TrackedRequest(
                new.request_id, new.group_id, tuple(new.prompt_token_ids), new.sampling,
                new.weight_version, created_at=now, ledger=self.ledger, handle=handle,
                added_as=handle,
                no_worker_timeout_s=new.no_worker_timeout_s, trajectory_id=new.trajectory_id,
                last_turn=new.last_turn)
            self._by_slot[req.slot] = req
            self._waiting_new[new.request_id] = None
        return [r.request_id for r in requests]

    def label(self, request_ids: Sequence[str], tag: int) -> None:
        """Name the requests' rows ``tag`` and their index in ``request_ids`` (the manager: a
        step's key and each request's index in it, reported with accepted rows)."""
        slots = [self._requests[rid].slot for rid in request_ids]
        self.ledger.label(slots, tag)

    def _validate_step(self, requests: Sequence[NewRequest]) -> None:
        lim = self._limits
        if not requests:
            raise StepError("the step has no requests; send at least one prompt")
        if len(requests) > lim.max_requests:
            raise StepError(f"the step has {len(requests)} requests, above the limit of "
                            f"{lim.max_requests}; split it or raise max_requests")
        seen: set[str] = set()
        for r in requests:
            where = f"request {r.request_id!r}"
            if not r.request_id:
                raise StepError("a request has an empty request_id; give every request an id")
            if r.request_id in seen or r.request_id in self._requests:
                raise StepError(f"{where} appears twice; request ids must be unique per manager")
            seen.add(r.request_id)
            if not r.prompt_token_ids:
                raise StepError(f"{where} has an empty prompt")
            if r.turn < 0 or len(r.trajectory_id) > 256:
                raise StepError(f"{where} has turn {r.turn} of trajectory "
                                f"{r.trajectory_id[:40]!r}: turns count from 0 and a "
                                "trajectory id has at most 256 characters")
            if len(r.prompt_token_ids) > lim.max_prompt_tokens:
                raise StepError(f"{where} has a prompt of {len(r.prompt_token_ids)} tokens, above "
                                f"the limit of {lim.max_prompt_tokens}")
            bad = [t for t in r.prompt_token_ids if not 0 <= t < self._vocab_limit]
            if bad:
                raise StepError(f"{where} has token id {bad[0]} outside the vocabulary "
                                f"[0, {self._vocab_limit}) of the job's model")
            if not 0 < r.sampling.max_tokens <= lim.max_new_tokens:
                raise StepError(f"{where} asks for max_tokens={r.sampling.max_tokens}; it must be "
                                f"in [1, {lim.max_new_tokens}]")
            if r.weight_version < 0:
                raise StepError(f"{where} has weight_version {r.weight_version}; versions are >= 0")
            self._validate_resume(r, where)
            if r.no_worker_timeout_s is not None and r.no_worker_timeout_s < 0:
                raise StepError(f"{where} has no_worker_deadline_s {r.no_worker_timeout_s}, which "
                                "is negative; 0 means the manager's no_worker_timeout_s")

    def _validate_resume(self, r: NewRequest, where: str) -> None:
        resumed = r.resume_token_ids
        if len(r.resume_logprobs) != len(resumed):
            raise StepError(f"{where} resumes {len(resumed)} tokens with "
                            f"{len(r.resume_logprobs)} logprobs; send one logprob per token")
        ended = natural_end(resumed, r.sampling.max_tokens, r.sampling.stop_token_ids)
        if ended == "stop":
            raise StepError(f"{where} resumes after stop token {resumed[-1]}: it is finished, "
                            "do not resubmit it")
        if ended == "length":
            raise StepError(f"{where} resumes {len(resumed)} tokens of max_tokens="
                            f"{r.sampling.max_tokens}: it is finished, do not resubmit it")
        bad = [t for t in resumed if not 0 <= t < self._vocab_limit]
        if bad:
            raise StepError(f"{where} resumes token id {bad[0]} outside the vocabulary "
                            f"[0, {self._vocab_limit}) of the job's model")

    # ---- queries ------------------------------------------------------------------------------

    def get(self, request_id: str) -> TrackedRequest:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not tracked by this manager") from None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def all(self) -> Iterable[TrackedRequest]:
        return self._requests.values()

    def waiting(self) -> list[TrackedRequest]:
        """Requests on no worker, in dispatch order (released ones first, then oldest first)."""
        ids = list(self._waiting_released) + list(self._waiting_new)
        return [self._requests[i] for i in ids]

    def on_worker(self, worker_id: str) -> list[TrackedRequest]:
        """Requests assigned to ``worker_id``, oldest assignment first."""
        return [self._requests[i] for i in self._by_worker.get(worker_id, ())]

    def assigned_count(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def executing_count(self, worker_id: str) -> int:
        """How many requests on ``worker_id`` have produced tokens there (EXECUTING); the
        rest of ``assigned_count`` are PENDING. Constant time."""
        return self._executing.get(worker_id, 0)

    def generated_of(self, requests: Sequence[TrackedRequest]) -> list[int]:
        """``generated`` of each request, the ledger's read once for all."""
        if any(r.forgotten is not None for r in requests):
            return [r.generated for r in requests]
        return self.ledger.lengths([r.handle for r in requests])

    def busy(self, worker_id: str) -> bool:
        """Some request is assigned to ``worker_id``."""
        return bool(self._by_worker.get(worker_id))

    def load_counts(self, worker_id: str) -> tuple[int, int, float | None]:
        """``assigned_count``, ``executing_count`` and ``mean_context`` in one call: the
        control loop reads all three of every eligible worker each tick."""
        assigned = self._by_worker.get(worker_id)
        if not assigned:
            return 0, self._executing.get(worker_id, 0), None
        return (len(assigned), self._executing.get(worker_id, 0),
                self._context[worker_id] / len(assigned))

    def mean_context(self, worker_id: str) -> float | None:
        """Mean context length (prompt + tokens so far) of the requests on ``worker_id``; None
        when it has none. Constant time: the sum is kept as requests move and grow."""
        assigned = self._by_worker.get(worker_id)
        if not assigned:
            return None
        return self._context[worker_id] / len(assigned)

    def unfinished(self) -> int:
        # Counted, not derived from the counters: forget() removes done requests.
        return sum(1 for r in self._requests.values() if not r.done)

    def resume_payload(self, request_id: str) -> ResumePayload:
        req = self.get(request_id)
        if req.done:
            raise ValueError(f"request {request_id!r} is {req.state.value}; nothing to resume")
        return ResumePayload(req.request_id, req.prompt_token_ids, tuple(req.token_ids),
                             req.sampling, req.weight_version, req.handle)

    # ---- assignment ---------------------------------------------------------------------------

    def assign(self, request_id: str, worker_id: str) -> None:
        """Waiting -> pending on ``worker_id``. Raises if the request is not waiting."""
        req = self.get(request_id)
        if req.state is not RequestState.WAITING:
            raise ValueError(f"request {request_id!r} is {req.state.value}, not waiting; "
                             "use move() for a request that is on a worker")
        self._waiting_released.pop(request_id, None)
        self._waiting_new.pop(request_id, None)
        self._attach(req, worker_id)

    def move(self, request_id: str, dst: str) -> None:
        """Pending/executing on a worker -> pending on ``dst``; the old worker's output is stale."""
        req = self.get(request_id)
        if req.worker_id is None or req.done:
            raise ValueError(f"request {request_id!r} is {req.state.value}, on no worker; "
                             "use assign() for a waiting request")
        if req.worker_id == dst:
            raise ValueError(f"request {request_id!r} is already on {dst!r}")
        self._detach(req)
        self._count_migration(req)
        self._attach(req, dst)

    def release(self, request_id: str) -> None:
        """Take the request off its worker; it waits in the manager with every token kept."""
        req = self.get(request_id)
        if req.worker_id is None or req.done:
            raise ValueError(f"request {request_id!r} is {req.state.value}, on no worker")
        self._detach(req)
        self._count_migration(req)
        req.state = RequestState.WAITING
        self._waiting_released[request_id] = None

    def restart_from_prompt(self, request_id: str) -> None:
        """Discard a waiting request's tokens: the recompute baseline of RLBoost §6.4.3 only.

        Only the ``recompute_on_loss`` baseline calls this, to measure what migration saves.
        """
        req = self.get(request_id)
        if req.state is not RequestState.WAITING:
            raise ValueError(f"request {request_id!r} is {req.state.value}; release it first")
        self.ledger.truncate(req.slot)

    def fail(self, request_id: str, reason: str) -> None:
        req = self.get(request_id)
        if req.done:
            return
        if req.worker_id is not None:
            self._detach(req)
        self._waiting_released.pop(request_id, None)
        self._waiting_new.pop(request_id, None)
        req.state = RequestState.FAILED
        req.finish_reason = reason
        req.finished_at = self._clock()
        self.counters.failed += 1

    def withdraw(self, request_id: str) -> int:
        """Drop an unfinished request (taken off its worker, if on one): its client moves it
        to another of the job's manager shards (sharding.py), which resumes it from the tokens
        the client has. Returns how many it has here. Not counted as a failure: it completes
        there; a move off a worker counts as a migration."""
        req = self.get(request_id)
        if req.done:
            raise ValueError(f"request {request_id!r} is {req.state.value}; only an unfinished "
                             "request is withdrawn")
        tokens = req.generated
        if req.worker_id is not None:
            self._detach(req)
            self._count_migration(req)
        self._waiting_released.pop(request_id, None)
        self._waiting_new.pop(request_id, None)
        del self._requests[request_id]
        del self._by_slot[req.slot]
        self.ledger.remove(req.handle)
        return tokens

    def forget(self, request_id: str) -> None:
        """Drop a finished or failed request once its completion was delivered, so a long-running
        manager holds only the requests in flight. Later deltas for it are dropped as unknown."""
        req = self.get(request_id)
        if not req.done:
            raise ValueError(f"request {request_id!r} is {req.state.value}; only finished or "
                             "failed requests can be forgotten")
        del self._requests[request_id]
        del self._by_slot[req.slot]
        req.forgotten = (req.token_ids, req.logprobs)
        self.ledger.remove(req.handle)

    def _attach(self, req: TrackedRequest, worker_id: str) -> None:
        req.worker_id = worker_id
        req.state = RequestState.PENDING
        req.handle = self.ledger.assign(req.slot, self._worker_number(worker_id))
        self._by_worker.setdefault(worker_id, {})[req.request_id] = None
        self._context[worker_id] = self._context.get(worker_id, 0) + req.context_length

    def _detach(self, req: TrackedRequest) -> None:
        assert req.worker_id is not None
        on_worker = self._by_worker[req.worker_id]
        del on_worker[req.request_id]
        if not on_worker:
            del self._by_worker[req.worker_id]
        # Never deleted: apply_outputs adds a batch's tokens after detaching the requests that
        # finished in it, so the sum may pass through a negative value within one batch.
        self._context[req.worker_id] -= req.context_length
        if req.state is RequestState.EXECUTING:
            self._executing[req.worker_id] -= 1
        req.worker_id = None
        self.ledger.unassign(req.slot)

    def _count_migration(self, req: TrackedRequest) -> None:
        req.migrations += 1
        self.counters.migrations += 1

    # ---- step outputs -------------------------------------------------------------------------

    def apply_outputs(self, worker_id: str, rows: Rows) -> ApplyReport:
        """Append the tokens of one batch of step outputs from ``worker_id``.

        A row is dropped (and reported) when its request is unknown or done, when ``worker_id``
        is not the request's current assignee, when it was produced by another weight version,
        when it does not start exactly where the completion ends, or when it is malformed
        (token_ledger.py checks the whole batch with array operations). The accepted rows are
        reported as a batch, so the service forwards them without a Python object per row.
        """
        applied = self.ledger.apply(self._worker_number(worker_id), rows, self._vocab_limit)
        report = ApplyReport(rows.take(applied.accepted), tags=applied.tags,
                             indices=applied.indices)
        by_slot = self._by_slot
        for slot in applied.started:
            started = by_slot[slot]
            if started.state is not RequestState.EXECUTING:
                started.state = RequestState.EXECUTING
                self._executing[worker_id] = self._executing.get(worker_id, 0) + 1
        for row, reason in applied.ended:  # after all the batch's tokens are in
            req = by_slot[int(rows.requests[row]) & MASK]
            if reason == "abort":  # the worker gave it up on its own: it keeps its tokens
                self.release(req.request_id)
                report.aborted.append(req.request_id)
            else:
                self._finish(req, reason)
                report.finished.append(req.request_id)
        # After the ends: a later row of a request that ended in this batch reads "done" (or
        # "stale" after an abort), as it would have in a batch of its own.
        for row in applied.dropped.tolist():  # rare: say why, one by one
            handle = int(rows.requests[row])
            named = by_slot.get(handle & MASK)
            if named is not None and handle < named.added_as:
                named = None  # a late row of a forgotten request whose slot was reused
            n = int(rows.counts[row])
            reason = "stale" if named is not None and named.handle != handle else \
                self._refusal(named, worker_id, rows, row)  # else of an earlier dispatch
            report.dropped.append(DroppedDelta(named.request_id if named else f"#{handle}",
                                               worker_id, reason, n, row))
            if reason == "stale":
                self.counters.tokens_dropped_stale += n
        self.counters.tokens_generated += applied.generated
        self.counters.tokens_regenerated += applied.regenerated
        if applied.generated:  # every accepted token grew a request of worker_id (see _detach)
            self._context[worker_id] = self._context.get(worker_id, 0) + applied.generated
        return report

    def _worker_number(self, worker_id: str) -> int:
        number = self._worker_index.get(worker_id)
        if number is None:
            number = self._worker_index[worker_id] = self._next_worker_number
            self._next_worker_number += 1
        return number

    def forget_worker(self, worker_id: str) -> None:
        """Drop what is kept about a worker that holds no request (one the manager forgets);
        rows sent under its old number are refused as any other worker's."""
        if worker_id in self._by_worker:
            raise ValueError(f"worker {worker_id!r} still holds {self.assigned_count(worker_id)} "
                             "requests; release them before forgetting it")
        self._worker_index.pop(worker_id, None)
        self._context.pop(worker_id, None)
        self._executing.pop(worker_id, None)

    @staticmethod
    def _refusal(req: TrackedRequest | None, worker_id: str, rows: Rows, row: int) -> str:
        if req is None:
            return "unknown"
        if req.done:
            return "done"
        if req.worker_id != worker_id:
            return "stale"
        if rows.weight_version != req.weight_version:
            return "version"
        if int(rows.positions[row]) != req.generated:
            return "position"
        return "malformed"

    def apply_deltas(self, worker_id: str, deltas: Iterable[DeltaLike]) -> ApplyReport:
        """``apply_outputs`` for deltas as objects naming their requests by id (tests, the policy
        simulator): one batch of rows per run of one weight version, in order. The report's
        ``accepted`` joins them under the first batch's version."""
        deltas = list(deltas)
        report = ApplyReport(delta_batch.empty(deltas[0].weight_version if deltas else 0))
        good = []
        for d in deltas:
            if len(d.logprobs) != len(d.token_ids):  # rows carry one logprob per token
                report.dropped.append(DroppedDelta(d.request_id, worker_id, "malformed",
                                                   len(d.token_ids)))
            else:
                good.append(d)
        while good:  # one batch per run of one weight version, in order
            version = good[0].weight_version
            run = next((i for i, d in enumerate(good) if d.weight_version != version), len(good))
            batch, good = good[:run], good[run:]
            unknown = MASK  # a handle naming no request
            rows = delta_batch.build(
                ((self._requests[d.request_id].handle if d.request_id in self._requests
                  else unknown, d.position, d.token_ids, d.logprobs,
                  (d.finish_reason or "stop") if d.finished else "") for d in batch), version)
            part = self.apply_outputs(worker_id, rows)
            report.accepted = delta_batch.concat([report.accepted, part.accepted])
            report.tags = np.concatenate([report.tags, part.tags])
            report.indices = np.concatenate([report.indices, part.indices])
            report.finished += part.finished
            report.aborted += part.aborted
            report.dropped += [DroppedDelta(batch[x.row].request_id, x.worker_id, x.reason,
                                            x.tokens, x.row) for x in part.dropped]
        return report

    def _finish(self, req: TrackedRequest, reason: str) -> None:
        req.finished_on = req.worker_id
        self._detach(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.finished_at = self._clock()
        self.counters.finished += 1
