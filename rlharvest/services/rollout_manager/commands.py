"""What the manager's pure policies decide; the async service executes them.

The policies never send anything. They return these flat, immutable commands, and the request
tracker has already been updated when a command is returned: a request's assignee changes at the
moment a move is *decided*, so any message its former worker sends afterwards is stale and dropped.
That ordering is what guarantees a completion has no gap and no duplicate token (RLBoost §4.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

# Why a request left a worker. "pending" and "executing" are Algorithm 2's two migration cases;
# "refused": the worker turned the request down in a way another worker may not (failure.py).
# "scale_down": its worker was lent to training (stream-trainer scaling, stream_scaler.py).
MigrationCause = Literal["pending", "executing", "drain", "version", "lost", "protocol",
                         "refused", "scale_down", "seed_window"]


@dataclass(frozen=True)
class Dispatch:
    """Send the request (prompt + tokens so far: ``RequestTracker.resume_payload``) to a worker."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class Migrate:
    """Abort the request on ``src`` and send its resume payload to ``dst``."""

    request_id: str
    src: str
    dst: str
    cause: MigrationCause


@dataclass(frozen=True)
class Release:
    """The request left ``worker_id`` and waits in the manager for a new worker (tokens kept).

    The worker is usually gone; where it may still be reachable and ``abort`` is set, the service
    sends an abort. ``abort`` is False when the worker never took the request (it refused it).
    """

    request_id: str
    worker_id: str
    cause: MigrationCause
    abort: bool = True


@dataclass(frozen=True)
class Fail:
    """The request cannot be completed (or its step no longer needs it); ``reason`` says why and
    what the operator can do. Its client gets it as a failed completion. When ``worker_id`` is
    set, the request was running there and the service aborts it."""

    request_id: str
    reason: str
    worker_id: str | None = None
    cancelled: bool = False  # its step's policy no longer needs it (tail batching)


@dataclass(frozen=True)
class Abort:
    """Tell ``worker_id`` to drop the request: its client went away and the manager has already
    forgotten it, so nobody is told anything else."""

    request_id: str
    worker_id: str


@dataclass(frozen=True)
class Forget:
    """The core forgot a lost worker that held nothing (FailureConfig.forget_lost_after_s):
    the service drops what it keeps about it too. The same id joining later is a new worker."""

    worker_id: str


Command = Union[Dispatch, Migrate, Release, Fail, Abort, Forget]
