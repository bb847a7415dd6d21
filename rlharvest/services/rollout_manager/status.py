"""What the manager says about itself: GetStatus, the gauges computed when /metrics is scraped,
and the counters each worker event's outcome feeds."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.control_loop import RolloutControl
from rlharvest.services.rollout_manager.outcome import Outcome
from rlharvest.services.rollout_manager.remote_timing import RemoteStepTimings
from rlharvest.services.rollout_manager.tracker import RequestState

log = logging.getLogger(__name__)


class Reporter:
    def __init__(self, control: RolloutControl) -> None:
        self._control = control
        self._rate: deque[tuple[float, int]] = deque()  # (when, tokens) over the last 5 s
        self._rate_tokens = 0
        self.last_remote: mpb.RemoteTimings | None = None

    def worker_event(self, worker_id: str, out: Outcome) -> None:
        """Count what one worker event brought."""
        if out.malformed:
            log.warning("worker %s sent a malformed batch, dropped: %s", worker_id, out.malformed)
        if out.preemptions:
            metrics.PREEMPTIONS.inc(out.preemptions)
        for dropped in out.dropped:
            metrics.TOKENS_DROPPED.labels(dropped.reason).inc(dropped.tokens)
        if out.accepted_tokens:
            metrics.TOKENS.inc(out.accepted_tokens)
            self._rate.append((time.monotonic(), out.accepted_tokens))
            self._rate_tokens += out.accepted_tokens

    def remote(self, timings: RemoteStepTimings) -> mpb.RemoteTimings:
        """A step's remote timings as its client gets them, kept for GetStatus and exported."""
        self.last_remote = mpb.RemoteTimings(**dataclasses.asdict(timings))
        metrics.observe_remote(timings)
        return self.last_remote

    def status(self, endpoints: dict[str, dict]) -> mpb.ManagerStatus:
        control = self._control
        counters = control.tracker.counters
        standby = control.pool.standby()
        workers = [mpb.WorkerStatus(
            worker_id=view.worker_id, endpoint=endpoints.get(view.worker_id, {}).get("endpoint", ""),
            kind=view.kind, weight_version=view.weight_version,
            state="standby" if view.worker_id in standby else view.state.value,
            assigned=control.tracker.assigned_count(view.worker_id), capacity=view.capacity)
            for view in control.pool.all()]
        return mpb.ManagerStatus(
            workers=workers, in_flight=control.tracker.unfinished(),
            waiting=len(control.tracker.waiting()),
            tokens_generated=counters.tokens_generated,
            tokens_regenerated=counters.tokens_regenerated, migrations=counters.migrations,
            completions=counters.finished, failures=counters.failed,
            last_step_remote=self.last_remote)

    def refresh_gauges(self) -> None:
        """The gauges that walk the tracker, computed when /metrics is scraped."""
        tracker = self._control.tracker
        metrics.IN_FLIGHT.set(tracker.unfinished())
        metrics.WAITING.set(len(tracker.waiting()))
        metrics.TOKENS_REGENERATED.set(tracker.counters.tokens_regenerated)
        router = self._control.router
        for outcome, count in dataclasses.asdict(router.counts).items():
            metrics.TURNS_ROUTED.labels(outcome).set(count)
        metrics.TRAJECTORIES.set(len(router))
        states: dict[str, int] = {"healthy": 0, "draining": 0, "training": 0, "lost": 0}
        for view in self._control.pool.all():
            states[view.state.value] = states.get(view.state.value, 0) + 1
            on_worker = tracker.on_worker(view.worker_id)
            metrics.ASSIGNED.labels(view.worker_id).set(len(on_worker))
            metrics.PENDING.labels(view.worker_id).set(
                sum(1 for r in on_worker if r.state is RequestState.PENDING))
        for state, count in states.items():
            metrics.WORKERS.labels(state).set(count)
        metrics.WORKERS_LENT.set(states["training"])
        self.update_rate()

    def update_rate(self) -> None:
        # Every tick, so the window stays 5 s of entries whether or not anyone scrapes.
        now = time.monotonic()
        while self._rate and self._rate[0][0] <= now - 5:
            self._rate_tokens -= self._rate.popleft()[1]
        metrics.TOKENS_PER_SECOND.set(self._rate_tokens / 5)

    def health(self, workers: int) -> dict:
        return {"status": "ok", "workers": workers,
                "in_flight": self._control.tracker.unfinished(),
                "tokens_regenerated": self._control.tracker.counters.tokens_regenerated}
