"""The worker core composed in-process — session hub, engine pump, session commands and the
rollout admission policy around a real TorchEngine — driven by in-process sessions: true step
stats, backpressure on the pump, command errors, aborts, drain, weight swaps, lost sessions; and
the same parts composed with another admission policy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
import torch

from rlharvest.common.engine_types import EngineRequest
from rlharvest.common.errors import AlreadyExists, ServiceError
from rlharvest.common.pb import rollout_worker_pb2 as pb
from rlharvest.models.tiny_model import build_model
from rlharvest.common.worker_core.admission import Admission, WorkerView
from rlharvest.common.worker_core.engine_pump import EnginePump
from rlharvest.common.worker_core.session_commands import SessionCommands
from rlharvest.common.worker_core.session_hub import RoutedStep, SessionHub
from prometheus_client import REGISTRY
from rlharvest.services.rollout_worker.admission import RolloutAdmission
from rlharvest.services.rollout_worker.torch_engine import TorchEngine
from tests.worker_sessions import InProcessSession, abort, add, deltas_of, handle_of

PROMPT = [1, 5, 9, 13, 17]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny ops: OpenMP threads spin-waiting for a busy core would slow every step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Core:
    engine: TorchEngine
    hub: SessionHub
    pump: EnginePump[RoutedStep]
    commands: SessionCommands
    versions_seen: list[int]

    def session(self, job: str = "default") -> InProcessSession:
        return InProcessSession(self.commands, job)


@asynccontextmanager
async def running_core(max_running: int = 4, max_pending: int = 4, session_queue: int = 256,
                       heartbeat_s: float = 1.0, admission: Admission | None = None,
                       keep_s: float = 0.0) -> AsyncIterator[Core]:
    """The rollout worker's composition (or the core with another ``admission``), its pump
    running for the block."""
    engine = TorchEngine("tiny", seed=0, max_running=max_running, max_len=128)
    hub = SessionHub(session_queue, keep_tokens=keep_s > 0)
    pump: EnginePump[RoutedStep] = EnginePump(engine, hub, heartbeat_s=heartbeat_s)
    versions: list[int] = []
    commands = SessionCommands(engine, hub, pump,
                               admission or RolloutAdmission(max_running, max_pending),
                               on_version_change=versions.append, keep_s=keep_s,
                               job="default")
    task = asyncio.create_task(pump.run())
    try:
        yield Core(engine, hub, pump, commands, versions)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pump.close()


async def test_every_step_message_carries_the_steps_true_stats():
    prompts = {"a": PROMPT, "b": PROMPT * 2, "c": PROMPT * 3, "d": PROMPT[:2]}
    async with running_core(max_running=2) as core:
        first, second = core.session(), core.session()
        await first.send(add("a", prompts["a"], max_tokens=5), add("b", prompts["b"], max_tokens=7))
        await second.send(add("c", prompts["c"], max_tokens=4), add("d", prompts["d"], max_tokens=3))
        await first.finish(["a", "b"])
        await second.finish(["c", "d"])
    steps: dict[int, list[pb.StepOutputs]] = {}
    for session in (first, second):
        for message in session.collected.steps:
            steps.setdefault(message.step, []).append(message)
    first_step = {}  # request id -> the step that admitted (prefilled) it
    for number in sorted(steps):
        for message in steps[number]:
            for d in deltas_of(message):
                first_step.setdefault(d.request_id, number)
    assert len(steps) == core.pump.steps  # a message for every step, none for other events
    for number, messages in steps.items():
        stats = messages[0].stats
        assert all(m.stats == stats for m in messages)  # the same in every session's message
        deltas = [d for m in messages for d in deltas_of(m)]
        assert stats.batch_size == len(deltas) <= 2  # every decoding request, within the slots
        assert stats.decode_tokens == sum(len(d.token_ids) for d in deltas)
        assert stats.prefill_tokens == sum(len(prompts[r]) for r, n in first_step.items()
                                           if n == number)
        assert stats.duration_s > 0
    assert {s[0].stats.batch_size for s in steps.values()} >= {1, 2}


async def test_the_load_reports_rate_is_the_windows_tokens_kept_as_a_running_sum():
    async with running_core() as core:
        session = core.session()
        await session.send(add("a", PROMPT, max_tokens=40), add("b", PROMPT, max_tokens=40))
        await session.finish(["a", "b"])
        rate = core.pump.snapshot_load().tokens_per_second
        counts = core.pump._token_counts
        assert core.pump._token_sum == sum(n for _, n in counts) == 80  # all within the window
        assert rate > 0
        steps = len(counts)
        counts.appendleft((counts[0][0] - 60.0, 7))  # a step older than the window
        core.pump._token_sum += 7
        core.pump.snapshot_load()  # drops it, and its tokens from the sum
        assert core.pump._token_sum == 80 and len(counts) == steps


async def test_a_slow_reader_slows_the_pump():
    async with running_core(session_queue=1) as core:
        session = core.session()
        await session.send(add("r", PROMPT, max_tokens=60))
        await asyncio.sleep(0.3)  # nobody reads: the outbox holds the hello, the pump waits
        assert core.pump.steps <= 2
        got = await session.finish(["r"])
        assert len(got.completions["r"].tokens) == 60 and core.pump.steps >= 60


async def test_command_errors_come_back_and_the_session_goes_on():
    async with running_core() as core:
        session = core.session()
        await session.send(add("ok", PROMPT, max_tokens=8), add("empty", [], max_tokens=8),
                           add("vocab", [1, 100000]), add("zero", PROMPT, max_tokens=0),
                           add("version", PROMPT, version=42), add("", PROMPT),
                           pb.WorkerCommand(), abort("never-added"), add("ok", PROMPT))
        got = await session.finish(["ok", "empty", "vocab", "zero", "version", "never-added", ""])
        codes = {rid: code for rid, (code, _) in got.errors.items()}
        assert codes == {"empty": grpc.StatusCode.INVALID_ARGUMENT,
                         "vocab": grpc.StatusCode.INVALID_ARGUMENT,
                         "zero": grpc.StatusCode.INVALID_ARGUMENT,
                         "version": grpc.StatusCode.FAILED_PRECONDITION,
                         "": grpc.StatusCode.INVALID_ARGUMENT,
                         "never-added": grpc.StatusCode.NOT_FOUND,
                         "ok": grpc.StatusCode.ALREADY_EXISTS}  # the duplicate
        assert "100000" in got.errors["vocab"][1] and "42" in got.errors["version"][1]
        # An add's refusal names its dispatch (the manager ignores one about an earlier one).
        # ("" last names the command with neither add nor abort; an abort names no dispatch.)
        named = ("ok", "empty", "vocab", "zero", "version")
        assert got.refused_handles == {**{r: handle_of(r) for r in named}, "": 0,
                                       "never-added": 0}
        assert len(set(got.refused_handles.values())) == len(named) + 1
        await session.read_until(lambda c: "ok" in c.completions
                                 and c.completions["ok"].finish_reason == "length")
        assert core.hub.holder("empty") is None  # an engine refusal frees the id


async def test_an_abort_confirms_after_the_tokens_before_it():
    async with running_core() as core:
        session = core.session()
        await session.send(add("long", PROMPT, max_tokens=100))
        await session.read_until(lambda c: "long" in c.completions
                                 and len(c.completions["long"].tokens) >= 3)
        await session.send(abort("long"))
        got = await session.finish(["long"])  # positions are checked as they arrive
        assert got.completions["long"].finish_reason == "abort"
        assert len(got.completions["long"].tokens) < 100
        assert not core.engine.has_work()


async def test_a_half_closed_session_ends_after_its_requests():
    async with running_core() as core:
        session = core.session()
        await session.send(add("r", PROMPT, max_tokens=5))
        session.half_close()
        await session.read_until(lambda c: False)  # returns when the session ends
        assert session.collected.completions["r"].finish_reason == "length"


async def test_a_half_closed_session_ends_when_the_engine_refuses_its_last_request():
    # The admission takes the add; the engine refuses it (prompt + max_tokens beyond its
    # context of 128): that refusal is the request's end, as a final delta would be.
    async with running_core() as core:
        session = core.session()
        await session.send(add("r", PROMPT, max_tokens=5))
        await session.finish(["r"])
        await session.send(add("long", PROMPT, max_tokens=200))
        session.half_close()
        await session.read_until(lambda c: False, timeout=10)  # returns when the session ends
        got = session.collected
        assert got.errors["long"][0] == grpc.StatusCode.INVALID_ARGUMENT
        assert got.completions["r"].finish_reason == "length"
        assert core.hub.holder("long") is None


async def test_draining_refuses_new_adds_and_every_session_hears_it():
    async with running_core() as core:
        session = core.session()
        await session.send(add("r", PROMPT, max_tokens=100))
        await session.read_until(lambda c: "r" in c.completions)
        drain = asyncio.create_task(core.hub.drain(timeout=10, reason="spot notice"))
        await session.read_until(lambda c: c.draining)
        await session.send(add("late", PROMPT), abort("r"))
        got = await session.finish(["late", "r"])
        assert got.errors["late"][0] == grpc.StatusCode.UNAVAILABLE
        assert got.completions["r"].finish_reason == "abort"
        assert await asyncio.wait_for(drain, 5) is True


async def test_a_weight_swap_ends_held_requests_and_later_ones_run_on_the_new_version():
    async with running_core(max_running=1) as core:
        session = core.session()
        await session.send(add("running", PROMPT, max_tokens=100),
                           add("queued", PROMPT, max_tokens=100))
        await session.read_until(lambda c: "running" in c.completions)
        weights = {k: v * 2 for k, v in build_model("tiny", seed=0).state_dict().items()
                   if k.endswith("norm.weight")}
        loaded = await core.commands.swap_weights(lambda: weights, 1, "a test")
        assert loaded == len(weights) and core.versions_seen == [1]
        await session.send(add("stale", PROMPT, version=0), add("fresh", PROMPT, max_tokens=4,
                                                                 version=1))
        got = await session.finish(["running", "queued", "stale", "fresh"])
        assert got.completions["running"].finish_reason == "abort"
        assert got.completions["queued"].finish_reason == "abort"
        assert got.errors["stale"][0] == grpc.StatusCode.FAILED_PRECONDITION
        assert got.completions["fresh"].versions == {1}
        assert core.pump.last_load.weight_version == 1


async def test_a_refused_weight_swap_keeps_the_weights_and_the_requests():
    async with running_core() as core:
        session = core.session()
        await session.send(add("r", PROMPT, max_tokens=30))
        await session.read_until(lambda c: "r" in c.completions)
        with pytest.raises(ValueError, match="nonexistent"):
            await core.commands.swap_weights(lambda: {"model.nonexistent": torch.zeros(2)}, 1, "x")
        got = await session.finish(["r"])
        assert got.completions["r"].finish_reason == "length" and core.engine.weight_version == 0


async def test_a_session_that_goes_away_takes_its_requests_out_of_the_engine():
    async with running_core() as core:
        session = core.session()
        await session.send(add("a", PROMPT, max_tokens=100), add("b", PROMPT, max_tokens=100))
        await session.read_until(lambda c: "a" in c.completions)
        await session.close()
        for _ in range(100):
            if not core.engine.has_work():
                break
            await asyncio.sleep(0.01)
        assert not core.engine.has_work() and not core.hub.held_ids()
        other = core.session()  # the ids are free again
        await other.send(add("a", PROMPT, max_tokens=3))
        assert (await other.finish(["a"])).completions["a"].finish_reason == "length"


class ServeAnyVersion:
    """Another service's admission: takes any version (serving traffic is not on-policy) and
    lets a weight swap leave every request running."""

    def admit(self, request: EngineRequest, weight_version: int,
              view: WorkerView) -> ServiceError | None:
        return AlreadyExists("duplicate") if request.request_id in view.held else None

    def on_weight_swap(self, version: int, held: Mapping[str, int]) -> Collection[str]:
        return ()


async def test_another_admission_policy_composes_with_the_same_core():
    async with running_core(admission=ServeAnyVersion()) as core:
        session = core.session()
        await session.send(add("chat", PROMPT, max_tokens=100, version=7))
        await session.read_until(lambda c: "chat" in c.completions)
        await core.commands.swap_weights(dict, 1, "an empty delta")
        got = await session.finish(["chat"])
        assert got.completions["chat"].finish_reason == "length"  # kept across the swap
        assert got.completions["chat"].versions == {0, 1}


async def test_an_idle_pump_sends_load_heartbeats():
    async with running_core(heartbeat_s=0.02) as core:
        session = core.session()
        got = await session.read_until(lambda c: len(c.loads) >= 3, timeout=5)
        assert all(load.executing == 0 for load in got.loads)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _wait_for(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_broken_sessions_requests_run_on_and_a_successor_adopts_every_token():
    """The manager dies: its requests run on, and a successor's adds carrying the tokens it
    had (a prefix) get the rest at once; the engine generated each token once, and the tokens
    are those of an unbroken run."""
    async with running_core(keep_s=30) as core:
        first = core.session()
        await first.send(add("long", PROMPT, max_tokens=40, seed=3),
                         add("short", PROMPT * 2, max_tokens=6, seed=4))
        got = await first.read_until(lambda c: len(c.completions.get("long", []).tokens) >= 4
                                     if "long" in c.completions else False)
        known = {rid: list(c.tokens) for rid, c in got.completions.items()}
        generated_before = _sample("rlh_worker_tokens_generated_total")
        adopted_before = _sample("rlh_worker_kept_request_outcomes_total", outcome="adopted")
        await first.close()
        await _wait_for(lambda: "short" in core.hub.kept_ids() and
                        core.hub.holder("short") is None)  # it finished while kept
        assert sorted(core.hub.kept_ids()) == ["long", "short"]
        successor = core.session()
        event = await successor.next_event()
        assert event is not None and list(event.kept.request_ids) == ["long", "short"]
        for rid, prompt, seed, max_tokens in (("long", PROMPT, 3, 40),
                                              ("short", PROMPT * 2, 4, 6)):
            successor.collected.expect_resume(rid, known.get(rid, []))
            await successor.send(add(rid, prompt, max_tokens=max_tokens, seed=seed,
                                     generated=known.get(rid, [])))
        resumed = await successor.finish(["long", "short"])
        assert not resumed.errors
        assert _sample("rlh_worker_kept_request_outcomes_total", outcome="adopted") - adopted_before == 2
        # Every token once: 40 + 6 in all, of which some were sampled before the break.
        sampled_before = sum(len(t) for t in known.values())
        assert _sample("rlh_worker_tokens_generated_total") - generated_before <= \
            46 - sampled_before
        await successor.send(add("long-again", PROMPT, max_tokens=40, seed=3),
                             add("short-again", PROMPT * 2, max_tokens=6, seed=4))
        fresh = await successor.finish(["long-again", "short-again"])
        assert resumed.completions["long"].tokens == fresh.completions["long-again"].tokens
        assert resumed.completions["short"].tokens == fresh.completions["short-again"].tokens
        k = len(known["long"])  # the successor's logprobs start where its tokens did
        assert resumed.completions["long"].logprobs == \
            pytest.approx(fresh.completions["long-again"].logprobs[k:], abs=1e-5)
        assert not core.hub.kept_ids() and not core.hub.held_ids()


async def test_an_add_that_does_not_continue_a_kept_request_is_refused_and_drops_it():
    async with running_core(keep_s=30) as core:
        first = core.session()
        await first.send(add("r", PROMPT, max_tokens=60))
        got = await first.read_until(lambda c: "r" in c.completions)
        await first.close()
        successor = core.session()
        wrong = [t + 1 for t in got.completions["r"].tokens]  # not what this worker produced
        await successor.send(add("r", PROMPT, max_tokens=60, generated=wrong))
        refused = await successor.read_until(lambda c: "r" in c.errors)
        assert refused.errors["r"][0] == grpc.StatusCode.FAILED_PRECONDITION
        await _wait_for(lambda: not core.hub.kept_ids() and not core.engine.has_work())
        await successor.send(add("r", PROMPT, max_tokens=5))  # the retry is an ordinary add
        retried = await successor.read_until(
            lambda c: "r" in c.completions and bool(c.completions["r"].finish_reason))
        assert retried.completions["r"].finish_reason == "length"
        assert len(retried.completions["r"].tokens) == 5


async def test_a_successor_that_aborts_a_kept_request_drops_it_silently():
    async with running_core(keep_s=30) as core:
        first = core.session()
        await first.send(add("r", PROMPT, max_tokens=100))
        await first.read_until(lambda c: "r" in c.completions)
        await first.close()
        successor = core.session()
        assert (await successor.next_event()).kept.request_ids == ["r"]
        await successor.send(abort("r"))  # it runs elsewhere now
        await _wait_for(lambda: not core.engine.has_work() and not core.hub.kept_ids())
        assert "r" not in successor.collected.errors and not core.hub.held_ids()


async def test_kept_requests_nobody_adopts_leave_the_engine_after_the_keep_time():
    async with running_core(keep_s=0.3) as core:
        expired_before = _sample("rlh_worker_kept_request_outcomes_total", outcome="expired")
        first = core.session()
        await first.send(add("r", PROMPT, max_tokens=120))
        await first.read_until(lambda c: "r" in c.completions)
        await first.close()
        assert core.hub.kept_ids() == ["r"] and core.engine.has_work()
        await _wait_for(lambda: not core.engine.has_work() and not core.hub.kept_ids())
        assert _sample("rlh_worker_kept_request_outcomes_total", outcome="expired") - expired_before == 1
        assert not core.hub.held_ids()


async def test_a_successor_connected_before_the_break_hears_of_the_kept_requests():
    """A handover on SIGTERM: the standby leads and opens its session first, the old leader's
    session breaks after. The kept requests are named on every open session at the break."""
    async with running_core(keep_s=30) as core:
        successor = core.session()
        assert (await successor.next_event()).WhichOneof("event") == "load"  # the hello
        first = core.session()
        await first.send(add("r", PROMPT, max_tokens=100))
        await first.read_until(lambda c: "r" in c.completions)
        await first.close()
        event = await successor.next_event()
        while event is not None and event.WhichOneof("event") == "load":  # heartbeats
            event = await successor.next_event()
        assert event is not None and list(event.kept.request_ids) == ["r"]


async def test_an_add_reusing_the_id_of_a_finished_kept_request_runs_as_a_new_request():
    """A finished kept request holds nothing in the engine: an add of its id for another
    version (or other tokens) is simply a new request, not a refusal."""
    async with running_core(keep_s=30) as core:
        first = core.session()
        await first.send(add("probe", PROMPT, max_tokens=3))
        await first.finish(["probe"])
        await first.close()
        assert core.hub.kept_ids() == ["probe"]  # finished lately on the broken session
        successor = core.session()
        await successor.send(add("probe", PROMPT, max_tokens=5, seed=9))
        got = await successor.read_until(
            lambda c: "probe" in c.errors or ("probe" in c.completions and
                                             bool(c.completions["probe"].finish_reason)))
        assert not got.errors and len(got.completions["probe"].tokens) == 5
        assert not core.hub.kept_ids()


# ---- the job in every fence ----------------------------------------------------------


def _scaled_norms(factor: float) -> dict[str, torch.Tensor]:
    return {k: v * factor for k, v in build_model("tiny", seed=0).state_dict().items()
            if k.endswith("norm.weight")}


async def test_kept_requests_are_heard_of_and_adopted_only_by_their_own_jobs_manager():
    """Job b's manager, its request ids colliding with job a's (a trainer's s{step}-g{g}-r{r}),
    neither hears of a's kept requests nor adopts them: its add meets the job fence."""
    async with running_core(keep_s=30) as core:
        first = core.session()  # job "default", whose weights the worker holds
        await first.send(add("s0-g0-r0", PROMPT, max_tokens=100))
        got = await first.read_until(lambda c: "s0-g0-r0" in c.completions)
        known = list(got.completions["s0-g0-r0"].tokens)
        await first.close()
        other = core.session(job="b")
        hello = await other.next_event()
        assert hello is not None and hello.WhichOneof("event") == "load"  # no kept list first
        await other.send(add("s0-g0-r0", PROMPT, max_tokens=100, generated=known, job="b"))
        refused = await other.read_until(lambda c: "s0-g0-r0" in c.errors)
        code, message = refused.errors["s0-g0-r0"]
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "job 'b'" in message
        assert "s0-g0-r0" not in other.collected.completions  # not one token of a's
        assert core.hub.kept_ids() == ["s0-g0-r0"]  # still a's successor's to adopt
        own = core.session()
        event = await own.next_event()
        assert event is not None and list(event.kept.request_ids) == ["s0-g0-r0"]


async def test_an_add_naming_another_job_than_its_session_is_an_invalid_argument():
    async with running_core() as core:
        session = core.session()
        await session.send(add("r", PROMPT, job="b"))
        got = await session.read_until(lambda c: "r" in c.errors)
        assert got.errors["r"][0] == grpc.StatusCode.INVALID_ARGUMENT
        assert "job" in got.errors["r"][1]


async def test_a_weight_load_drops_every_kept_request_finished_ones_too():
    """A successor at the same version number after a load must not adopt tokens of the
    weights before it (a job switch, a co-executor lent again): nothing kept survives a load."""
    async with running_core(keep_s=30) as core:
        first = core.session()
        await first.send(add("done", PROMPT, max_tokens=3), add("running", PROMPT,
                                                                 max_tokens=100))
        await first.read_until(lambda c: "done" in c.completions and
                               bool(c.completions["done"].finish_reason) and
                               "running" in c.completions)
        await first.close()
        assert sorted(core.hub.kept_ids()) == ["done", "running"]
        await core.commands.swap_weights(lambda: _scaled_norms(2.0), 0, "a test")
        await _wait_for(lambda: not core.hub.kept_ids() and not core.engine.has_work())
        successor = core.session()
        assert (await successor.next_event()).WhichOneof("event") == "load"  # nothing kept
        await successor.send(add("done", PROMPT, max_tokens=3))  # a new request, generated anew
        got = await successor.finish(["done"])
        assert got.completions["done"].finish_reason == "length"
        assert len(got.completions["done"].tokens) == 3


async def test_a_load_of_another_jobs_weights_serves_that_job_only_and_names_it_on_every_step():
    async with running_core() as core:
        mine = core.session()
        await mine.send(add("a-1", PROMPT, max_tokens=100))
        await mine.read_until(lambda c: "a-1" in c.completions)
        await core.commands.swap_weights(lambda: _scaled_norms(2.0), 0, "job b's", job="b")
        ended = await mine.finish(["a-1"])
        assert ended.completions["a-1"].finish_reason == "abort"
        await mine.send(add("a-2", PROMPT, max_tokens=4))  # same version number, other job
        refused = await mine.read_until(lambda c: "a-2" in c.errors)
        assert refused.errors["a-2"][0] == grpc.StatusCode.FAILED_PRECONDITION
        theirs = core.session(job="b")
        steps: list[pb.StepOutputs] = []
        while True:
            event = await theirs.next_event()
            if event is not None and event.WhichOneof("event") == "load":
                break
        await theirs.send(add("b-1", PROMPT, max_tokens=4, job="b"))
        while not any(d.finished for s in steps for d in deltas_of(s)):
            event = await theirs.next_event()
            assert event is not None and event.WhichOneof("event") != "error"
            if event.WhichOneof("event") == "step":
                steps.append(event.step)
        assert steps and {s.batch.job for s in steps} == {"b"}
        assert core.commands.job == "b"
