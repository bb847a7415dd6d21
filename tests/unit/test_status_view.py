"""`rlharvest status --watch`'s view, rendered from hand-built snapshots (no etcd, no services),
and its Watcher against a fake etcd client: a member that left etcd shows as gone, an etcd that
stops answering keeps the last view under a clear line."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rich.console import Console

from rlharvest.common import keys
from rlharvest.cli import status_view as sv


def text(snap: sv.Snapshot, width: int = 200, last_steps: int = 5) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(sv.render(snap, last_steps))
    return console.export_text()


def rows(out: str, first_cell: str) -> list[str]:
    """The table rows of ``out`` whose first cell is ``first_cell``."""
    return [line for line in out.splitlines()
            if line.strip("│ ").split("│")[0].strip() == first_cell]


TRAINER = sv.TrainerView(
    "trainer-0", "default", state="training", weight_version=7, steps_done=7, target_steps=20,
    current=sv.StepInProgress(step=8, weight_version=7, phase="rollout", samples=32,
                              completions=12, groups_trained=2, tokens_generated=4321),
    recent=tuple(sv.StepDone(step=s, mean_reward=0.1 * s, step_time_s=1.5, tokens=1000,
                             tokens_per_second=666.7, weight_version=s - 1) for s in range(1, 8)))

SNAP = sv.Snapshot(
    "127.0.0.1:2379", taken_at=1_700_000_000.0, refresh=3, last_ok_at=1_700_000_000.0,
    members=(
        sv.Member("rollout_manager", "manager-0", "127.0.0.1:5000", job="default"),
        sv.Member("rollout_worker", "worker-0", "127.0.0.1:5001", "dedicated", "default", 7,
                  "up", sv.WorkerLoad(pending=3, executing=5, kv_used_tokens=256,
                                      kv_capacity_tokens=1024, preemptions=2,
                                      tokens_per_second=812.0)),
        sv.Member("rollout_worker", "worker-1", "127.0.0.1:5002", "spot", "default", 5,
                  "unreachable"),
        sv.Member("rollout_worker", "worker-2", "127.0.0.1:5003", "spot", "default", 6,
                  sv.GONE),
        sv.Member("trainer", "trainer-0", "127.0.0.1:5004", job="default", weight_version=7,
                  state="training"),
    ),
    managers=(sv.ManagerView("manager-0", "default", workers=(
        sv.ManagedWorker("worker-0", "healthy", 7), sv.ManagedWorker("worker-1", "lost", 5)),
        in_flight=8, waiting=3, completions=140, failures=1),),
    trainers=(TRAINER,))


def test_the_view_shows_members_versions_load_and_the_step_in_progress():
    out = text(SNAP)
    assert "etcd 127.0.0.1:2379" in out and "refresh 3" in out
    assert "unreachable" not in out.splitlines()[0]
    # members with their state; the worker whose record left etcd is gone, not dropped
    for member in ("manager-0", "worker-0", "worker-1", "worker-2", "trainer-0"):
        assert member in out
    assert any(sv.GONE in line for line in rows(out, "rollout_worker") if "worker-2" in line)
    # versions: each worker's, how far behind the trainer it is, and the trainer's
    assert "rollout workers (trainer at version 7)" in out
    (w0,) = rows(out, "worker-0")
    assert "dedicated" in w0 and "│ 7 " in w0 and "│ 0 " in w0  # version 7, 0 behind
    (w1,) = rows(out, "worker-1")
    assert "unreachable" in w1 and "│ 2 " in w1  # version 5: 2 behind
    # load: pending, executing, KV used, preemptions, tokens/s
    assert "256/1024 (25%)" in w0 and "812" in w0
    assert [c.strip() for c in w0.split("│")[5:9]] == ["3", "5", "256/1024 (25%)", "2"]
    # the step in progress
    assert "weights at version 7" in out and "7/20 steps done" in out
    assert ("step in progress: step 8 · phase rollout · completions 12/32 samples · "
            "groups trained 2") in out
    # the manager's view: the lost worker stands out
    (m0,) = rows(out, "manager-0")[-1:]
    assert "1/2 healthy" in m0 and "worker-1 lost" in m0


def test_recent_steps_are_the_last_n_with_the_round_kind_only_under_tail_batching():
    out = text(SNAP, last_steps=3)
    assert "recent steps of trainer-0" in out
    assert [r.split("│")[1].strip() for r in rows(out, "5") + rows(out, "6") + rows(out, "7")
            ] == ["5", "6", "7"]
    assert not rows(out, "4")  # only the last 3
    (step7,) = rows(out, "7")
    assert "0.700" in step7 and "1.50" in step7 and "667" in step7
    assert "round" not in out
    tail = sv.TrainerView("trainer-0", "default", state="training", recent=(
        sv.StepDone(1, 0.5, 2.0, 100, 50.0, 0, "short"),
        sv.StepDone(2, 0.6, 3.0, 200, 66.0, 1, "long")))
    out = text(sv.Snapshot("e:1", refresh=1, trainers=(tail,)))
    assert "round" in out
    assert "short" in rows(out, "1")[0] and "long" in rows(out, "2")[0]


def test_an_unreachable_trainer_or_manager_shows_as_such():
    snap = sv.Snapshot("e:1", refresh=1, members=(
        sv.Member("trainer", "trainer-0", "127.0.0.1:9", state="unreachable"),),
        managers=(sv.ManagerView("manager-0", "default", reachable=False),),
        trainers=(sv.TrainerView("trainer-0", "default", reachable=False),))
    out = text(snap)
    assert "trainer trainer-0 (job default): unreachable" in out
    assert "unreachable" in rows(out, "manager-0")[0]
    assert "step in progress" not in out


def test_a_failed_trainer_shows_its_error_and_no_step_in_progress():
    failed = sv.TrainerView("trainer-0", "default", state="failed", steps_done=3,
                            current=sv.StepInProgress(step=4), error="reward function crashed")
    out = text(sv.Snapshot("e:1", refresh=1, trainers=(failed,)))
    assert "failed, 3 steps done" in out and "error: reward function crashed" in out
    assert "step in progress" not in out


def test_etcd_unreachable_is_one_clear_line():
    out = text(sv.Snapshot("127.0.0.1:1", refresh=1, etcd_error="connection refused"))
    assert "etcd at 127.0.0.1:1 is unreachable (connection refused); retrying" in out
    assert "no members registered" not in out  # it never answered: nothing to say about them
    assert "no members registered" in text(sv.Snapshot("127.0.0.1:1", refresh=1))


class FakeEtcd:
    def __init__(self) -> None:
        self.records: dict[str, dict] = {}
        self.down = False
        self.closed = 0

    async def get_prefix(self, prefix: bytes):
        if self.down:
            raise ConnectionError("etcd went away")
        return [SimpleNamespace(key=k.encode(), value=json.dumps(v).encode())
                for k, v in self.records.items() if k.encode().startswith(prefix)]

    async def close(self) -> None:
        self.closed += 1


async def test_the_watcher_marks_members_that_left_and_keeps_the_last_view_without_etcd():
    etcd = FakeEtcd()
    # no endpoints: every status RPC fails at once (unreachable), no network involved
    etcd.records[keys.member_key("transfer_agent", "agent-0")] = {"agent_id": "agent-0"}
    etcd.records[keys.member_key("rollout_worker", "w0")] = {"kind": "spot",
                                                              "weight_version": 3}
    watcher = sv.Watcher("e:1", timeout=0.5)
    watcher._client = etcd
    first = await watcher.refresh()
    assert first.refresh == 1 and not first.etcd_error
    assert {(m.member_id, m.state) for m in first.members} == {("agent-0", "up"),
                                                               ("w0", "unreachable")}
    del etcd.records[keys.member_key("rollout_worker", "w0")]
    second = await watcher.refresh()
    assert {(m.member_id, m.state) for m in second.members} == {("agent-0", "up"),
                                                                ("w0", sv.GONE)}
    etcd.down = True
    third = await watcher.refresh()
    assert third.refresh == 3 and "etcd went away" in third.etcd_error
    assert third.members == second.members and third.last_ok_at == second.taken_at
    assert watcher._client is None and etcd.closed == 1  # reconnects on the next refresh
    assert "is unreachable (etcd went away)" in text(third)


def test_status_replies_become_the_snapshot_the_view_renders():
    from rlharvest.common.pb import common_pb2, rollout_worker_pb2, trainer_pb2

    reply = trainer_pb2.TrainerStatus(
        trainer_id="trainer-0", job="default", state="training", steps_done=4, target_steps=9,
        weight_version=4, current=trainer_pb2.StepProgress(
            step=5, weight_version=4, samples=16, completions=9, groups_trained=1, phase="rollout"),
        steps=[trainer_pb2.StepSummary(step=4, weight_version=3, mean_reward=0.25,
                                       step_time_s=2.0, tokens=300, tokens_per_second=150.0,
                                       round="long")])
    trainer = sv._trainer("trainer-0", "", reply)
    assert trainer.current == sv.StepInProgress(5, 4, "rollout", 16, 9, 1, 0)
    assert trainer.recent == (sv.StepDone(4, 0.25, 2.0, 300, 150.0, 3, "long"),)
    assert not sv._trainer("trainer-0", "default", None).reachable
    info = rollout_worker_pb2.WorkerInfo(weight_version=4, load=common_pb2.Load(
        pending=1, executing=2, kv_used_tokens=10, kv_capacity_tokens=100, preemptions=3,
        tokens_per_second=9.5))
    worker = sv._worker({"endpoint": "h:1", "kind": "spot", "weight_version": 3}, "w0",
                        "rollout_worker", info)
    assert (worker.weight_version, worker.state) == (4, "up")  # its own answer is the newest
    assert worker.load == sv.WorkerLoad(1, 2, 10, 100, 3, 9.5)
    lent = sv._worker({"job": "default"}, "c0", "coexecutor", info)
    assert lent.state == "lent to default"
    out = text(sv.Snapshot("e:1", refresh=1, members=(worker,), trainers=(trainer,)))
    assert "rollout workers (trainer at version 4)" in out and "round" in out
