"""The rollout worker as a real process: etcd membership, streaming, abort, resume, limits,
weight loading, graceful shutdown and bad input — over real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch
from safetensors.torch import save_file

from rlharvest.common import keys, registry
from rlharvest.common.pb import rollout_worker_pb2 as pb
from rlharvest.models.tiny_model import build_model
from rlharvest.models.tokenizer import CharTokenizer

from tests.worker_sessions import abort, add, deltas_of

from tests.fuzz_messages import fuzz_service, garbage_status

from .worker_client import WorkerSession, launch_worker, start_worker

pytestmark = pytest.mark.integration
TOK = CharTokenizer()
PROMPT = TOK.encode("12+7=")


@pytest.fixture(scope="module")
def worker(module_stack):
    """A long-lived worker for the tests that leave it healthy. Slowed (20 ms per engine step, an
    emulated slower GPU) so a long request is certainly still running when a test acts on it
    (an abort, a duplicate id, a look at the queue), however fast the machine."""
    return start_worker(module_stack, "shared-worker", "--max-running", "4",
                        "--max-message-bytes", str(2 * 1024 * 1024), "--step-delay-s", "0.02")


@pytest.fixture
async def session(worker):
    s = WorkerSession(worker.endpoint)
    yield s
    await s.close()


async def test_streams_batched_step_outputs_with_contiguous_positions(session):
    ids = [f"r{i}" for i in range(3)]
    await session.send(*(add(r, PROMPT, max_tokens=12, seed=i) for i, r in enumerate(ids)))
    got = await session.finish(ids)
    for r in ids:
        assert len(got.completions[r].tokens) == 12, r
        assert got.completions[r].finish_reason == "length"
        assert got.completions[r].versions == {0}
        assert all(lp <= 0 for lp in got.completions[r].logprobs)
    # One message per engine step carries every request's new tokens, not one per request.
    assert got.max_deltas_per_message == 3
    # ... and that step's own measurements: this session's requests are the whole batch here.
    for step in got.steps:
        assert step.stats.batch_size == len(deltas_of(step))
        assert step.stats.decode_tokens == sum(len(d.token_ids) for d in deltas_of(step))
        assert step.stats.duration_s > 0
    assert sum(step.stats.prefill_tokens for step in got.steps) == 3 * len(PROMPT)


async def test_same_seed_gives_same_completion_on_same_weights(session):
    await session.send(add("a", PROMPT, max_tokens=10, seed=7), add("b", PROMPT, max_tokens=10, seed=7),
                       add("c", PROMPT, max_tokens=10, seed=8))
    got = await session.finish(["a", "b", "c"])
    assert got.completions["a"].tokens == got.completions["b"].tokens
    assert got.completions["a"].tokens != got.completions["c"].tokens


async def test_abort_ends_a_running_request_with_reason_abort(session):
    await session.send(add("long", PROMPT, max_tokens=200))
    await session.read_until(lambda c: len(c.completions.get("long", None).tokens
                                            if "long" in c.completions else []) >= 3)
    await session.send(abort("long"))
    got = await session.finish(["long"])
    assert got.completions["long"].finish_reason == "abort"
    assert len(got.completions["long"].tokens) < 200


async def test_resumed_request_continues_exactly_as_uninterrupted(worker, module_stack):
    other = start_worker(module_stack, "resume-target", "--max-running", "4")
    first, second = WorkerSession(worker.endpoint), WorkerSession(other.endpoint)
    try:
        agree = 0
        seeds = range(8)
        for seed in seeds:
            rid = f"full-{seed}"
            await first.send(add(rid, PROMPT, max_tokens=24, seed=seed))
            full = (await first.finish([rid])).completions[rid].tokens
            cut = 5 + seed
            resumed_id = f"resumed-{seed}"
            second.collected.expect_resume(resumed_id, full[:cut])
            await second.send(add(resumed_id, PROMPT, max_tokens=24, seed=seed, generated=full[:cut]))
            resumed = (await second.finish([resumed_id])).completions[resumed_id]
            assert len(resumed.tokens) == 24 and resumed.finish_reason == "length"
            agree += resumed.tokens == full
        # Same weights, randomness keyed by (seed, position): the continuation must match.
        assert agree == len(seeds)
    finally:
        await first.close()
        await second.close()
        other.process.terminate()


async def test_concurrency_limit_queues_the_excess(session):
    ids = [f"q{i}" for i in range(7)]
    await session.send(*(add(r, PROMPT, max_tokens=60, seed=i) for i, r in enumerate(ids)))
    got = await session.read_until(
        lambda c: any(load.executing == 4 and load.pending == 3 for load in c.loads))
    assert max(load.executing for load in got.loads) <= 4
    await session.send(abort(*ids))
    await session.finish(ids)


async def test_every_bad_input_gets_a_precise_status_and_the_worker_keeps_serving(session):
    await session.send(
        add("ok", PROMPT, max_tokens=8),
        add("long", PROMPT, max_tokens=400),  # still running when its duplicate comes
        add("empty", [], max_tokens=8),
        add("vocab", [1, 100000], max_tokens=8),
        add("zero", PROMPT, max_tokens=0),
        add("version", PROMPT, max_tokens=8, version=42),
        add("", PROMPT, max_tokens=8),
        pb.WorkerCommand(),
        abort("never-added"),
    )
    await session.send(add("long", PROMPT, max_tokens=8))  # duplicate of a running id
    got = await session.finish(["ok", "empty", "vocab", "zero", "version", "never-added"])
    await session.read_until(lambda c: "long" in c.errors)
    errors = got.errors
    assert errors["empty"][0] == grpc.StatusCode.INVALID_ARGUMENT and "empty" in errors["empty"][1]
    assert errors["vocab"][0] == grpc.StatusCode.INVALID_ARGUMENT and "100000" in errors["vocab"][1]
    assert errors["zero"][0] == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in errors["zero"][1]
    assert errors["version"][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "42" in errors["version"][1]
    assert errors["never-added"][0] == grpc.StatusCode.NOT_FOUND
    assert errors["long"][0] == grpc.StatusCode.ALREADY_EXISTS
    assert errors[""][0] == grpc.StatusCode.INVALID_ARGUMENT
    await session.send(abort("long"))
    await session.read_until(lambda c: all(r in c.completions and c.completions[r].finish_reason
                                           for r in ("ok", "long")))
    assert got.completions["ok"].finish_reason == "length"
    assert len(got.completions["ok"].tokens) == 8
    assert got.completions["long"].finish_reason == "abort"


async def test_oversized_message_is_refused_and_other_sessions_go_on(worker):
    big = WorkerSession(worker.endpoint)
    try:
        await big.send(add("huge", [100] * 3_000_000, max_tokens=4))  # 3 MB > the 2 MiB limit
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await big.finish(["huge"], timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await big.close()
    fine = WorkerSession(worker.endpoint)
    try:
        await fine.send(add("after", PROMPT, max_tokens=4))
        assert (await fine.finish(["after"])).completions["after"].finish_reason == "length"
    finally:
        await fine.close()


async def test_health_metrics_and_info(worker, session):
    await session.send(add("m", PROMPT, max_tokens=4))
    await session.finish(["m"])
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics").read().decode())
    assert "rlh_worker_tokens_generated_total" in text
    health = json.loads(await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/healthz").read()))
    assert health["status"] == "ok" and health["weight_version"] == 0
    info = await session.stub.GetInfo(pb.GetInfoRequest())
    assert (info.worker_id, info.capacity, info.vocab_size) == ("shared-worker", 4, TOK.vocab_size)


async def test_registration_and_lease_expiry_after_sigkill(stack, etcd_client):
    handle = start_worker(stack, "doomed", "--kind", "spot")
    key = keys.member_key("rollout_worker", "doomed")
    info = (await registry.list_members(etcd_client, "rollout_worker"))[key]
    assert info["endpoint"] == handle.endpoint and info["kind"] == "spot"
    assert info["weight_version"] == 0 and info["capacity"] == 64
    handle.process.kill()
    killed = time.monotonic()
    while key in await registry.list_members(etcd_client, "rollout_worker"):
        # The bound is the claim (the 2 s lease TTL), plus 3 s for etcd's expiry sweep and a busy
        # machine: a lease that did not expire would outlive it by far.
        assert time.monotonic() - killed < 2 + 3, "member outlived its 2 s lease"
        await asyncio.sleep(0.1)


async def test_a_session_command_that_is_no_protobuf_gets_invalid_argument(worker, session):
    assert await garbage_status(worker.endpoint, "/rlharvest.v1.RolloutWorker/Session") == \
        grpc.StatusCode.INVALID_ARGUMENT
    await session.send(add("after-garbage", PROMPT, max_tokens=4))  # the worker still serves
    assert (await session.finish(["after-garbage"])).completions["after-garbage"].tokens


async def test_randomly_filled_requests_get_precise_statuses_and_the_worker_serves_on(
        worker, session):
    await fuzz_service(worker.endpoint, pb.DESCRIPTOR.services_by_name["RolloutWorker"],
                               rounds=10, timeout_s=0.3)
    await session.send(add("after-fuzz", PROMPT, max_tokens=4))
    assert (await session.finish(["after-fuzz"])).completions["after-fuzz"].tokens


async def test_a_worker_without_a_weights_dir_reads_no_file_an_rpc_names(session, tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"x")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await session.stub.LoadWeights(pb.LoadWeightsRequest(path=str(tmp_path / "w.safetensors"),
                                                              version=1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "weights_dir" in err.value.details()


async def test_weight_load_changes_outputs_and_reported_version(stack, etcd_client, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    handle = start_worker(stack, "loader", "--weights-dir", str(weights))
    session = WorkerSession(handle.endpoint)
    try:
        await session.send(add("before", PROMPT, max_tokens=16, temperature=0))
        before = (await session.finish(["before"])).completions["before"]
        model = build_model("tiny", seed=1)  # other weights: greedy output must change
        save_file({k: v.contiguous() for k, v in model.state_dict().items()
                   if k != "lm_head.weight"}, str(weights / "v5.safetensors"))
        # Only a name inside --weights-dir is read: outside it is refused before any read.
        for outside in (str(weights / "v5.safetensors"), "../v5.safetensors"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await session.stub.LoadWeights(pb.LoadWeightsRequest(path=outside, version=5))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, outside
        reply = await session.stub.LoadWeights(pb.LoadWeightsRequest(path="v5.safetensors",
                                                                      version=5))
        assert reply.weight_version == 5 and reply.tensors_loaded > 0
        await session.send(add("stale", PROMPT, max_tokens=4, version=0),
                           add("after", PROMPT, max_tokens=16, temperature=0, version=5))
        got = await session.finish(["stale", "after"])
        assert got.errors["stale"][0] == grpc.StatusCode.FAILED_PRECONDITION
        assert got.completions["after"].versions == {5}
        after = got.completions["after"]
        # Tied embeddings make a random tiny model's greedy tokens alike; its logprobs are not.
        assert (after.tokens, after.logprobs) != (before.tokens, before.logprobs)
        key = keys.member_key("rollout_worker", "loader")
        deadline = time.monotonic() + 30
        while (await registry.list_members(etcd_client))[key]["weight_version"] != 5:
            assert time.monotonic() < deadline, "the loaded version never reached etcd"
            await asyncio.sleep(0.1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await session.stub.LoadWeights(pb.LoadWeightsRequest(path="no", version=6))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        save_file({"model.nonexistent.weight": torch.zeros(2)}, str(weights / "bad.safetensors"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await session.stub.LoadWeights(pb.LoadWeightsRequest(path="bad.safetensors",
                                                                  version=7))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "nonexistent" in err.value.details()
        (weights / "garbage.safetensors").write_bytes(b"not a safetensors file")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await session.stub.LoadWeights(pb.LoadWeightsRequest(path="garbage.safetensors",
                                                                  version=8))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A hostile name (200 KB of short components: it froze the worker for ~9 s when it was
        # resolved on the event loop) is refused at once, with a refusal the caller can read.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await session.stub.LoadWeights(pb.LoadWeightsRequest(path="a/" * 100_000 + "x",
                                                                  version=9))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "over the 4096" in err.value.details() and len(err.value.details()) < 300
        assert (await session.stub.GetInfo(pb.GetInfoRequest())).weight_version == 5
    finally:
        await session.close()


async def test_sigterm_drains_then_exits_cleanly(stack, etcd_client):
    # Slowed so both requests are still running when the drain comes, however fast the machine.
    # The session stays open to the end, so the exit waits out the gRPC grace: 1 s, not 5.
    handle = start_worker(stack, "drainer", "--step-delay-s", "0.02", "--shutdown-grace", "1")
    session = WorkerSession(handle.endpoint)
    try:
        await session.send(add("d1", PROMPT, max_tokens=400), add("d2", PROMPT, max_tokens=400))
        await session.read_until(lambda c: "d1" in c.completions)
        handle.process.process.send_signal(signal.SIGTERM)
        await session.read_until(lambda c: c.draining, timeout=10)
        await session.send(add("late", PROMPT, max_tokens=4))
        await session.send(abort("d1", "d2"))  # what a manager does: migrate them away
        got = await session.finish(["d1", "d2", "late"])
        assert got.errors["late"][0] == grpc.StatusCode.UNAVAILABLE
        assert {got.completions[r].finish_reason for r in ("d1", "d2")} == {"abort"}
        code = await asyncio.to_thread(handle.process.process.wait, 30)
        assert code == 0, handle.process.log_tail()
        members = await registry.list_members(etcd_client, "rollout_worker")
        assert keys.member_key("rollout_worker", "drainer") not in members  # revoked, not expired
    finally:
        await session.close()


def test_malformed_config_exits_with_a_message_naming_the_key(tmp_path):
    cfg = tmp_path / "w.toml"
    cfg.write_text("max_runing = 3\n")
    run = subprocess.run([sys.executable, "-m", "rlharvest.services.rollout_worker.main",
                          "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "max_runing: unknown key" in run.stderr
    run = subprocess.run([sys.executable, "-m", "rlharvest.services.rollout_worker.main",
                          "--max-running", "-4"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "max_running" in run.stderr


async def test_limits_and_control_events_survive_a_backed_up_session(stack):
    """Running + pending is bounded (the excess is refused, not queued without end), and with a
    one-message session buffer that the client does not read, refusals and abort confirmations
    still all arrive, in order after the step outputs before them (the client's positions check
    fails on any reordering). The outbox's bound itself is unit-tested in test_worker_outbox."""
    handle = start_worker(stack, "bounded", "--max-running", "2", "--max-pending", "1",
                          "--session-queue", "1", "--step-delay-s", "0.01")
    session = WorkerSession(handle.endpoint)
    try:
        ids = ["b0", "b1", "b2"]
        await session.send(*(add(r, PROMPT, max_tokens=480, seed=i) for i, r in enumerate(ids)))
        await session.send(add("b3", PROMPT, max_tokens=4))  # beyond 2 running + 1 pending
        await asyncio.sleep(1.0)  # unread: the buffer fills and the engine waits on it
        bad = [f"ghost{i}" for i in range(5)]
        await session.send(abort(*bad), abort(*ids))
        got = await session.finish([*ids, "b3", *bad], timeout=60)
        assert got.errors["b3"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "pending" in got.errors["b3"][1]
        assert all(got.errors[r][0] == grpc.StatusCode.NOT_FOUND for r in bad)
        # gRPC's own flow-control window may absorb the unread steps, so a request can finish
        # before the abort lands; every one ends either way, with a final delta.
        assert {got.completions[r].finish_reason for r in ids} <= {"abort", "length"}
        assert "abort" in {got.completions[r].finish_reason for r in ids}
    finally:
        await session.close()


async def test_spot_notice_from_the_metadata_server_drains_the_worker(stack, etcd_client):
    from aiohttp import web

    notice = {"body": None}

    async def metadata(request: web.Request) -> web.Response:
        if notice["body"] is None:
            return web.Response(status=404)  # AWS: no reclaim scheduled
        return web.Response(text=notice["body"])

    app = web.Application()
    app.router.add_get("/latest/meta-data/spot/instance-action", metadata)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/latest/meta-data/spot/instance-action"
    # Slowed so the request is still running when the notice comes, however fast the machine;
    # the open session's gRPC grace at the exit shortened as above.
    handle = start_worker(stack, "spot-0", "--kind", "spot", "--preemption-notice-url", url,
                          "--preemption-poll-s", "0.1", "--step-delay-s", "0.02",
                          "--shutdown-grace", "1")
    session = WorkerSession(handle.endpoint)
    try:
        await session.send(add("s1", PROMPT, max_tokens=400))
        await session.read_until(lambda c: "s1" in c.completions)
        await asyncio.sleep(0.5)
        assert not session.collected.draining  # 404s are not a notice
        notice["body"] = '{"action": "terminate", "time": "2026-11-23T12:00:00Z"}'
        await session.read_until(lambda c: c.draining, timeout=10)
        member = (await registry.list_members(etcd_client, "rollout_worker"))[
            keys.member_key("rollout_worker", "spot-0")]
        assert member["draining"] is True
        await session.send(add("late", PROMPT, max_tokens=4), abort("s1"))
        got = await session.finish(["s1", "late"])
        assert got.errors["late"][0] == grpc.StatusCode.UNAVAILABLE
        assert got.completions["s1"].finish_reason == "abort"
        code = await asyncio.to_thread(handle.process.process.wait, 30)
        assert code == 0, handle.process.log_tail()
        assert "spot preemption notice" in handle.process.log_tail()
    finally:
        await session.close()
        await runner.cleanup()


async def test_a_second_signal_exits_at_once(stack):
    """An operator who does not want to wait for the drain sends SIGTERM again."""
    # Slowed so the request outlives the first signal whatever the machine's speed.
    impatient = start_worker(stack, "impatient", "--drain-timeout", "60", "--step-delay-s", "0.02")
    sessions = [WorkerSession(impatient.endpoint)]
    try:
        await sessions[0].send(add("long", PROMPT, max_tokens=480))
        await sessions[0].read_until(lambda c: "long" in c.completions)
        impatient.process.process.send_signal(signal.SIGTERM)
        await sessions[0].read_until(lambda c: c.draining, timeout=10)
        started = time.monotonic()
        impatient.process.process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(impatient.process.process.wait, 30)
        assert code == 128 + signal.SIGTERM and time.monotonic() - started < 10
        assert "second SIGTERM: exiting now" in impatient.process.log_tail()
    finally:
        for s in sessions:
            await s.close()


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler (its event loop's), from /proc."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def _opening_a_fifo(pid: int) -> bool:
    """Whether a thread of the process waits in open() for a FIFO's writer (its wchan)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/wchan") as f:
            if f.read() == "wait_for_partner":
                return True
    return False


async def test_a_sigterm_while_the_worker_loads_its_model_stops_it_at_once(
        stack, etcd_client, tmp_path):
    """The model loads off the event loop, so an operator's SIGTERM during a load that takes
    long (here forever: the checkpoint's config.json is a FIFO nobody writes) stops the worker
    at once, with the graceful exit code and no member record; a load on the loop held the
    signal until the load returned."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    os.mkfifo(checkpoint / "config.json")
    handle = launch_worker(stack, "loading", "--model", str(checkpoint))
    proc = handle.process.process
    deadline = time.monotonic() + 60
    while not _catches_sigterm(proc.pid):  # its event loop runs: startup, then the build
        assert proc.poll() is None and time.monotonic() < deadline, handle.process.log_tail()
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + 30  # a kernel that hides wchan: signal it anyway
    while not _opening_a_fifo(proc.pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.to_thread(proc.wait, 20)
    except subprocess.TimeoutExpired:
        pytest.fail("the worker did not stop within 20 s of SIGTERM while loading its model")
    assert code == 0, handle.process.log_tail()
    assert "stopped while it was being built" in handle.process.log_tail()
    assert keys.member_key("rollout_worker", "loading") not in await registry.list_members(
        etcd_client, "rollout_worker")


async def test_a_drain_nobody_answers_ends_at_the_drain_timeout(stack):
    # Slowed so the request is still running when the drain times out.
    handle = start_worker(stack, "unanswered", "--drain-timeout", "2", "--shutdown-grace", "1",
                          "--step-delay-s", "0.05")
    session = WorkerSession(handle.endpoint)
    try:
        await session.send(add("stuck", PROMPT, max_tokens=480))
        await session.read_until(lambda c: "stuck" in c.completions)
        started = time.monotonic()
        handle.process.process.send_signal(signal.SIGTERM)  # the client never migrates it
        code = await asyncio.to_thread(handle.process.process.wait, 60)
        elapsed = time.monotonic() - started
        assert code == 0 and 2 <= elapsed < 20, (code, elapsed)
        assert "drain timed out" in handle.process.log_tail()
    finally:
        await session.close()


async def test_a_worker_with_a_prefix_cache_prefills_only_what_a_next_turn_adds(module_stack):
    from tests.integration.test_manager import scrape

    handle = start_worker(module_stack, "prefix-worker", "--max-running", "4", "--kv-pages",
                          "64", "--page-tokens", "4", "--max-len", "256", "--prefix-cache")
    session = WorkerSession(handle.endpoint)
    try:
        first = TOK.encode("The answer is 12+7=")
        await session.send(add("turn0", first, max_tokens=10, seed=3))
        got = await session.finish(["turn0"])
        history = first + got.completions["turn0"].tokens + TOK.encode("\nWrong. Again:")
        steps_before = len(got.steps)
        await session.send(add("turn1", history, max_tokens=6, seed=4))
        got = await session.finish(["turn1"])
        prefilled = sum(step.stats.prefill_tokens for step in got.steps[steps_before:])
        # Turn 0's prompt + completion minus its last token hold KV; their full pages are read.
        cached = (len(first) + 10 - 1) // 4 * 4
        assert prefilled == len(history) - cached
        metrics = scrape(handle.metrics_port)
        assert metrics["rlh_worker_prefix_cache_hits_total"] == 1
        assert metrics["rlh_worker_prefix_cache_lookups_total"] == 2
        assert metrics["rlh_worker_prefix_cache_saved_tokens_total"] == cached
        assert metrics["rlh_worker_prefix_cache_pages"] > 0
    finally:
        await session.close()
        handle.process.terminate()
