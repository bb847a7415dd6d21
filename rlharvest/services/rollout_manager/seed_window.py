"""RLBoost's seeding window, the manager's side (§4.1): the training cluster rolls out during
[0, T_seed] of a step, then hands its partial responses ("seeds") to the remote instances.

The trainer's own engine joins the job as a worker of kind ``seed`` (``trainer/seed_role.py``)
and each ``SubmitStep`` carries the step's window (``seed_window_s``, Algorithm 1's T_seed).
While the window is open the seed workers take requests like any healthy worker; when it
closes they are lent to training for the rest of the step — the manager's one way of taking a
worker out of a step (``RolloutControl.lend_to_training``): its requests move to the remote
workers with every token generated so far (they only prefill there, migration cause
``seed_window``), and it takes no new work. When the step ends they are healthy again for the
next step's window. A step with no window (0) closes it at once: its seed workers take nothing
new. (A step resubmitted to a successor after a leader failover has none; its seed workers
still take back the requests they kept running for the successor, and hand each over once the
tokens they made meanwhile are in: ``RolloutControl._adopt``.)
With no remote worker that can take the step (healthy, on its weight version, not held as
standby by the instance cap) when the window closes the seed workers finish the step (the
co-located fallback), so no request waits for a worker that is not there; the same when the
last such worker is lost or drains after the close (``recheck``).

A seed worker serves one window at a time: a step that starts while another step's window
holds the seeds (a trainer restarted while its detached step still runs) gets none, so one
step's close or end never acts on another's window. A seed worker that joins (or comes back
under its id) while a closed window's step runs is lent at once: that step is past its window.

The timer is the event loop's; the decisions are the control loop's: ``SeedWindows`` only keeps
which seed workers each step holds and when to hand them over, and ``SeedWindowObserver`` plugs
it into the shell (observer.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.client_stream import ClientStream
from rlharvest.services.rollout_manager.commands import Command
from rlharvest.services.rollout_manager.control_loop import RolloutControl
from rlharvest.services.rollout_manager.observer import ManagerObserver, Shell, Submission
from rlharvest.services.rollout_manager.step import Step
from rlharvest.services.rollout_manager.worker_pool import SEED_KIND, WorkerState

log = logging.getLogger(__name__)

__all__ = ["SEED_KIND", "SeedWindows", "SeedWindowObserver"]


@dataclass
class _Window:
    seeds: list[str]
    version: int | None = None  # the step's weight version (None: any)
    timer: asyncio.TimerHandle | None = None
    closed: bool = False


class SeedWindows:
    def __init__(self, control: RolloutControl, execute: Callable[[list[Command]], None],
                 wake: Callable[[], None]) -> None:
        self._control = control
        self._execute = execute
        self._wake = wake
        self._steps: dict[object, _Window] = {}

    def step_started(self, key: object, window_s: float, version: int | None = None) -> list[str]:
        """A step of the RL loop began (on weight ``version``); its seed workers roll out for
        ``window_s`` seconds. Returns them (none: the job has no healthy seed worker that no
        other step's window holds)."""
        held = {seed for window in self._steps.values() for seed in window.seeds}
        seeds = [w.worker_id for w in self._control.pool.all()
                 if w.kind == SEED_KIND and w.state is WorkerState.HEALTHY
                 and w.worker_id not in held]
        log.debug("step starts with a %.2fs seeding window; seed workers %s", window_s, seeds)
        if not seeds:
            return []
        window = self._steps[key] = _Window(seeds, version)
        if window_s <= 0:
            self._close(key)  # before the step's first dispatch: they take none of it
            return seeds
        metrics.SEED_WINDOWS.inc()
        log.info("seeding window of %.2fs opens for %s", window_s, ", ".join(seeds))
        window.timer = asyncio.get_running_loop().call_later(window_s, self._close, key)
        return seeds

    def _close(self, key: object) -> None:
        window = self._steps.get(key)
        if window is None or window.closed:
            return
        window.closed = True
        if not self._remote_available(window.version):
            # No remote worker to hand the seeds to: the training cluster finishes the step
            # itself (the co-located fallback) rather than leave its requests waiting.
            log.info("seeding window closed with no remote worker: %s finish the step",
                     ", ".join(window.seeds))
            return
        commands = self._control.lend_to_training(window.seeds, cause="seed_window")
        moved = len(commands)  # each moves or releases one request, its tokens kept
        metrics.SEED_HANDOFFS.inc(moved)
        log.info("seeding window closed: %d requests move from %s to remote workers with "
                 "their tokens", moved, ", ".join(window.seeds))
        self._execute(commands)
        self._wake()

    def recheck(self) -> None:
        """After a worker was lost and after every tick (drains past their deadline and stalls
        are found there): with no healthy remote worker left, the seed workers lent away by a
        closed window take their step back (the co-located fallback again); the requests they
        handed over would otherwise wait for a remote worker that may never come."""
        for window in self._steps.values():
            if not window.closed or self._remote_available(window.version):
                continue
            back = self._control.return_from_training(window.seeds)
            if back:
                metrics.SEED_RECALLS.inc()
                log.warning("no remote worker left after the seeding window closed: %s finish "
                            "the step", ", ".join(back))
                self._wake()

    def _remote_available(self, version: int | None) -> bool:
        """A remote worker can take the step's requests: healthy, on its version and not held
        as standby (one on another version, still loading the step's, takes none of them)."""
        if version is None:
            return any(w.kind != SEED_KIND and w.state is WorkerState.HEALTHY
                       for w in self._control.pool.all())
        return any(w.kind != SEED_KIND for w in self._control.pool.eligible(version))

    def seed_joined(self, worker_id: str) -> None:
        """A seed worker joined, or came back under its id (a restarted trainer): while a
        closed window's step runs it is lent at once, as the window's seeds were at the close;
        it would otherwise decode that step's requests while the trainer trains."""
        closed = next((w for w in self._steps.values() if w.closed
                       and self._remote_available(w.version)), None)
        if closed is None or any(worker_id in w.seeds for w in self._steps.values()
                                 if not w.closed):
            return
        if worker_id not in closed.seeds:
            closed.seeds.append(worker_id)  # returned with the others when the step ends
        commands = self._control.lend_to_training([worker_id], cause="seed_window")
        log.info("seed worker %s joined after its step's seeding window closed: lent to "
                 "training", worker_id)
        self._execute(commands)
        self._wake()

    def step_ended(self, key: object) -> None:
        """The step finished or was abandoned: its seed workers are ready for the next one."""
        window = self._steps.pop(key, None)
        if window is None:
            return
        if window.timer is not None:
            window.timer.cancel()
        if self._control.return_from_training(window.seeds):
            self._wake()


class SeedWindowObserver(ManagerObserver):
    """The seeding window of every step of the RL loop and of every agentic step's scope."""

    def __init__(self) -> None:
        self._windows: SeedWindows | None = None

    def bind(self, shell: Shell) -> None:
        self._windows = SeedWindows(shell.control, shell.execute, shell.wake)

    @property
    def windows(self) -> SeedWindows:
        assert self._windows is not None, "bind() comes first"
        return self._windows

    def step_started(self, step: Step, stream: ClientStream, submission: Submission) -> None:
        if step.profiled:
            self.windows.step_started(step.key, step.seed_window_s, step.weight_version)

    def step_ended(self, step: Step, remote: mpb.RemoteTimings | None) -> None:
        self.windows.step_ended(step.key)

    def worker_joined(self, worker_id: str, kind: str) -> None:
        if kind == SEED_KIND:
            self.windows.seed_joined(worker_id)

    def worker_lost(self, worker_id: str) -> None:
        self.windows.recheck()

    def after_tick(self) -> None:
        self.windows.recheck()  # a remote worker the tick found gone or drained

    def scope_opened(self, key: Hashable, window_s: float) -> list[str]:
        return self.windows.step_started(key, window_s)

    def scope_closed(self, key: Hashable) -> None:
        self.windows.step_ended(key)
