"""Trainer re-attach: a step whose client went away runs on for a grace period, so the client,
restarted from its checkpoint and submitting the same step again, gets the whole step back — the
completions delivered so far and the tokens of the rest — instead of generating it again.

A ``Journal`` keeps what a step delivered. While its client streams, it only records; when the
client goes away it is *detached* until the grace runs out. A submission with the same step id
and the same requests (``fingerprint``) claims it back. A step that ended stays claimable for the
grace too (a trainer that died while training on it). ``Journals`` is pure (an injected clock,
no I/O); ``Reattach`` plugs it into the shell as a ``ManagerObserver`` (observer.py), with the
event loop's timer for the grace. Not journaled: steps with an acceptance rule (tail
batching's short rounds: their verdicts would need replaying), and a step with a failed
completion is never re-attached (its client retries it whole, and would fail again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.client_stream import ClientStream
from rlharvest.services.rollout_manager.observer import ManagerObserver, Shell, Submission
from rlharvest.services.rollout_manager.outcome import Delivery
from rlharvest.services.rollout_manager.step import Step, StepOutcome

log = logging.getLogger(__name__)


def fingerprint(weight_version: int, requests: Sequence[mpb.RolloutRequest]) -> bytes:
    """What a re-submission must repeat to claim a journal (``Submission.fingerprint``)."""
    return Submission("", requests, weight_version, True).fingerprint


@dataclass
class Journal:
    step_id: str
    step_key: int
    fingerprint: bytes
    stream: Any  # the ClientStream its requests deliver into (the service's)
    completions: list[mpb.Completion] = field(default_factory=list)
    failed: bool = False  # a failed or cancelled completion was delivered
    ended: bool = False
    remote: mpb.RemoteTimings | None = None  # rides on the step's last event
    detached_until: float | None = None  # None while a client streams it


class Journals:
    """The journals of one manager's steps, by step key; ``grace_s`` after their client left,
    detached ones are dropped (``expired``). At most ``keep_ended`` ended ones are kept."""

    def __init__(self, grace_s: float, clock: Callable[[], float], keep_ended: int = 2) -> None:
        if grace_s <= 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s}")
        self.grace_s = grace_s
        self._clock = clock
        self._keep_ended = keep_ended
        self._by_key: dict[int, Journal] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def detached(self) -> int:
        """Steps running on without a client (not the ended ones kept for a late claim)."""
        return sum(j.detached_until is not None and not j.ended for j in self._by_key.values())

    def get(self, step_key: int) -> Journal | None:
        return self._by_key.get(step_key)

    def open(self, step_id: str, step_key: int, print_: bytes, stream: Any) -> Journal:
        journal = self._by_key[step_key] = Journal(step_id, step_key, print_, stream)
        return journal

    def record(self, step_key: int, completion: mpb.Completion) -> None:
        journal = self._by_key.get(step_key)
        if journal is not None:
            journal.completions.append(completion)
            journal.failed |= completion.failed or completion.cancelled

    def ended(self, step_key: int, remote: mpb.RemoteTimings | None) -> None:
        journal = self._by_key.get(step_key)
        if journal is None:
            return
        journal.ended, journal.remote = True, remote
        ended = sorted((j for j in self._by_key.values() if j.ended and j is not journal),
                       key=lambda j: j.step_key)
        for old in ended[:max(len(ended) - self._keep_ended + 1, 0)]:
            del self._by_key[old.step_key]

    def detach(self, step_key: int) -> Journal | None:
        """Its client went away: the journal, kept for ``grace_s``, or None when it cannot be
        re-attached (none, or a failed completion: it is dropped then)."""
        journal = self._by_key.get(step_key)
        if journal is None:
            return None
        if journal.failed:
            del self._by_key[step_key]
            return None
        journal.detached_until = self._clock() + self.grace_s
        return journal

    def claim(self, step_id: str, print_: bytes) -> tuple[Journal | None, list[Journal]]:
        """A submission of ``step_id``: the detached journal it re-attaches to (same requests,
        no failed completion), and the detached ones of that id it replaces (other requests: a
        new run's step with the same id; or a completion failed while detached), which are
        dropped and whose unended steps the caller abandons."""
        claimed, stale = None, []
        for journal in list(self._by_key.values()):
            if journal.step_id != step_id or journal.detached_until is None:
                continue
            if journal.fingerprint == print_ and claimed is None and not journal.failed:
                journal.detached_until = None
                claimed = journal
            else:
                del self._by_key[journal.step_key]
                stale.append(journal)
        return claimed, stale

    def expired(self) -> list[Journal]:
        """Detached journals past their grace, dropped; the caller abandons unended steps."""
        now = self._clock()
        gone = [j for j in self._by_key.values()
                if j.detached_until is not None and j.detached_until <= now]
        for journal in gone:
            del self._by_key[journal.step_key]
        return gone


class Reattach(ManagerObserver):
    """Journals the steps of the RL loop without an acceptance rule; a step whose client went
    away runs on for ``grace_s`` and a re-submission of it gets it back."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.journals = Journals(grace_s, clock)
        self._shell: Shell | None = None

    def bind(self, shell: Shell) -> None:
        self._shell = shell

    @property
    def shell(self) -> Shell:
        assert self._shell is not None, "bind() comes first"
        return self._shell

    @staticmethod
    def _journaled(submission: Submission) -> bool:
        return submission.profiled and submission.acceptance is None

    def claim(self, submission: Submission) -> ClientStream | None:
        """A new stream for the same step that first replays every completion delivered so
        far and the tokens of the other requests; a detached step of that id with other
        requests is abandoned."""
        if not self._journaled(submission):
            return None
        journal, stale = self.journals.claim(submission.step_id, submission.fingerprint)
        for old in stale:
            if not old.ended:
                self.shell.abandon(old.stream)
        return None if journal is None else self._replay(journal)

    def _replay(self, journal: Journal) -> ClientStream:
        step: Step = journal.stream.step
        running = len(step.outstanding)
        stream = self.shell.open_stream(step)
        for completion in journal.completions:
            stream.put_completion(completion)
        if (rows := self.shell.control.replay(step)) is not None:
            stream.replay(rows)
        if journal.ended:
            stream.end(journal.remote)
        journal.stream = stream
        metrics.STEP_REATTACHES.inc()
        log.info("step %s re-attached: %d completions and the tokens of %d requests replayed",
                 journal.step_id, len(journal.completions), running)
        return stream

    def step_started(self, step: Step, stream: ClientStream, submission: Submission) -> None:
        if self._journaled(submission):
            self.journals.open(step.step_id, step.key, submission.fingerprint, stream)

    def delivered(self, delivery: Delivery) -> None:
        self.journals.record(delivery.step.key, delivery.completion)

    def step_ended(self, step: Step, remote: mpb.RemoteTimings | None) -> None:
        if step.outcome is StepOutcome.FINISHED:
            self.journals.ended(step.key, remote)

    def client_left(self, stream: ClientStream) -> bool:
        """A journaled step runs on, detached, for the grace (its end's cleanup already ran
        if it ended); not journaled, or a stream a re-attach replaced: the shell abandons it."""
        journal = self.journals.get(stream.step.key)
        if journal is None or journal.stream is not stream:
            return False
        if self.journals.detach(stream.step.key) is None:
            return False  # a completion failed: retried whole, never re-attached
        if not journal.ended:
            stream.detach()
            log.info("step %s: its client went away; kept running for %.0fs for it to "
                     "re-attach", journal.step_id, self.journals.grace_s)
        asyncio.get_running_loop().call_later(self.journals.grace_s + 0.01, self._expire)
        return True

    def _expire(self) -> None:
        for journal in self.journals.expired():
            if not journal.ended:
                log.info("step %s: not re-attached within %.0fs; abandoned", journal.step_id,
                         self.journals.grace_s)
                self.shell.abandon(journal.stream)

    def refresh_gauges(self) -> None:
        metrics.STEPS_DETACHED.set(self.journals.detached())
