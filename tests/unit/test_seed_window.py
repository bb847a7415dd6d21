"""The manager's side of RLBoost's seeding window (``rollout_manager/seed_window.py``) on the real
control core: the close hands the seed worker's requests over with their tokens (any the seed
still sends for them is stale and dropped), and the co-located fallback — at the close with no
remote worker, and when the last remote worker is lost after it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from prometheus_client import REGISTRY

from rlharvest.services.rollout_manager.commands import Command, Dispatch, Migrate, Release
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.seed_window import SeedWindows
from rlharvest.services.rollout_manager.tracker import TokenDelta
from rlharvest.services.rollout_manager.worker_pool import WorkerState

from ..builders import Clock, step

WINDOW_S = 0.01


class Harness:
    """A seed worker holding a step's requests, a remote worker that joined after dispatch, and
    the SeedWindows of the manager with the commands it executed."""

    def __init__(self, remote: bool = True) -> None:
        self.control = RolloutControl(ControlConfig(theta=1), Clock())
        self.executed: list[Command] = []
        self.wakes = 0
        self.windows = SeedWindows(self.control, self.executed.extend, self._wake)
        self.control.worker_joined("seed", 0, capacity=4, kind="seed")
        self.step = self.control.add_step("s", step(4, max_tokens=32), 0)
        self.windows.step_started(self.step.key, WINDOW_S)
        dispatched = self.control.tick()
        assert {c.worker_id for c in dispatched if isinstance(c, Dispatch)} == {"seed"}
        if remote:
            self.control.worker_joined("w", 0, capacity=4, kind="spot")

    def _wake(self) -> None:
        self.wakes += 1

    def emit(self, worker: str, rid: str, count: int) -> None:
        """``worker`` generated ``count`` tokens of ``rid``: what the service does per step."""
        req = self.control.tracker.get(rid)
        self.control.step_deltas(worker, [TokenDelta(rid, len(req.token_ids), (5,) * count,
                                                      (0.0,) * count, 0)])


async def test_the_close_hands_every_seed_request_over_with_its_tokens_and_lends_the_seed():
    h = Harness()
    h.emit("seed", "r0", 3)
    await asyncio.sleep(WINDOW_S * 5)
    moved = [c for c in h.executed if isinstance(c, (Migrate, Release))]
    assert sorted(c.request_id for c in moved) == ["r0", "r1", "r2", "r3"]
    assert all(c.cause == "seed_window" for c in moved)
    assert h.control.pool.get("seed").state is WorkerState.TRAINING
    assert len(h.control.tracker.get("r0").token_ids) == 3  # resumes from its last token
    assert h.control.tracker.get("r0").worker_id in (None, "w")


async def test_what_the_seed_sends_after_the_close_is_dropped_and_the_step_end_returns_it():
    h = Harness()
    h.emit("seed", "r0", 2)
    await asyncio.sleep(WINDOW_S * 5)
    report = h.control.step_deltas("seed", [TokenDelta("r0", 2, (7,), (0.0,), 0)])
    assert [d.reason for d in report.dropped] == ["stale"]  # r0 resumes from its 2 tokens
    assert len(h.control.tracker.get("r0").token_ids) == 2
    h.windows.step_ended(h.step.key)
    assert h.control.pool.get("seed").state is WorkerState.HEALTHY


async def test_with_no_remote_worker_at_the_close_the_seed_finishes_the_step():
    h = Harness(remote=False)
    await asyncio.sleep(WINDOW_S * 5)
    assert h.executed == []
    assert h.control.pool.get("seed").state is WorkerState.HEALTHY


async def test_losing_the_last_remote_worker_after_the_close_gives_the_seed_its_step_back():
    h = Harness()
    await asyncio.sleep(WINDOW_S * 5)
    assert h.control.pool.get("seed").state is WorkerState.TRAINING
    h.control.worker_lost("w", "stream broke")
    wakes = h.wakes
    recalls = REGISTRY.get_sample_value("rlh_manager_seed_recalls_total") or 0.0
    h.windows.recheck()
    assert h.control.pool.get("seed").state is WorkerState.HEALTHY
    assert h.wakes == wakes + 1
    assert REGISTRY.get_sample_value("rlh_manager_seed_recalls_total") == recalls + 1
    back = h.control.tick()  # the waiting requests go back to it, tokens kept
    assert {c.worker_id for c in back if isinstance(c, Dispatch)} == {"seed"}


async def test_a_draining_last_remote_worker_gives_the_seed_its_step_back_too():
    h = Harness()
    await asyncio.sleep(WINDOW_S * 5)
    h.control.worker_draining("w", deadline=10.0)  # a spot notice: it takes no new work
    h.windows.recheck()
    assert h.control.pool.get("seed").state is WorkerState.HEALTHY


async def test_losing_a_remote_worker_while_another_is_healthy_keeps_the_seed_lent():
    h = Harness()
    h.control.worker_joined("w2", 0, capacity=4, kind="spot")
    await asyncio.sleep(WINDOW_S * 5)
    h.control.worker_lost("w", "stream broke")
    h.windows.recheck()
    assert h.control.pool.get("seed").state is WorkerState.TRAINING


async def test_a_step_starting_while_another_holds_the_seeds_gets_none_and_cannot_move_them():
    """Overlapping steps (a restarted trainer's step while its detached one still runs): the
    second gets no window, so the first's close cannot cut the second's short and the first's
    end cannot give the seeds back to decode the second after its close."""
    control = RolloutControl(ControlConfig(theta=1), Clock())
    executed: list[Command] = []
    windows = SeedWindows(control, executed.extend, lambda: None)
    control.worker_joined("seed", 0, capacity=8, kind="seed")
    a = control.add_step("A", step(2, prefix="a"), 0)
    assert windows.step_started(a.key, WINDOW_S) == ["seed"]
    b = control.add_step("B", step(2, prefix="b"), 0)
    assert windows.step_started(b.key, 20 * WINDOW_S) == []  # the seed is A's
    control.tick()
    control.worker_joined("w", 0, capacity=8, kind="spot")
    await asyncio.sleep(WINDOW_S * 5)  # A's window closed: every request leaves the seed
    assert control.pool.get("seed").state is WorkerState.TRAINING
    windows.step_ended(a.key)
    assert control.pool.get("seed").state is WorkerState.HEALTHY  # free for the next step
    windows.step_ended(b.key)  # B had no window: its end leaves the seed as it is
    assert control.pool.get("seed").state is WorkerState.HEALTHY


@pytest.mark.parametrize("remote", ["on another version", "held as standby"])
async def test_remote_workers_that_cannot_take_the_step_leave_the_seed_to_finish_it(remote):
    """At the close only a worker on the step's version, and not held as standby by the
    instance cap, is a remote one: one still loading the version takes none of the step's
    requests, nor does one the cap holds back."""
    control = RolloutControl(ControlConfig(theta=1), Clock())
    executed: list[Command] = []
    windows = SeedWindows(control, executed.extend, lambda: None)
    control.worker_joined("seed", 1, capacity=8, kind="seed")
    if remote == "held as standby":
        control.worker_joined("w", 1, capacity=8, kind="spot")
        control.pool.set_instance_cap(0)
    else:
        control.worker_joined("w", 0, capacity=8, kind="spot")  # still on version 0
    s = control.add_step("S", step(4, version=1), 1)
    windows.step_started(s.key, WINDOW_S, version=1)
    control.tick()
    await asyncio.sleep(WINDOW_S * 5)
    assert executed == [] and control.pool.get("seed").state is WorkerState.HEALTHY
    assert not control.tracker.waiting()  # the seed kept every request


async def test_a_seed_worker_joining_again_after_the_close_is_lent_at_once():
    """A restarted trainer's seed engine comes back under its id while the step whose window
    closed still runs: it must not decode that step while the trainer trains."""
    h = Harness()
    await asyncio.sleep(WINDOW_S * 5)
    assert h.control.pool.get("seed").state is WorkerState.TRAINING
    h.control.worker_lost("seed", "re-registered")
    h.control.worker_joined("seed", 0, capacity=4, kind="seed")
    h.windows.seed_joined("seed")
    assert h.control.pool.get("seed").state is WorkerState.TRAINING
    assert not any(isinstance(c, Dispatch) and c.worker_id == "seed" for c in h.control.tick())
    h.windows.step_ended(h.step.key)
    assert h.control.pool.get("seed").state is WorkerState.HEALTHY


async def test_a_successors_zero_window_takes_back_what_the_seed_kept_before_handing_it_over():
    """A leader failover during a seeding window: the seed worker kept the dead leader's
    requests running for a successor, and the trainer resubmits the step with the tokens it
    had and no window (0). The successor lends the seed at once, yet the seed still takes back
    what it kept — the only way the tokens it made since the leader died reach the manager —
    and each of those requests moves to a remote worker only once those tokens are in, so
    none of them is generated again."""
    control = RolloutControl(ControlConfig(theta=1), Clock())
    executed: list[Command] = []
    windows = SeedWindows(control, executed.extend, lambda: None)
    control.worker_joined("seed", 0, capacity=4, kind="seed")
    control.worker_joined("w", 0, capacity=4, kind="spot")
    # The greeting: the seed's session to the successor names what it kept, before the step.
    assert control.worker_keeps("seed", ["r0", "r1"]) == []
    had = (5, 5)  # what the trainer received of each before the leader died
    resumed = [dataclasses.replace(r, resume_token_ids=had, resume_logprobs=(0.0, 0.0))
               for r in step(2, max_tokens=32)]
    s = control.add_step("s", resumed, 0)
    assert windows.step_started(s.key, 0.0, version=0) == ["seed"]
    assert control.pool.get("seed").state is WorkerState.TRAINING  # takes nothing new
    placed = {c.request_id: c.worker_id for c in control.tick() if isinstance(c, Dispatch)}
    assert placed == {"r0": "seed", "r1": "seed"}, (
        f"the seed's kept requests were placed {placed}: they resume from the trainer's "
        "tokens and the seed's newer ones are generated again")
    # Moved before the adoption's rows come, the seed's catch-up would be dropped as stale.
    assert not [c for c in control.tick() if isinstance(c, (Migrate, Release))]
    control.step_deltas("seed", [TokenDelta(rid, 2, (7, 7, 7), (0.0,) * 3, 0)
                                 for rid in ("r0", "r1")])  # made while no manager held it
    moved = [c for c in control.tick() if isinstance(c, (Migrate, Release))]
    assert sorted(c.request_id for c in moved) == ["r0", "r1"]
    assert {control.tracker.get(rid).worker_id for rid in ("r0", "r1")} <= {None, "w"}
    for rid in ("r0", "r1"):  # each resumes on the remote worker from the seed's last token
        assert control.tracker.get(rid).token_ids == [5, 5, 7, 7, 7]
    assert control.tracker.counters.tokens_regenerated == 0
