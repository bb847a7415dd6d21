"""WEAVE in the data plane, the parts without I/O: a placed worker's job switches (what it
registers, in which order, which weights it loads and keeps) and the trainer's phase gate (which
permits a step, a retried step and a failed training phase take)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import partial

import pytest

import torch

from rlharvest.services.placement_scheduler.client import PhaseRun
from rlharvest.services.placement_scheduler.model import Pool
from rlharvest.services.rollout_worker.placement_follower import NodeFollower, turn_of
from rlharvest.services.trainer.placed_phases import PlacedPhases
from rlharvest.services.trainer import tail_reports
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.rollout_worker.config import WorkerConfig


class Worker:
    """The engine and member record a follower drives, as a log of what happened."""

    def __init__(self) -> None:
        self.weights = {"w": torch.zeros(2)}
        self.version = 0
        self.log: list[tuple] = []
        self.loaded_for: list[str] = []
        self.pullers: dict[str, Puller] = {}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.weights.items()}

    async def read(self, fn):
        return fn()

    async def load(self, weights, version: int, source: str, job: str) -> None:
        self.weights = {k: v.clone() for k, v in weights.items()}
        self.version = version
        self.log.append(("load", float(self.weights["w"][0]), version))
        self.loaded_for.append(job)  # whose weights they are now

    async def register(self, job: str) -> None:
        self.log.append(("register", job))

    def follower(self, resident: int = 2) -> NodeFollower:
        follower = NodeFollower(None, "rollout-1", read=self.read, weights=self.snapshot,
                                version=lambda: self.version, load=self.load,
                                register=self.register, resident_jobs=resident,
                                make_puller=self.pullers.get if self.pullers else None)
        follower._start = self.snapshot()  # what run() reads first
        return follower


async def test_a_switch_leaves_the_old_job_first_and_a_job_served_before_loads_warm() -> None:
    worker = Worker()
    follower = worker.follower()
    await follower.switch("A")
    worker.weights["w"].fill_(1.0)  # A trains: its puller loads A's version 3
    worker.version = 3
    await follower.switch("B")
    assert worker.log == [("load", 0.0, 0), ("register", "A"),
                          ("register", ""), ("load", 0.0, 0), ("register", "B")]
    worker.log.clear()
    await follower.switch("A")  # A's version 3 comes back from host memory, not a pull
    assert worker.log == [("register", ""), ("load", 1.0, 3), ("register", "A")]
    # Every load names the job whose weights it loads, before the record names that job: the
    # start weights go in as B's version 0, A's resident copy as A's.
    assert worker.loaded_for == ["A", "B", "A"]
    await follower.switch("")  # the node left every group: registered for no job
    assert worker.log[-1] == ("register", "")
    assert follower.job == ""


async def test_a_cold_switch_loads_the_start_weights_as_the_jobs_version_0() -> None:
    # Started as version 5 of something (--weights --weight-version 5): to a job it never served
    # its start weights are that job's version 0, fenced by their fingerprint, never its 5.
    worker = Worker()
    worker.version = 5
    await worker.follower().switch("B")
    assert worker.log[0] == ("load", 0.0, 0) and worker.loaded_for == ["B"]


async def test_resident_weights_keep_only_the_most_recently_served_jobs() -> None:
    worker = Worker()
    follower = worker.follower(resident=1)
    for job, value in (("A", 1.0), ("B", 2.0), ("C", 3.0)):
        await follower.switch(job)
        worker.weights["w"].fill_(value)
    worker.log.clear()
    await follower.switch("B")  # kept when C came (one job besides the one served)
    assert ("load", 2.0, 0) in worker.log
    worker.log.clear()
    await follower.switch("A")  # dropped when B was kept: a cold start from the start weights
    assert ("load", 0.0, 0) in worker.log


class Puller:
    """A job's puller: ``crash`` times it raises, then it pulls (holds ``held``) and waits."""

    def __init__(self, worker: Worker, value: float, crash: int = 0, hang: bool = False) -> None:
        self.worker, self.value, self.crash, self.hang = worker, value, crash, hang
        self.held: dict[str, torch.Tensor] = {}
        self.held_version: int | None = None
        self.pulling = False
        self.runs = 0

    async def run(self) -> None:
        self.runs += 1
        if self.crash:
            self.crash -= 1
            raise RuntimeError("agent went away")
        self.pulling = True
        self.held["w"] = torch.full((2,), -1.0)  # a delta applied in place, half-way
        await asyncio.sleep(0)
        if self.hang:
            await asyncio.Event().wait()  # the pull never lands before the switch
        self.held, self.held_version = {"w": torch.full((2,), self.value)}, 7
        await self.worker.load(self.held, 7, "pull", "A")
        self.pulling = False
        await asyncio.Event().wait()  # waits for the next announcement until cancelled

    def forget(self) -> None:
        self.held, self.held_version, self.pulling = {}, None, False


async def test_a_crashed_puller_restarts_and_its_held_weights_are_the_resident_copy() -> None:
    worker = Worker()
    worker.pullers["A"] = Puller(worker, 5.0, crash=1)
    follower = worker.follower()
    await follower.switch("A")
    for _ in range(200):  # the supervisor restarts it after a second
        if worker.pullers["A"].held_version == 7:
            break
        await asyncio.sleep(0.01)
    assert worker.pullers["A"].runs == 2 and worker.version == 7
    await follower.switch("")  # A's copy is the puller's own tensors, not a second one
    assert follower._resident["A"][0] is worker.pullers["A"].held
    await follower.switch("A")
    assert worker.log[-2:] == [("load", 5.0, 7), ("register", "A")]
    await follower._stop_pulling()


async def test_a_puller_stopped_mid_pull_forgets_what_it_held() -> None:
    worker = Worker()
    worker.pullers["A"] = Puller(worker, 5.0, hang=True)
    follower = worker.follower()
    await follower.switch("A")
    await asyncio.sleep(0.01)
    assert worker.pullers["A"].pulling  # stopped before its pull landed
    await follower.switch("B")
    assert worker.pullers["A"].held == {} and worker.pullers["A"].held_version is None


@pytest.mark.parametrize("raw, job", [(None, ""), (b'{"turn": "job-a", "holder": null}', "job-a"),
                                      (b'{"turn": null}', ""), (b"not json", ""), (b"[1]", "")])
def test_a_node_record_names_the_job_to_serve_or_none(raw, job) -> None:
    assert turn_of(raw) == job


@dataclass
class Job:
    """PlacementJob's permit protocol, recorded."""

    next_phase: tuple[Pool, int] = (Pool.ROLLOUT, 0)
    calls: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def spec(self):
        return type("Spec", (), {"job_id": "job-a"})

    async def acquire(self, phase: Pool) -> PhaseRun:
        assert phase is self.next_phase[0], f"asked for {phase} before {self.next_phase}"
        self.calls.append(("acquire", phase.value, self.next_phase[1]))
        return PhaseRun(self, phase, self.next_phase[1], ["n1"])  # type: ignore[arg-type]

    async def release(self, run: PhaseRun) -> None:
        self.calls.append(("release", run.phase.value, run.iteration))
        self.next_phase = (Pool.TRAIN, run.iteration) if run.phase is Pool.ROLLOUT else \
            (Pool.ROLLOUT, run.iteration + 1)


async def test_a_step_holds_the_rollout_then_the_training_permit_one_at_a_time() -> None:
    job = Job()
    phases = PlacedPhases(job)  # type: ignore[arg-type]
    await phases.rollout()
    await phases.train()
    await phases.done()
    assert job.calls == [("acquire", "rollout", 0), ("release", "rollout", 0),
                         ("acquire", "train", 0), ("release", "train", 0)]


async def test_a_retried_rollout_keeps_its_permit_and_a_failed_training_ends_the_iteration() -> None:
    job = Job()
    phases = PlacedPhases(job)  # type: ignore[arg-type]
    await phases.rollout()
    await phases.rollout()  # the step failed mid-rollout and is retried: same permit
    assert job.calls == [("acquire", "rollout", 0)]
    await phases.train()
    await phases.rollout()  # failed while training: iteration 0 ends, the retry is iteration 1
    assert job.calls[-3:] == [("acquire", "train", 0), ("release", "train", 0),
                              ("acquire", "rollout", 1)]


async def test_a_step_failed_between_its_phases_runs_an_empty_training_phase() -> None:
    job = Job(next_phase=(Pool.TRAIN, 4))  # the rollout permit went back, training never began
    phases = PlacedPhases(job)  # type: ignore[arg-type]
    await phases.rollout()
    assert job.calls == [("acquire", "train", 4), ("release", "train", 4),
                         ("acquire", "rollout", 5)]


def test_placement_flags_are_refused_with_one_duration_or_with_the_seed_role() -> None:
    with pytest.raises(ValueError, match="placement-t-roll-s"):
        TrainerConfig(placement_scheduler=True, placement_t_train_s=1)
    with pytest.raises(ValueError, match="exclude each other"):
        TrainerConfig(placement_scheduler=True, placement_t_roll_s=1, placement_t_train_s=1,
                      seed_role=True, instance_cap="auto")
    with pytest.raises(ValueError, match="drop --job"):
        WorkerConfig(placement_node="rollout-1", job="job-a")
    with pytest.raises(ValueError, match="one per resident job"):
        WorkerConfig(placement_node="rollout-1", held_weights="device")


@pytest.mark.parametrize("flags, words", [
    (["--jobs", "2"], "add --placement-scheduler"),
    (["--jobs", "2", "--placement-scheduler", "--spot", "1"], "drop --spot"),
    (["--jobs", "2", "--placement-scheduler", "--no-manager"], "drop --no-manager"),
    (["--jobs", "2", "--placement-scheduler", "--workers", "0"], "at least one rollout worker"),
])
def test_up_refuses_several_jobs_it_cannot_place(flags, words, tmp_path) -> None:
    from typer.testing import CliRunner

    from rlharvest.cli.main import app

    result = CliRunner().invoke(app, ["up", *flags, "--log-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.output.split())


def test_up_places_a_worker_on_each_gpu_slot_under_the_schedulers_slot_names() -> None:
    from rlharvest.cli.up_command import placed_units

    assert placed_units(2, 1) == ("rollout-1", "rollout-2")
    assert placed_units(2, 2) == ("rollout-1.gpu0", "rollout-1.gpu1",
                                  "rollout-2.gpu0", "rollout-2.gpu1")


async def test_a_cancelled_release_still_goes_through_and_is_not_asked_twice() -> None:
    job = Job()

    async def slow_release(run: PhaseRun) -> None:
        await asyncio.sleep(0.05)
        await Job.release(job, run)

    job.release = slow_release  # type: ignore[method-assign]
    phases = PlacedPhases(job)  # type: ignore[arg-type]
    await phases.rollout()
    ending = asyncio.ensure_future(phases.end_rollout())
    await asyncio.sleep(0.01)
    ending.cancel()  # the step is cancelled while the rollout permit goes back
    await asyncio.sleep(0.1)
    await phases.train()
    assert job.calls == [("acquire", "rollout", 0), ("release", "rollout", 0),
                         ("acquire", "train", 0)]


# --- progress reports for long-tail migration (rlharvest/services/trainer/tail_reports.py) ---------------
@pytest.mark.parametrize("open_requests, assigned, expected", [
    (3, {"r1": 2, "r2": 1}, {"r1": 2, "r2": 1}),  # the manager's picture as it is
    (2, {"r1": 2, "r2": 1}, {"r1": 1, "r2": 1}),  # one finished since: proportional, rounded
    (5, {"r1": 2, "r2": 1}, {"r1": 3, "r2": 2}),  # queued ones land where most are
    (4, {}, {"r1": 4, "r2": 0}),  # nothing assigned yet: the first node
    (0, {"r1": 2}, {"r1": 0, "r2": 0}),
    (2, {"r1": 1, "r3": 5}, {"r1": 2, "r2": 0}),  # a node outside the permit is not counted
])
def test_open_requests_per_node_always_add_up_to_the_open_count(open_requests, assigned,
                                                                expected) -> None:
    by_node = tail_reports.open_by_node(open_requests, assigned, ["r1", "r2"])
    assert by_node == expected and sum(by_node.values()) == open_requests


async def test_a_migration_granted_while_the_rollout_ends_is_still_counted(monkeypatch) -> None:
    """The rollout's end cancels its reporter; a report already on its way finishes on its own,
    and a migration the scheduler granted in it is counted (the scheduler counted it too)."""
    from types import SimpleNamespace

    from rlharvest.common.pb import placement_scheduler_pb2 as pb

    granted, answered = asyncio.Event(), asyncio.Event()

    async def report_progress(total, done, by_node):
        granted.set()  # the scheduler has it: the reply is on its way
        await answered.wait()
        return pb.TailMigration(keep_node_ids=["r1"], freed_node_ids=["r2"])

    async def acquire(*_args, **_kwargs):
        return SimpleNamespace(node_ids=["r1", "r2"], pending_node_ids=[])

    async def nothing_assigned(*_args):
        return {}

    monkeypatch.setattr(tail_reports, "assigned_by_node", nothing_assigned)
    run = SimpleNamespace(job=SimpleNamespace(spec=SimpleNamespace(job_id="j"),
                                              client=SimpleNamespace(acquire=acquire)),
                          iteration=3, node_ids=[], report_progress=report_progress)
    before = tail_reports.TAIL_MIGRATIONS._value.get()
    reporter = asyncio.ensure_future(tail_reports.report_until_migrated(
        run, None, lambda: "manager", 8, lambda: 7, 0.001))
    await granted.wait()
    reporter.cancel()  # the rollout ended
    with pytest.raises(asyncio.CancelledError):
        await reporter
    answered.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert tail_reports.TAIL_MIGRATIONS._value.get() == before + 1
    assert not tail_reports._IN_FLIGHT


# --- the measured warm-up profile (rlharvest/services/trainer/warmup_profile.py) --------------------------
def test_a_measured_profile_times_the_workers_engine_and_the_policys_forward() -> None:
    from rlharvest.models.tiny_model import build_model
    from rlharvest.services.trainer import warmup_profile

    policy = build_model(seed=0)
    profile = warmup_profile.measure_profile(
        "tiny", partial(warmup_profile.time_forward, policy), torch.device("cpu"), batch=4,
        prompt_tokens=12, max_response_tokens=32)
    assert (profile.batch_size, profile.prompt_tokens, profile.max_response_tokens) == (4, 12, 32)
    assert profile.prefill_s > 0 and profile.decode_s_per_token > 0
    assert profile.train_tokens_per_s > 0
    # The scheduler's worst case: every response at the limit, 32 decode steps of the batch.
    assert profile.worst_case_rollout_s() == pytest.approx(
        profile.prefill_s + 32 * profile.decode_s_per_token)


def test_a_measured_profile_decodes_in_the_dtype_the_workers_serve(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rlharvest.models.tiny_model import build_model
    from rlharvest.services.trainer import warmup_profile

    built: list[torch.dtype] = []

    class Recorded(warmup_profile.TorchEngine):  # the real engine, its dtype noted
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            built.append(next(self._model.parameters()).dtype)

    monkeypatch.setattr(warmup_profile, "TorchEngine", Recorded)
    forward = partial(warmup_profile.time_forward, build_model(seed=0))
    cpu = torch.device("cpu")
    warmup_profile.measure_profile("tiny", forward, cpu, batch=2, prompt_tokens=4,
                                   max_response_tokens=8, served=torch.bfloat16)
    warmup_profile.measure_profile("tiny", forward, cpu, batch=2, prompt_tokens=4,
                                   max_response_tokens=8)
    assert built == [torch.bfloat16, torch.float32]


def test_a_placed_trainer_takes_both_durations_or_measures_its_profile() -> None:
    from rlharvest.services.placement_scheduler.model import JobProfile
    from rlharvest.services.trainer.main import placement_spec

    base = dict(job="j", placement_scheduler=True)
    measured = TrainerConfig(**base)  # neither: measured at start-up
    profile = JobProfile(8, 16, 64, 0.01, 0.1, 1000.0)
    spec = placement_spec(measured, profile)
    assert spec.profile == profile and spec.t_roll_s is None and spec.t_train_s is None
    given = placement_spec(TrainerConfig(**base, placement_t_roll_s=30, placement_t_train_s=20))
    assert (given.t_roll_s, given.t_train_s, given.profile) == (30, 20, None)
    with pytest.raises(ValueError, match="or neither"):
        TrainerConfig(**base, placement_t_roll_s=30)
