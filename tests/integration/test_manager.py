"""The rollout manager with real worker processes: zero-loss migration when workers are
SIGKILLed, on-policy dispatch, graceful drain, precise statuses for bad steps, and RollPacker's
short round (a step with an acceptance rule ends at P0 accepted prompts and cancels the tail)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import grpc
import pytest

from rlharvest.common import delta_batch, keys, rpc
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.models.tokenizer import CharTokenizer
from rlharvest.services.rollout_manager.client import manager_status, wait_workers

from tests.fuzz_messages import fuzz_service, garbage_status

from .worker_client import WorkerHandle, launch_worker, wait_serving

pytestmark = pytest.mark.integration
TOK = CharTokenizer()
PROMPTS = [TOK.encode(f"{a}+{b}=") for a, b in [(1, 2), (13, 4), (7, 7), (20, 5), (3, 9), (11, 11)]]


def start_manager(stack, *extra: str) -> WorkerHandle:
    port, metrics_port = free_port(), free_port()
    proc = stack.start("rollout_manager", "manager", [
        "--port", str(port), "--metrics-port", str(metrics_port), "--stall-timeout-s", "5",
        "--lease-ttl", "2", *extra])
    handle = WorkerHandle(proc, f"127.0.0.1:{port}", metrics_port)
    wait_serving(handle, 60)
    return handle


def step_request(n: int, max_tokens: int, version: int = 0, prefix: str = "r") -> mpb.SubmitStepRequest:
    return mpb.SubmitStepRequest(step_id="s", weight_version=version, requests=[
        mpb.RolloutRequest(request_id=f"{prefix}{i}", group_id=f"g{i // 4}",
                           prompt_token_ids=PROMPTS[i % len(PROMPTS)],
                           sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                                              seed=1000 + i))
        for i in range(n)])


async def run_step(endpoint: str, request: mpb.SubmitStepRequest, on_event=None,
                   last_event: list | None = None):
    """Completions by id; asserts every streamed delta continues its request without gap.
    ``last_event``: the step's last event is appended to it."""
    completions: dict[str, mpb.Completion] = {}
    event = None
    streamed: dict[str, list[int]] = {}
    async with rpc.channel(endpoint) as chan:
        stub = rollout_manager_pb2_grpc.RolloutManagerStub(chan)
        async for event in stub.SubmitStep(request, timeout=180):
            for row in delta_batch.decode(event.batch).iter():
                rid = request.requests[row.request].request_id
                got = streamed.setdefault(rid, [])
                assert row.position == len(got), f"{rid}: gap/duplicate at {row.position}"
                got.extend(row.token_ids)
            for c in event.completions:
                assert c.request_id not in completions, "completed twice"
                completions[c.request_id] = c
            if on_event is not None:
                await on_event(completions, streamed)
    if last_event is not None:
        last_event.append(event)
    for rid, c in completions.items():
        if not c.failed:
            assert list(c.token_ids) == streamed.get(rid, []), "stream and completion disagree"
    return completions


def scrape(metrics_port: int) -> dict[str, float]:
    """The Prometheus text of a process: sample name with labels -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    samples = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def status(endpoint: str) -> mpb.ManagerStatus:
    st = await manager_status(endpoint)
    assert st is not None, f"the manager at {endpoint} did not answer GetStatus"
    return st


@pytest.fixture
def cluster(stack):
    # w0, the worker the kill tests SIGKILL, is slowed (50 ms per engine step, an emulated slower
    # GPU): it is the step's laggard, so it still holds requests when killed, even late in a step.
    workers = [launch_worker(stack, f"w{i}", "--max-running", "4",
                             *(("--step-delay-s", "0.05") if i == 0 else ()))
               for i in range(3)]
    # The paper's migration rule: it moves no request of a worker at or under its plateau, so
    # w0 keeps its own to the end. The cost-aware default would move them to the fast idle
    # workers as the others run dry (what it is for), leaving a late kill nothing to recover.
    manager = start_manager(stack, "--migration-rule", "paper")  # starts while workers import
    for worker in workers:
        wait_serving(worker, 120)
    return workers, manager


async def test_step_completes_on_the_step_version(cluster):
    workers, manager = cluster
    await wait_workers(manager.endpoint, 3)
    done = await run_step(manager.endpoint, step_request(12, 20))
    assert len(done) == 12
    for c in done.values():
        assert not c.failed and len(c.token_ids) == 20 and c.weight_version == 0
    st = await status(manager.endpoint)
    assert st.tokens_regenerated == 0 and st.in_flight == 0
    assert sum(w.assigned for w in st.workers) == 0

    # The single-request streaming call: same request, same seed -> the same tokens.
    async with rpc.channel(manager.endpoint) as chan:
        single = step_request(1, 20, prefix="g").requests[0]
        events = [e async for e in rollout_manager_pb2_grpc.RolloutManagerStub(chan).Generate(
            mpb.GenerateRequest(request=single, weight_version=0), timeout=60)]
    [completion] = [c for e in events for c in e.completions]
    assert list(completion.token_ids) == list(done["r0"].token_ids)
    streamed = [t for e in events for t in delta_batch.decode(e.batch).token_ids.tolist()]
    assert streamed == list(completion.token_ids)

    samples = scrape(manager.metrics_port)
    assert samples["rlh_manager_tokens_total"] == 13 * 20
    assert samples["rlh_manager_in_flight_requests"] == 0
    assert samples['rlh_manager_workers{state="healthy"}'] == 3
    assert samples['rlh_manager_completions_total{outcome="finished"}'] == 13
    assert all(samples[f'rlh_manager_pending_requests{{worker="w{i}"}}'] == 0 for i in range(3))


# Early, middle and late in a step of 12 x 48 = 576 tokens.
@pytest.mark.parametrize("kill_after_tokens", [20, 288, 480])
async def test_sigkilled_worker_loses_no_token(cluster, kill_after_tokens):
    workers, manager = cluster
    await wait_workers(manager.endpoint, 3)
    reference = await run_step(manager.endpoint, step_request(12, 48, prefix="ref"))
    killed = []

    async def maybe_kill(completions, streamed):
        if not killed and sum(map(len, streamed.values())) >= kill_after_tokens:
            workers[0].process.kill()  # SIGKILL mid-step
            killed.append(True)

    done = await run_step(manager.endpoint, step_request(12, 48, prefix="k"), maybe_kill)
    assert killed
    assert len(done) == 12 and not any(c.failed for c in done.values())
    for i in range(12):
        # Seeded sampling keyed by (seed, position): the killed run equals the clean one.
        assert list(done[f"k{i}"].token_ids) == list(reference[f"ref{i}"].token_ids), i
        assert done[f"k{i}"].weight_version == 0
    st = await status(manager.endpoint)
    assert st.tokens_regenerated == 0
    # The kill moved requests (those it held), so the step above did survive a loss.
    assert scrape(manager.metrics_port).get('rlh_manager_migrations_total{cause="lost"}', 0) >= 1


async def test_graceful_drain_moves_requests_before_exit(stack):
    # The drained worker is slowed (an emulated slower GPU) so its requests are still running
    # when the drain notice arrives: on a fast CPU they could otherwise finish first. Drained,
    # it exits once the manager's session to it ends, after the gRPC grace: 1 s, not 5.
    workers = [launch_worker(stack, "d0", "--max-running", "4"),
               launch_worker(stack, "d1", "--max-running", "4", "--step-delay-s", "0.02",
                             "--shutdown-grace", "1"),
               launch_worker(stack, "d2", "--max-running", "4")]
    # The paper's migration rule: the cost-aware one (the default) moves a slow worker's
    # requests to the idle ones as they run dry, so the drain could find none left to move.
    manager = start_manager(stack, "--migration-rule", "paper")
    for worker in workers:
        wait_serving(worker, 120)
    await wait_workers(manager.endpoint, 3)
    drained = []

    async def drain_one(completions, streamed):
        if not drained and sum(map(len, streamed.values())) >= 30:
            workers[1].process.process.send_signal(signal.SIGTERM)
            drained.append(True)

    done = await run_step(manager.endpoint, step_request(12, 100), drain_one)
    assert drained and len(done) == 12 and not any(c.failed for c in done.values())
    code = await asyncio.to_thread(workers[1].process.process.wait, 30)
    assert code == 0, workers[1].process.log_tail()
    # Moved by the drain (not found dead after the exit), and none left behind on the worker.
    assert "stopped (drained)" in workers[1].process.log_tail()
    samples = scrape(manager.metrics_port)
    assert samples['rlh_manager_migrations_total{cause="drain"}'] >= 1
    assert samples.get('rlh_manager_migrations_total{cause="lost"}', 0) == 0
    st = await status(manager.endpoint)
    assert st.tokens_regenerated == 0


async def test_bad_steps_get_precise_statuses(cluster):
    _, manager = cluster
    await wait_workers(manager.endpoint, 3)
    cases = [
        (mpb.SubmitStepRequest(weight_version=0), grpc.StatusCode.INVALID_ARGUMENT, "no requests"),
        (step_request(2, 8, version=9), grpc.StatusCode.FAILED_PRECONDITION, "version 9 is unknown"),
        (step_request(2, 8, version=-1), grpc.StatusCode.INVALID_ARGUMENT, "negative"),
        (mpb.SubmitStepRequest(weight_version=0, requests=[step_request(1, 8).requests[0]] * 2),
         grpc.StatusCode.INVALID_ARGUMENT, "appears twice"),
        (step_request(70000, 8), grpc.StatusCode.INVALID_ARGUMENT, "above the limit"),
        (mpb.SubmitStepRequest(weight_version=0, requests=step_request(1, 8).requests,
                               seed_window_s=float("nan")),
         grpc.StatusCode.INVALID_ARGUMENT, "seeding window must be a finite"),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run_step(manager.endpoint, request)
        assert err.value.code() == code, err.value.details()
        assert text in err.value.details()
    async with rpc.channel(manager.endpoint) as chan:  # the same check holds a window
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rollout_manager_pb2_grpc.RolloutManagerStub(chan).HoldSeedWindow(
                iter([mpb.SeedWindowRequest(step_id="s", window_s=-1)])).read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "seeding window must be a finite" in err.value.details()
    # Bytes that are no protobuf: INVALID_ARGUMENT from the real servicer, not grpc's UNKNOWN.
    assert await garbage_status(manager.endpoint, "/rlharvest.v1.RolloutManager/SubmitStep") == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert await garbage_status(manager.endpoint, "/rlharvest.v1.RolloutManager/GetStatus") == \
        grpc.StatusCode.INVALID_ARGUMENT
    # Randomly filled requests (huge, negative, NaN values, long strings, long lists) to every
    # method: each gets a precise status, none grpc's UNKNOWN or INTERNAL.
    await fuzz_service(manager.endpoint, mpb.DESCRIPTOR.services_by_name[
        "RolloutManager"], rounds=15)
    done = await run_step(manager.endpoint, step_request(3, 8))  # still serving
    assert len(done) == 3


async def test_no_worker_for_the_version_fails_after_the_deadline(stack, etcd_client):
    manager = start_manager(stack, "--no-worker-timeout-s", "600")
    await etcd_client.put(keys.weights_announced_key("default").encode(), b'{"version": 3}')
    request = step_request(2, 8, version=3)
    request.no_worker_deadline_s = 1  # the client's own deadline wins over the manager's 600 s
    started = time.monotonic()
    done = await run_step(manager.endpoint, request)
    assert time.monotonic() - started < 30
    assert all(c.failed and "no healthy worker held weight version 3" in c.finish_reason
               for c in done.values())
    request.no_worker_deadline_s = -1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run_step(manager.endpoint, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_the_instance_cap_in_etcd_holds_later_spot_workers_as_standby(stack, etcd_client):
    """N_prem written for the job: spot workers beyond it (latest joined) stand by and take no
    request of a step; the step still completes on the active ones; lifting it frees them."""
    manager = start_manager(stack)
    spots = []
    for i in range(3):  # one by one, so the join order is known
        spots.append(launch_worker(stack, f"spot{i}", "--kind", "spot", "--max-running", "4"))
        wait_serving(spots[-1], 120)
        await wait_workers(manager.endpoint, i + 1)
    await etcd_client.put(keys.instance_cap_key("default").encode(), b'{"n_prem": 1}')
    deadline = time.monotonic() + 30
    while {w.worker_id for w in (await status(manager.endpoint)).workers
           if w.state == "standby"} != {"spot1", "spot2"}:
        assert time.monotonic() < deadline, await status(manager.endpoint)
        await asyncio.sleep(0.1)
    assert scrape(manager.metrics_port)["rlh_manager_instance_cap"] == 1
    last: list = []
    completions = await run_step(manager.endpoint, step_request(8, max_tokens=6), None, last)
    assert len(completions) == 8 and not any(c.failed for c in completions.values())
    # Who took requests, from each worker's own count (a status poll during the step could
    # miss a short step's assignments on a busy box).
    seen = {f"spot{i}": scrape(w.metrics_port).get(
        'rlh_worker_requests_added_total{resumed="false"}', 0.0) for i, w in enumerate(spots)}
    assert seen["spot0"] > 0 and seen["spot1"] == seen["spot2"] == 0, seen
    # Algorithm 1's remote inputs ride on the step's last event: one active instance worked.
    remote = last[0].remote
    assert remote.instances == 1 and remote.n_prem_next == 1, remote
    assert remote.n_available_next == 3, remote  # the standby workers could be used
    assert remote.n_prem_mean == pytest.approx(1.0) and remote.t_remote > 0, remote
    assert (await status(manager.endpoint)).last_step_remote == remote
    assert scrape(manager.metrics_port)['rlh_manager_step_remote_instances{at="next"}'] == 1
    assert scrape(manager.metrics_port).get('rlh_manager_migrations_total{cause="lost"}', 0) == 0
    await etcd_client.delete(keys.instance_cap_key("default").encode())
    deadline = time.monotonic() + 30
    while any(w.state == "standby" for w in (await status(manager.endpoint)).workers):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def test_a_sigkilled_worker_leaves_the_status_and_the_metrics_after_the_forget_grace(
        stack):
    manager = start_manager(stack, "--forget-lost-after-s", "1")
    worker = launch_worker(stack, "spot-1", "--kind", "spot", "--max-running", "4")
    wait_serving(worker, 120)
    await wait_workers(manager.endpoint, 1)
    assert 'rlh_manager_assigned_requests{worker="spot-1"}' in scrape(manager.metrics_port)
    worker.process.kill()
    deadline = time.monotonic() + 30
    while (await status(manager.endpoint)).workers:  # lost, then forgotten a second later
        assert time.monotonic() < deadline, await status(manager.endpoint)
        await asyncio.sleep(0.2)
    assert not [k for k in scrape(manager.metrics_port) if 'worker="spot-1"' in k]


# ---- RollPacker's short round (tail batching): the acceptance rule on the real stack ----------

def short_round(lengths: dict[str, int], responses: int, p0: int, r0: int) -> mpb.SubmitStepRequest:
    requests = [mpb.RolloutRequest(
        request_id=f"{gid}-{r}", group_id=gid, prompt_token_ids=PROMPTS[i % len(PROMPTS)],
        sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=length, seed=10 * i + r))
        for i, (gid, length) in enumerate(lengths.items()) for r in range(responses)]
    return mpb.SubmitStepRequest(step_id="short", weight_version=0, requests=requests,
                                 acceptance=mpb.Acceptance(prompts=p0, responses=r0))


async def test_a_short_round_ends_at_p0_accepted_prompts_and_cancels_the_tail(cluster):
    _, manager = cluster
    await wait_workers(manager.endpoint, 3)
    lengths = {"quick0": 6, "quick1": 6, "slow0": 200, "slow1": 200}  # a long tail
    completions: dict[str, mpb.Completion] = {}
    verdicts: list[mpb.GroupVerdict] = []
    async with rpc.channel(manager.endpoint) as chan:
        stub = rollout_manager_pb2_grpc.RolloutManagerStub(chan)
        async for event in stub.SubmitStep(short_round(lengths, 3, p0=2, r0=2), timeout=120):
            completions.update({c.request_id: c for c in event.completions})
            verdicts.extend(event.verdicts)
    assert len(completions) == 12  # every request ends in exactly one completion
    assert sorted(v.group_id for v in verdicts) == sorted(lengths)  # one verdict per group
    accepted = {v.group_id for v in verdicts if v.accepted}
    assert accepted == {"quick0", "quick1"}
    for gid in accepted:  # at least R0 finished responses each, with all their tokens
        done = [c for c in completions.values() if c.group_id == gid and not c.failed]
        assert len(done) >= 2 and all(len(c.token_ids) == 6 for c in done)
    cancelled = [c for c in completions.values() if c.cancelled]
    assert {c.group_id for c in cancelled} >= {"slow0", "slow1"}
    assert all(c.failed and not c.token_ids for c in cancelled)  # nothing of them to train
    st = await status(manager.endpoint)
    assert st.in_flight == 0 and sum(w.assigned for w in st.workers) == 0
    metrics = scrape(manager.metrics_port)
    assert metrics['rlh_manager_completions_total{outcome="cancelled"}'] == len(cancelled)
    assert metrics["rlh_manager_tokens_discarded_total"] > 0  # the tail had started


async def test_a_rule_the_step_cannot_meet_is_refused_with_invalid_argument(cluster):
    _, manager = cluster
    await wait_workers(manager.endpoint, 3)
    async with rpc.channel(manager.endpoint) as chan:
        stub = rollout_manager_pb2_grpc.RolloutManagerStub(chan)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.SubmitStep(short_round({"a": 4, "b": 4}, 2, p0=3, r0=1),
                                           timeout=30):
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fewer than the 3 it must accept" in refused.value.details()


# ---- RollPacker's TP planner (--tp-planner): advisory, published in etcd ------------------------

async def test_the_tp_planner_publishes_a_plan_from_the_workers_preemptions(stack, etcd_client):
    """A worker whose KV budget holds one request preempts; the manager counts the increase of
    its reported total per step, feeds the planner (steps without an acceptance rule are long
    rounds) and writes the plan to etcd: a rise of over 1.05x doubles the long rounds' TP. A
    restarted manager resumes the planner from the record."""
    from rlharvest.cli.main import _tp_plan

    # Slowed so a step's requests run side by side however late the second add arrives on a
    # loaded machine (unslowed, the first could end its 30 tokens alone: no preemption).
    worker = launch_worker(stack, "w0", "--max-len", "64", "--kv-budget-tokens", "64",
                           "--max-running", "8", "--step-delay-s", "0.01")
    manager = start_manager(stack, "--tp-planner", "--theta", "8")
    wait_serving(worker, 120)
    await wait_workers(manager.endpoint, 1)
    key = keys.tp_plan_key("default").encode()

    async def plan_after(steps: int) -> dict:
        deadline = time.monotonic() + 10  # written in the background, after the step's end
        while True:
            found = await etcd_client.get(key)
            if found is not None and json.loads(found.value)["steps"] >= steps:
                return json.loads(found.value)
            assert time.monotonic() < deadline, found
            await asyncio.sleep(0.05)

    def worker_preemptions() -> float:
        return scrape(worker.metrics_port).get("rlh_worker_preemptions_total", 0.0)

    done = await run_step(manager.endpoint, step_request(2, 30, prefix="a"))  # 2 x 34 > 64
    assert not any(c.failed for c in done.values())
    p1 = worker_preemptions()
    first = await plan_after(1)
    lengths = {rid: len(c.token_ids) for rid, c in done.items()}
    assert p1 > 0 and first["last_step"]["preemptions"] == p1, (p1, lengths, first)
    assert (first["short_tp"], first["long_tp"]) == (1, 1)  # the first step sets the baseline
    assert first["last_step"]["kind"] == "long" and first["last_step"]["responses"] == 2

    done = await run_step(manager.endpoint, step_request(8, 48, prefix="b"))
    assert not any(c.failed for c in done.values())
    p2 = worker_preemptions() - p1
    assert p2 > 1.05 * p1, (p1, p2)  # the setup's claim: more requests, more pressure
    second = await plan_after(2)
    assert second["last_step"]["preemptions"] == p2
    assert (second["short_tp"], second["long_tp"]) == (1, 2), second
    samples = scrape(manager.metrics_port)
    assert samples["rlh_manager_preemptions_total"] == p1 + p2
    assert samples['rlh_manager_tp_plan{kind="long"}'] == 2
    assert samples['rlh_manager_tp_plan{kind="short"}'] == 1
    assert await _tp_plan(etcd_client, "default") == "short 1 / long 2"  # `rlharvest status`

    manager.process.kill()  # a new manager resumes the planner from the record
    manager = start_manager(stack, "--tp-planner", "--manager-id", "manager-1")
    await wait_workers(manager.endpoint, 1)
    assert scrape(manager.metrics_port)['rlh_manager_tp_plan{kind="long"}'] == 2
    await run_step(manager.endpoint, step_request(1, 8, prefix="c"))  # no pressure
    third = await plan_after(3)
    assert third["last_step"]["preemptions"] == 0 and third["long_tp"] == 2, third


# ---- RollPacker's stream-trainer scaling (--stream-scaling): workers lent to training ----------

def long_tail_step(step_id: str, prefix: str, short: int = 4,
                   long: int = 120) -> mpb.SubmitStepRequest:
    """16 requests: 4 long ones first (they spread over the workers and start at once), then 12
    of ``short`` tokens. Without a stop token each one runs to its max_tokens."""
    return mpb.SubmitStepRequest(step_id=step_id, weight_version=0, requests=[
        mpb.RolloutRequest(request_id=f"{prefix}{i}", group_id=f"g{i // 4}",
                           prompt_token_ids=PROMPTS[i % len(PROMPTS)],
                           sampling=common_pb2.SamplingParams(
                               temperature=1.0, max_tokens=long if i < 4 else short,
                               seed=2000 + i))
        for i in range(16)])


async def test_stream_scaling_lends_half_the_workers_to_training_for_the_rest_of_the_step(
        stack, etcd_client):
    """Two slot workers of 4 x 512 KV tokens each. The manager's first step predicts every
    remaining request at the step's max_tokens (no history): at 20% (4 shorts done) the 12 left
    need at most 12 x (prompt + 120) < 2048 tokens, the kept worker's KV (headroom 0), so the
    less loaded worker is lent to training: its requests move with their tokens, it holds
    nothing until the step ends, and the next step runs on it again."""
    workers = [launch_worker(stack, f"w{i}", "--max-running", "4", "--step-delay-s", "0.03")
               for i in range(2)]
    manager = start_manager(stack, "--stream-scaling", "--stream-scaling-headroom", "0")
    for worker in workers:
        wait_serving(worker, 120)
    await wait_workers(manager.endpoint, 2)
    key = keys.stream_scale_key("default").encode()
    seen_lent: set[str] = set()
    assigned: dict[str, int] = {}

    async def watch(completions, streamed) -> None:
        for w in (await status(manager.endpoint)).workers:
            if w.state == "training":
                seen_lent.add(w.worker_id)
                assert w.assigned == 0, w  # lent: holds nothing, takes nothing
            assigned[w.worker_id] = max(assigned.get(w.worker_id, 0), w.assigned)

    request = long_tail_step("one", "a")
    done = await run_step(manager.endpoint, request, watch)
    assert len(done) == 16  # each exactly once (run_step), with every token
    for r in request.requests:
        c = done[r.request_id]
        assert not c.failed and len(c.token_ids) == r.sampling.max_tokens, c
    assert len(seen_lent) == 1, seen_lent  # floor(2 / 2)
    [lent] = seen_lent
    deadline = time.monotonic() + 10  # written in the background
    while True:
        found = await etcd_client.get(key)
        record = None if found is None else json.loads(found.value)
        if record is not None and record["state"] == "returned":
            break
        assert time.monotonic() < deadline, record
        await asyncio.sleep(0.05)
    assert record["step_id"] == "one" and record["drained"] == [lent], record
    assert record["kept"] == [w for w in ("w0", "w1") if w != lent], record
    assert 20 <= record["milestone_percent"] <= 50 and record["usable_tokens"] == 2048, record
    assert record["projected_peak_tokens"] <= record["usable_tokens"], record
    st = await status(manager.endpoint)
    assert st.tokens_regenerated == 0 and st.in_flight == 0
    assert all(w.state == "healthy" and w.assigned == 0 for w in st.workers), st.workers
    samples = scrape(manager.metrics_port)
    assert samples["rlh_manager_stream_scale_downs_total"] == 1
    assert samples['rlh_manager_migrations_total{cause="scale_down"}'] >= 1  # it held some
    assert samples["rlh_manager_workers_lent_to_training"] == 0
    assert samples.get('rlh_manager_migrations_total{cause="lost"}', 0) == 0

    assigned.clear()
    done = await run_step(manager.endpoint, long_tail_step("two", "b"), watch)
    assert len(done) == 16 and not any(c.failed for c in done.values())
    assert assigned[lent] > 0, assigned  # back in service for the next step
    assert (await status(manager.endpoint)).tokens_regenerated == 0
