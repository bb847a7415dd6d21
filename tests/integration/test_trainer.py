"""The trainer on the real local stack (etcd, transfer agent, rollout manager, rollout workers,
trainer: all processes): GRPO learns on-policy while a spot worker is SIGKILLed mid-step, and a
SIGKILLed trainer resumes from its last checkpoint with the workers converging to its version."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch

from rlharvest.common import keys, registry, rpc
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import trainer_pb2 as tpb, trainer_pb2_grpc
from rlharvest.services.trainer import checkpoint
from rlharvest.services.trainer.load_model import LengthModel
from rlharvest.services.rollout_manager.client import wait_workers
from rlharvest.services.trainer.step_plan import resume_version

from .test_manager import status as manager_status
from .worker_client import WorkerHandle, wait_serving

pytestmark = pytest.mark.integration
COMMON = ["--lease-ttl", "2", "--json-logs"]


async def start_job(stack, workers: int, *worker_flags: str, spot: bool = False,
                    spot_flags: tuple[str, ...] | None = None,
                    manager_flags: tuple[str, ...] = ()) -> WorkerHandle:
    """A transfer agent, the job's manager and its workers (the last one spot when asked, started
    with ``spot_flags`` instead of ``worker_flags`` when given), once the manager sees every
    worker."""
    stack.start("transfer_agent", "agent", ["--agent-id", "agent-0", *COMMON])
    port, metrics_port = free_port(), free_port()
    manager = WorkerHandle(stack.start("rollout_manager", "manager", [
        "--port", str(port), "--metrics-port", str(metrics_port), "--stall-timeout-s", "5",
        *COMMON, *manager_flags]), f"127.0.0.1:{port}", metrics_port)
    for i in range(workers):
        is_spot = spot and i == workers - 1
        flags = spot_flags if is_spot and spot_flags is not None else worker_flags
        start_worker(stack, f"w{i}", is_spot, *flags)
    await wait_workers(manager.endpoint, workers, timeout=120)
    return manager


def start_worker(stack, name: str, spot: bool, *flags: str):
    return stack.start("rollout_worker", name, [
        "--worker-id", name, "--kind", "spot" if spot else "dedicated", "--torch-threads", "1",
        "--job", "default", "--agent-pull", *COMMON, *flags])


async def start_trainer(stack, name: str, *flags: str, ranks: int = 1,
                        restarts: int = 0) -> tuple[WorkerHandle, int]:
    """Start a trainer (``ranks`` > 1: under torchrun) and wait until it serves status. The wait
    runs off the event loop: a watcher task the test started keeps running while the trainer
    takes its first steps."""
    port, metrics_port = free_port(), free_port()
    proc = stack.start("trainer", name, [
        "--trainer-id", "trainer-0", "--port", str(port), "--metrics-port", str(metrics_port),
        "--torch-threads", "1", "--no-exit-when-done", *COMMON, *flags], ranks=ranks,
        restarts=restarts)
    handle = WorkerHandle(proc, f"127.0.0.1:{port}", metrics_port)
    await asyncio.to_thread(wait_serving, handle, 120)
    return handle, metrics_port


async def trainer_status(endpoint: str, last_steps: int = 0) -> tpb.TrainerStatus:
    async with rpc.channel(endpoint) as chan:
        return await trainer_pb2_grpc.TrainerStub(chan).GetStatus(
            tpb.TrainerStatusRequest(last_steps=last_steps), timeout=5)


async def wait_trainer(trainer: WorkerHandle, until, timeout: float = 240,
                       on_status=None) -> tpb.TrainerStatus:
    deadline = time.monotonic() + timeout
    while True:
        assert trainer.process.alive(), "trainer exited:\n" + trainer.process.log_tail()
        st = await trainer_status(trainer.endpoint)
        assert st.state != "failed", st.error
        if on_status is not None:
            await on_status(st)
        if until(st):
            return st
        assert time.monotonic() < deadline, f"trainer stuck at {st}"
        await asyncio.sleep(0.05)


def scrape(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def metric(text: str, series: str) -> float:
    """The value of one series (name plus labels, as exposed); 0 when it was never touched."""
    for line in text.splitlines():
        if line.rsplit(" ", 1)[0] == series:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def worker_versions(etcd_client) -> dict[str, int]:
    members = await registry.list_members(etcd_client, "rollout_worker")
    return {k.rsplit("/", 1)[-1]: int(v["weight_version"]) for k, v in members.items()}


async def preempt_once_it_holds_requests(stack, manager: WorkerHandle, victim: str,
                                         replacement: str, *flags: str) -> int:
    """SIGKILL ``victim`` as soon as the manager shows it holding requests, then start a new spot
    process, which joins mid-run. Returns how many requests the victim held."""
    while True:
        held = next((w.assigned for w in (await manager_status(manager.endpoint)).workers
                     if w.worker_id == victim and w.state == "healthy"), 0)
        if held:
            next(p for p in stack.processes if p.name == victim).kill()
            start_worker(stack, replacement, True, *flags)
            return held
        await asyncio.sleep(0.05)


async def test_grpo_learns_on_policy_while_a_spot_worker_is_preempted(stack, etcd_client):
    steps = 8
    slow = ["--max-running", "8", "--step-delay-s", "0.05"]  # steps spread over all workers
    # The spot worker is slower still, 2 s per engine step, so requests stay on it for seconds
    # (4 tokens each; before the first step ends there is no batching profile by which to
    # migrate executing requests). JSQ gives every healthy worker a share of step 1, and the
    # watcher runs before the trainer starts: it certainly finds the spot worker holding
    # requests and kills it mid-request, however fast or loaded the machine.
    spot = ("--max-running", "8", "--step-delay-s", "2")
    manager = await start_job(stack, 3, *slow, spot=True, spot_flags=spot)
    preempted = asyncio.create_task(
        preempt_once_it_holds_requests(stack, manager, "w2", "w3", *slow))
    try:
        trainer, metrics_port = await start_trainer(stack, "trainer", "--steps", str(steps),
                                                    "--backend", "deepspeed")
        st = await wait_trainer(trainer, lambda s: s.state == "done")
        assert preempted.done(), "the spot worker never held a request: JSQ skipped a worker"
    finally:
        preempted.cancel()
    assert preempted.result() > 0
    assert [s.step for s in st.steps] == list(range(1, steps + 1))
    for s in st.steps:
        # On-policy: step n is generated by the version step n-1 produced, and yields n.
        assert s.weight_version == s.step - 1 and s.published_version == s.step, s
        # Groups ready together merge: at most ceil(8 groups / m_b 2) micro-batches.
        assert s.tokens > 0 and 1 <= s.micro_batches <= 4, s
    # Each publish measured what changed (fp32 at this lr: nearly everything) before the next
    # step began; the first version is all new.
    assert st.steps[0].published_changed == 1.0
    assert all(0.5 < s.published_changed <= 1.0 for s in st.steps[:-1]), st.steps
    manager_metrics = scrape(manager.metrics_port)
    assert metric(manager_metrics, 'rlh_manager_migrations_total{cause="lost"}') > 0, \
        "the kill moved no request"
    text = scrape(metrics_port)
    # A step that saw one delta of another version (or lost a completion) is refused and retried.
    assert metric(text, 'rlh_trainer_steps_total{outcome="retried"}') == 0
    assert metric(text, 'rlh_trainer_steps_total{outcome="applied"}') == steps
    assert (await manager_status(manager.endpoint)).tokens_regenerated == 0
    rewards = [s.mean_reward for s in st.steps]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    # The replacement pulled the newest version and holds what the trainer holds.
    deadline = time.monotonic() + 60
    while (await worker_versions(etcd_client)).get("w3") != st.weight_version:
        assert time.monotonic() < deadline, await worker_versions(etcd_client)
        await asyncio.sleep(0.2)


async def test_the_trainer_writes_n_prem_from_each_steps_timings_and_the_manager_applies_it(
        stack, etcd_client):
    """RLBoost Algorithm 1's cap, end to end: the manager measures the remote instances' side
    of a step, the trainer its own, writes N_prem (clamped to the 2 spot workers available)
    to etcd, and the manager holds spot workers beyond it as standby."""
    manager = await start_job(stack, 2, spot=True)  # w0 dedicated, w1 spot
    start_worker(stack, "w2", True)
    await wait_workers(manager.endpoint, 3, timeout=120)
    trainer, _ = await start_trainer(stack, "trainer", "--instance-cap", "auto", "--steps", "3")
    await wait_trainer(trainer, lambda s: s.state == "done")
    cap = json.loads((await etcd_client.get(keys.instance_cap_key("default").encode())).value)
    assert 1 <= cap["n_prem"] <= 2, cap
    assert "instance cap N_prem=" in trainer.process.log_path.read_text()
    deadline = time.monotonic() + 30
    while metric(scrape(manager.metrics_port), "rlh_manager_instance_cap") != cap["n_prem"]:
        assert time.monotonic() < deadline, "the manager did not apply the trainer's cap"
        await asyncio.sleep(0.2)
    standby = [w for w in (await manager_status(manager.endpoint)).workers if w.state == "standby"]
    assert len(standby) == 2 - cap["n_prem"], standby


async def test_sigkilled_trainer_resumes_from_its_last_checkpoint(stack, etcd_client, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--backend", "torch"]
    await start_job(stack, 2)
    trainer, _ = await start_trainer(stack, "trainer", "--steps", "0", *flags)
    await wait_trainer(trainer, lambda s: s.steps_done >= 3)
    trainer.process.kill()  # SIGKILL: no goodbye checkpoint
    saved = checkpoint.list_checkpoints(ckpt)
    assert saved, "no checkpoint written before the kill"
    state = torch.load(saved[-1] / "state.pt", weights_only=False)["state"]
    assert state["step"] % 2 == 0 and state["step"] >= 2
    announced = await registry.get_versioned(etcd_client, keys.weights_announced_key("default"))
    # The publish the trainer finished sending just before the kill may still be announced after
    # this read (publishes go one at a time): the resumed trainer sees this version or the next.
    may_see = {resume_version(state["weight_version"], announced["version"] + late)[0]
               for late in (0, 1)}

    target = state["step"] + 3
    again, _ = await start_trainer(stack, "trainer-again", "--steps", str(target), *flags)
    st = await wait_trainer(again, lambda s: s.state == "done")
    assert st.resumed_from_step == state["step"]
    assert [s.step for s in st.steps] == list(range(state["step"] + 1, target + 1))
    first = st.steps[0].weight_version
    assert first in may_see, (first, may_see)  # never an old number workers passed
    assert st.weight_version == first + 3
    deadline = time.monotonic() + 60
    while set((await worker_versions(etcd_client)).values()) != {st.weight_version}:
        assert time.monotonic() < deadline, await worker_versions(etcd_client)
        await asyncio.sleep(0.2)

    with pytest.raises(grpc.aio.AioRpcError) as err:  # bad input: a precise status, still serving
        await trainer_status(again.endpoint, last_steps=-1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "last_steps -1 is negative" in err.value.details()
    assert len((await trainer_status(again.endpoint, last_steps=2)).steps) == 2


async def test_a_trainer_whose_training_fails_saves_the_steps_applied_since_its_checkpoint(
        stack, etcd_client, tmp_path):
    """Training fails (its manager is gone, no successor came, and the step's one attempt went
    with it) between two checkpoints: the steps it applied since the last one are saved before
    it exits, so its restart resumes from them (their versions were published already)."""
    ckpt = tmp_path / "ckpt"
    manager = await start_job(stack, 1)
    trainer, _ = await start_trainer(
        stack, "trainer", "--steps", "0", "--backend", "torch", "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", "1000", "--step-attempts", "1", "--resume-wait-s", "1")
    done = (await wait_trainer(trainer, lambda s: s.steps_done >= 2)).steps_done
    manager.process.kill()
    exit_code = await asyncio.to_thread(trainer.process.process.wait, 120)
    assert exit_code != 0, trainer.process.log_tail()
    saved = checkpoint.list_checkpoints(ckpt)
    assert saved, trainer.process.log_tail()
    state = torch.load(saved[-1] / "state.pt", weights_only=False)["state"]
    assert state["step"] >= done, (state["step"], done)  # none of the applied steps lost


def test_bad_config_is_refused_with_the_key_named():
    result = subprocess.run(
        [sys.executable, "-m", "rlharvest.services.trainer.main", "--micro-batch-groups", "9",
         "--prompts-per-step", "4"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "micro_batch_groups (9) exceeds prompts_per_step (4)" in result.stderr


async def test_tail_batching_trains_every_prompt_once_across_a_sigkill(stack, etcd_client,
                                                                     tmp_path):
    """RollPacker's rounds on real processes: short rounds of 6 prompts accept 4 and defer 2, a
    long round runs the deferred 4, the queue survives a SIGKILL through the checkpoint, and at
    the end of the data every prompt has trained once and no worker holds a request."""
    ckpt = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--backend", "torch",
             "--tail-batching", "--eta-prompts", "1.5", "--eta-responses", "1.5",
             "--prompts-per-step", "4", "--samples-per-prompt", "2", "--data-prompts", "16"]
    # 16 prompts: two short rounds defer 2 each, the long round runs those 4, the last 4 fresh
    # prompts make a short round that accepts all of them.
    schedule = [("short", 6, 2), ("short", 6, 2), ("long", 4, 0), ("short", 4, 0)]
    manager = await start_job(stack, 2, "--step-delay-s", "0.03")  # SIGKILL lands mid-run
    trainer, metrics_port = await start_trainer(stack, "trainer", *flags)
    st = await wait_trainer(trainer, lambda s: s.steps_done >= 2)
    assert metric(scrape(metrics_port), 'rlh_trainer_rounds_total{kind="short"}') >= 2
    trainer.process.kill()
    first = [(s.round, s.prompts_launched, s.prompts_deferred) for s in st.steps]
    assert len(first) >= 2 and first == schedule[:len(first)]
    state = torch.load(checkpoint.list_checkpoints(ckpt)[-1] / "state.pt",
                       weights_only=False)["state"]
    tail = state["extra"]["tail_batching"]
    assert state["data_position"]["position"] == tail["position"]
    trained_before = tail["position"] - len(tail["deferred"])

    again, _ = await start_trainer(stack, "trainer-again", *flags)
    st = await wait_trainer(again, lambda s: s.state == "done")
    assert st.resumed_from_step == state["step"]
    resumed = [(s.round, s.prompts_launched, s.prompts_deferred) for s in st.steps]
    assert resumed == schedule[state["step"]:]
    trained_after = sum(launched - deferred for _, launched, deferred in resumed)
    assert trained_before + trained_after == 16  # every prompt once: none lost, none twice
    final = torch.load(checkpoint.list_checkpoints(ckpt)[-1] / "state.pt",
                       weights_only=False)["state"]["extra"]["tail_batching"]
    assert final == {"position": 16, "deferred": []}
    status = await manager_status(manager.endpoint)
    assert status.in_flight == 0 and all(w.assigned == 0 for w in status.workers)


async def test_a_deferred_groups_rewards_are_cancelled_and_only_trained_responses_score(
        stack, etcd_client):
    """A short round's deferred prompts never train, so a reward started for one of their
    finished responses is cancelled at the verdict (a 1 s reward is still running then): exactly
    the trained responses score. The length model fixes the finish order (data seed 7, median 4):
    6 prompts x 3 responses, the 4th accepted group's 2nd response ends at token 7, deferred
    prompt 5 has a 3-token response (the one reward cancelled), deferred prompt 2 none under 11."""
    await start_job(stack, 2, "--step-delay-s", "0.05")
    trainer, metrics_port = await start_trainer(
        stack, "trainer", "--backend", "torch", "--tail-batching", "--eta-prompts", "1.5",
        "--eta-responses", "1.5", "--prompts-per-step", "4", "--samples-per-prompt", "2",
        "--data-prompts", "6", "--data-seed", "7", "--bench-length-median", "4",
        "--max-new-tokens", "24", "--bench-reward-delay-s", "1.0", "--reward-concurrency", "32")
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    rounds = [(s.round, s.prompts_launched, s.prompts_deferred) for s in st.steps]
    assert rounds == [("short", 6, 2), ("long", 2, 0)]
    scraped = scrape(metrics_port)
    rewards = {outcome: metric(scraped, f'rlh_trainer_rewards_total{{outcome="{outcome}"}}')
               for outcome in ("scored", "failed", "cancelled")}
    # 4 accepted groups x R0 + the long round's 2 deferred prompts x R0; a deferred reward that
    # ran to its end would make it 13.
    assert rewards == {"scored": 4 * 2 + 2 * 2, "failed": 0, "cancelled": 1}, rewards


async def test_workers_lent_to_training_add_their_threads_to_the_training_thread(
        stack, etcd_client):
    """RollPacker §4.4 end to end: the manager lends one of two workers to training at 20% of
    the first step (its 12 remaining requests fit the other's 2048 KV tokens) and the trainer,
    with --borrow-lent-threads 1, trains the groups that finish meanwhile on 2 threads instead
    of 1; the record says "returned" after the step and no token was regenerated."""
    manager = await start_job(stack, 2, "--max-running", "4", "--step-delay-s", "0.03",
                              manager_flags=("--stream-scaling", "--stream-scaling-headroom",
                                             "0"))
    trainer, metrics_port = await start_trainer(
        stack, "trainer", "--backend", "torch", "--steps", "1", "--prompts-per-step", "4",
        "--samples-per-prompt", "4", "--micro-batch-groups", "1", "--max-new-tokens", "100",
        "--bench-length-median", "6", "--borrow-lent-threads", "1")
    await wait_trainer(trainer, lambda s: s.state == "done")
    record = json.loads((await etcd_client.get(keys.stream_scale_key("default").encode())).value)
    assert record["step_id"] == "step-1" and len(record["drained"]) == 1, record
    scraped = scrape(metrics_port)
    assert metric(scraped, "rlh_trainer_lent_thread_calls_total") >= 1, scraped
    st = await manager_status(manager.endpoint)
    assert st.tokens_regenerated == 0 and st.in_flight == 0


NO_MIGRATION = ("--balancer", "jsq")
# A manager that never re-attaches a step: trainers that run the same steps one after the other
# would otherwise get the first one's completions back (reattach.py).
NO_REATTACH = ("--reattach-grace-s", "0")
# One step of 16 requests of some 24 tokens (about 400 in all, 2.5 s on two workers at 50 ms an
# engine step): a kill once 128 tokens are out lands mid-step, with most of it still to run.
KILLED_STEP = ("--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens", "48",
               "--bench-length-median", "24")


async def wait_manager_roles(etcd, roles: list[str], timeout: float = 60) -> None:
    """Until the job's managers in etcd have exactly these roles (sorted)."""
    deadline = time.monotonic() + timeout
    while True:
        members = await registry.list_members(etcd, "rollout_manager")
        found = sorted(str(info.get("role")) for info in members.values())
        if found == roles:
            return
        assert time.monotonic() < deadline, f"manager roles {found}, wanted {roles}"
        await asyncio.sleep(0.1)


def sampled_by_workers(members: dict) -> float:
    """Tokens the job's workers sampled in all (their counters), regenerated ones included."""
    return sum(metric(scrape(int(info["metrics"].rsplit(":", 1)[1])),
                      "rlh_worker_tokens_generated_total") for info in members.values())


async def test_a_sigkilled_managers_restarted_successor_adopts_its_requests_and_every_token(
        stack, etcd_client):
    """The manager is SIGKILLed mid-step and a successor starts (its supervisor's restart): the
    workers keep the dead manager's requests running and hand them to the successor with every
    token they generated meanwhile, the trainer resumes its step there with the tokens it had,
    the step is applied once, not retried, and no token was sampled twice. (JSQ: Algorithm 2's
    migrations may waste the one engine step a worker runs before their abort lands, which
    would blur the count.)"""
    manager = await start_job(stack, 2, "--step-delay-s", "0.05", manager_flags=NO_MIGRATION)
    trainer, metrics_port = await start_trainer(
        stack, "trainer", "--backend", "torch", "--steps", "1", *KILLED_STEP)
    st = await wait_trainer(trainer, lambda s: s.current.step == 1
                            and s.current.tokens_generated >= 128, timeout=60)
    manager.process.kill()
    port = free_port()
    stack.start("rollout_manager", "manager-2", [
        "--manager-id", "manager-2", "--port", str(port), "--metrics-port", str(free_port()),
        "--stall-timeout-s", "5", *NO_MIGRATION, *COMMON])
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    scraped = scrape(metrics_port)
    assert metric(scraped, "rlh_trainer_step_resumes_total") == 1
    assert 'rlh_trainer_steps_total{outcome="retried"}' not in scraped
    assert [s.step for s in st.steps] == [1]
    workers = await registry.list_members(etcd_client, "rollout_worker")
    assert sampled_by_workers(workers) == sum(s.tokens for s in st.steps)  # each token once
    adopted = sum(metric(scrape(int(info["metrics"].rsplit(":", 1)[1])),
                         'rlh_worker_kept_request_outcomes_total{outcome="adopted"}')
                  for info in workers.values())
    assert adopted >= 1
    status = await manager_status(f"127.0.0.1:{port}")
    assert status.tokens_regenerated == 0 and status.in_flight == 0


async def test_a_sigkilled_leaders_standby_resumes_the_step_with_the_uninterrupted_tokens(
        stack, etcd_client):
    """Two managers for the job elect a leader in etcd. The leader is SIGKILLed mid-step; the
    standby takes over, the workers hand it the dead leader's requests with every token, and
    the trainer resumes its step there: each step applies once, every completion equals that of
    an uninterrupted run with the same seeds (the same digest), and no token was sampled
    twice (JSQ, as above)."""
    manager = await start_job(stack, 2, "--step-delay-s", "0.05",
                              manager_flags=(*NO_MIGRATION, *NO_REATTACH))
    standby_port, standby_metrics = free_port(), free_port()
    stack.start("rollout_manager", "standby", [
        "--manager-id", "manager-standby", "--port", str(standby_port), "--metrics-port",
        str(standby_metrics), "--stall-timeout-s", "5", *NO_MIGRATION, *NO_REATTACH, *COMMON])
    await wait_manager_roles(etcd_client, ["leader", "standby"])
    assert metric(scrape(standby_metrics), "rlh_manager_leader") == 0
    flags = ("--backend", "torch", "--steps", "1", *KILLED_STEP, "--no-publish")
    reference, _ = await start_trainer(stack, "reference", *flags)
    uninterrupted = await wait_trainer(reference, lambda s: s.state == "done")
    workers = await registry.list_members(etcd_client, "rollout_worker")
    sampled_before = sampled_by_workers(workers)
    trainer, _ = await start_trainer(stack, "trainer", *flags)
    await wait_trainer(trainer, lambda s: s.current.step == 1
                       and s.current.tokens_generated >= 128, timeout=60)
    manager.process.kill()
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert [s.step for s in st.steps] == [1]
    digests = [s.rollout_digest for s in st.steps]
    assert digests == [s.rollout_digest for s in uninterrupted.steps] and all(digests)
    assert sampled_by_workers(workers) - sampled_before == sum(s.tokens for s in st.steps)
    assert metric(scrape(standby_metrics), "rlh_manager_leader") == 1
    status = await manager_status(f"127.0.0.1:{standby_port}")
    assert status.tokens_regenerated == 0 and status.in_flight == 0


async def test_a_leader_sigkilled_in_a_seeding_window_loses_none_of_the_seeds_tokens(
        stack, etcd_client):
    """The leader is SIGKILLed while the trainer's seed engine rolls out in its seeding window.
    The seed engine keeps its requests running for a successor, as the workers do; the standby
    takes over and the trainer resumes the step there with no window (0), so the standby lends
    the seed at once. It still takes back what the seed kept, with every token the seed made
    since the leader died, before those requests move on to the remote workers: nothing is
    sampled twice beyond the engine step a hand-over's abort may take per request (JSQ, as
    above). Without that adoption the seed's tokens since the kill were sampled again
    (~100 here)."""
    await start_job(stack, 2, "--step-delay-s", "0.05", "--max-running", "4",
                    manager_flags=(*NO_MIGRATION, *NO_REATTACH))
    standby_port = free_port()
    stack.start("rollout_manager", "standby", [
        "--manager-id", "manager-standby", "--port", str(standby_port), "--metrics-port",
        str(free_port()), "--stall-timeout-s", "5", *NO_MIGRATION, *NO_REATTACH, *COMMON])
    await wait_manager_roles(etcd_client, ["leader", "standby"])
    # The workers run 4 requests each, so the seed engine (8) takes its share of the step.
    trainer, metrics_port = await start_trainer(
        stack, "trainer", "--backend", "torch", "--steps", "1", *KILLED_STEP, "--seed-role",
        "--instance-cap", "auto", "--seed-window-init-s", "30", "--seed-max-running", "8",
        "--bench-seed-step-delay-s", "0.05")
    await wait_trainer(trainer, lambda s: s.current.phase == "seeding" and metric(
        scrape(metrics_port), "rlh_worker_tokens_generated_total") >= 16, timeout=60)
    next(p for p in stack.processes if p.name == "manager").kill()  # mid-window
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert [s.step for s in st.steps] == [1]
    seed_metrics = scrape(metrics_port)  # the seed engine runs in the trainer's process
    adopted = metric(seed_metrics, 'rlh_worker_kept_request_outcomes_total{outcome="adopted"}')
    assert adopted >= 1, "the successor took none of the seed engine's requests back"
    workers = {k: info for k, info in
               (await registry.list_members(etcd_client, "rollout_worker")).items()
               if "metrics" in info}  # the seed's record has none: scraped above
    sampled = metric(seed_metrics, "rlh_worker_tokens_generated_total") + \
        sampled_by_workers(workers)
    wasted = sampled - sum(s.tokens for s in st.steps)
    assert wasted <= 2 * adopted, f"{wasted} tokens sampled twice ({adopted} adopted)"
    status = await manager_status(f"127.0.0.1:{standby_port}")
    assert status.tokens_regenerated == 0 and status.in_flight == 0


async def test_a_sigkilled_trainer_restarted_from_its_checkpoint_re_attaches_to_its_step(
        stack, etcd_client, tmp_path):
    """The trainer is SIGKILLed mid-rollout of step 2; the manager keeps the step running and
    its completions (--reattach-grace-s), and the trainer restarted from its step-1 checkpoint
    submits step 2 again and gets it back whole: the step is re-attached, not generated again
    (the workers sampled each token once, JSQ as above)."""
    ckpt = tmp_path / "ckpt"
    manager = await start_job(stack, 2, "--step-delay-s", "0.05", manager_flags=NO_MIGRATION)
    flags = ("--backend", "torch", "--steps", "2", *KILLED_STEP, "--checkpoint-dir", str(ckpt),
             "--checkpoint-every", "1")
    trainer, _ = await start_trainer(stack, "trainer", *flags)
    st = await wait_trainer(trainer, lambda s: s.current.step == 2
                            and s.current.tokens_generated >= 128, timeout=90)
    trainer.process.kill()
    step_1 = st.steps[0]
    again, _ = await start_trainer(stack, "trainer-again", *flags)
    st = await wait_trainer(again, lambda s: s.state == "done")
    assert st.resumed_from_step == 1 and [s.step for s in st.steps] == [2]
    assert st.steps[0].weight_version == step_1.weight_version + 1  # no version in between
    assert metric(scrape(manager.metrics_port), "rlh_manager_step_reattaches_total") == 1
    workers = await registry.list_members(etcd_client, "rollout_worker")
    assert sampled_by_workers(workers) == step_1.tokens + st.steps[0].tokens
    status = await manager_status(manager.endpoint)
    assert status.in_flight == 0 and status.tokens_regenerated == 0


async def test_the_sync_baseline_rewards_after_rollout_and_trains_m_b_groups_at_a_time(
        stack, etcd_client):
    """The veRL-like pipeline the benchmarks compare against (--pipeline sync): rewards start
    after the last completion, training after the last reward, in ceil(P0 / m_b) micro-batches;
    with the length model every response runs its modelled length."""
    await start_job(stack, 2, "--step-delay-s", "0.03")  # a rollout long enough to overlap
    trainer, _ = await start_trainer(
        stack, "trainer", "--backend", "torch", "--pipeline", "sync", "--steps", "2",
        "--prompts-per-step", "5", "--samples-per-prompt", "2", "--micro-batch-groups", "2",
        "--bench-length-median", "3", "--max-new-tokens", "12", "--bench-reward-delay-s", "0.05",
        "--reward-concurrency", "1")
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert [s.micro_batches for s in st.steps] == [3, 3]  # 2 + 2 + 1 groups, never merged
    # Every one of the 10 rewards ran after the rollout, one at a time: a reward started while
    # completions still streamed (the stream pipeline) would end the rewards sooner.
    assert all(s.rewards_s - s.rollout_s >= 10 * 0.05 - 0.01 for s in st.steps), \
        [(s.rollout_s, s.rewards_s) for s in st.steps]
    # Nothing trained while rewards were pending: the trainer waited for them all.
    assert all(s.micro_batch_wait_s >= s.rewards_s - s.rollout_s for s in st.steps)
    model = LengthModel(3, 12, 0)
    expected = [sum(model.tokens(i, step, r) for i in items for r in range(2))
                for step, items in ((1, range(5)), (2, range(5, 10)))]
    assert [s.tokens for s in st.steps] == expected


async def test_the_seed_role_hands_its_requests_over_and_a_sigkilled_spot_worker_loses_none(
        stack, etcd_client):
    """RLBoost §4.1 on real processes: the trainer's own engine joins as a seed worker, rolls
    out during the seeding window, and when the window closes its requests move to the remote
    (spot) workers with every token — none regenerated, even with a spot worker SIGKILLed
    mid-step — and every step trains on-policy. The spot workers run 4 requests at a time,
    slowly, so work waits in the manager; the seed engine's steps take 20 ms, so at the close
    after 0.1 s its requests are a few tokens into responses of ~40 and surely mid-flight.
    The workers serve bf16 and the trainer publishes it: the seed engine serves bf16 too, so
    the requests it hands over go on in the precision they began in."""
    flags = ("--step-delay-s", "0.03", "--max-running", "4", "--dtype", "bfloat16")
    manager = await start_job(stack, 2, *flags, spot=True)
    trainer, _ = await start_trainer(
        stack, "trainer", "--backend", "torch", "--steps", "2", "--seed-role",
        "--instance-cap", "auto", "--seed-window-init-s", "0.1", "--seed-max-running", "8",
        "--max-new-tokens", "64", "--bench-length-median", "40",
        "--bench-seed-step-delay-s", "0.02", "--publish-dtype", "bfloat16")
    held = await preempt_once_it_holds_requests(stack, manager, "w1", "w1-again", *flags)
    assert held > 0
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert len(st.steps) == 2
    status = await manager_status(manager.endpoint)
    assert status.tokens_regenerated == 0
    seed = next(w for w in status.workers if w.worker_id == "trainer-0-seed")
    assert seed.kind == "seed" and seed.state == "healthy"  # back after its last window
    assert seed.weight_version == st.weight_version  # it holds the trainer's weights, in memory
    text = scrape(manager.metrics_port)
    handed = metric(text, "rlh_manager_seed_handoffs_total")
    assert handed > 0 and metric(text, "rlh_manager_seed_windows_total") >= 1
    assert metric(text, 'rlh_manager_migrations_total{cause="seed_window"}') > 0
    # No seed token more than one engine step after a close: the seed engine (in the trainer's
    # process, so on its metrics) ended every handed-over request within one engine step of
    # the manager's abort, which the close sends at once.
    seed_text = scrape(trainer.metrics_port)
    aborts = metric(seed_text, "rlh_worker_abort_wait_steps_count")
    assert aborts >= 1
    assert metric(seed_text, 'rlh_worker_abort_wait_steps_bucket{le="1.0"}') == aborts
    assert "serving bfloat16 on cpu" in trainer.process.log_tail(100_000)


async def test_agentic_turns_start_on_the_seed_engine_and_move_on_with_their_tokens(
        stack, etcd_client):
    """--env with --seed-role: a step's turns are Generate calls, so the trainer holds the
    step's seeding window on the manager (HoldSeedWindow) while they play. The seed engine
    takes the first turns; its steps take 50 ms, so at the close after 0.5 s its turns are
    mid-flight and move to the spot worker with their tokens, none regenerated. The window's
    end brings back the step's remote timings for Algorithm 1."""
    manager = await start_job(stack, 1, "--max-running", "8", "--kv-pages", "1024",
                              "--prefix-cache", spot=True)
    trainer, metrics_port = await start_trainer(
        stack, "trainer", "--backend", "torch", "--steps", "1", "--env", "frozen_lake",
        "--prompts-per-step", "2", "--samples-per-prompt", "4", "--max-new-tokens", "16",
        "--env-max-turns", "2", "--seed-role", "--instance-cap", "auto",
        "--seed-window-init-s", "0.5", "--seed-max-running", "8",
        "--bench-seed-step-delay-s", "0.05")
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert [s.step for s in st.steps] == [1]
    # The manager's timings of the whole step (every turn) came back at the window's end, and
    # Algorithm 1 decided on them (without, it skips the step: n_prem 0).
    assert st.steps[0].n_prem >= 1
    seed_text = scrape(metrics_port)  # the seed engine runs in the trainer's process
    assert metric(seed_text, 'rlh_worker_requests_added_total{resumed="false"}') > 0
    assert metric(seed_text, 'rlh_trainer_trajectories_total{outcome="played"}') == 8
    text = scrape(manager.metrics_port)
    assert metric(text, "rlh_manager_seed_windows_total") >= 1
    assert metric(text, "rlh_manager_seed_handoffs_total") > 0
    assert metric(text, 'rlh_manager_migrations_total{cause="seed_window"}') > 0
    status = await manager_status(manager.endpoint)
    assert status.tokens_regenerated == 0
    seed = next(w for w in status.workers if w.worker_id == "trainer-0-seed")
    assert seed.state == "healthy"  # back once the step's window call ended


async def test_grpo_steps_on_frozen_lake_trajectories_play_turn_by_turn_on_policy(
        stack, etcd_client):  # etcd_client: an empty keyspace (no version announced before)
    """--env: each sample is a multi-turn FrozenLake trajectory played through the manager on
    the step's version (the workers' prefix caches hold each history between its turns); the
    steps apply and publish as text steps do."""
    manager = await start_job(stack, 1, "--max-running", "16", "--kv-pages", "1024",
                              "--prefix-cache")
    trainer, metrics_port = await start_trainer(
        stack, "trainer", "--backend", "torch", "--steps", "2", "--env", "frozen_lake",
        "--prompts-per-step", "2", "--samples-per-prompt", "4", "--max-new-tokens", "2",
        "--env-max-turns", "4")
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert [s.step for s in st.steps] == [1, 2]
    for s in st.steps:
        assert s.weight_version == s.step - 1 and s.published_version == s.step, s
        assert s.tokens > 0
    text = scrape(metrics_port)
    assert metric(text, 'rlh_trainer_trajectories_total{outcome="played"}') == 16
    assert metric(text, 'rlh_trainer_trajectories_total{outcome="failed"}') == 0
    routed = scrape(manager.metrics_port)
    assert metric(routed, 'rlh_manager_turns_routed{outcome="affinity"}') > 0


async def test_tail_batching_defers_the_episodes_whose_trajectories_run_longest(
        stack, etcd_client):
    """--env with --tail-batching (RollPacker on multi-turn trajectories): a short round plays
    3 episodes x 3 trajectories and trains the first 2 episodes to end 2 trajectories each; the
    third is cancelled and deferred; once 2 are deferred a long round trains them whole."""
    await start_job(stack, 1, "--max-running", "16", "--kv-pages", "1024", "--prefix-cache")
    trainer, metrics_port = await start_trainer(
        stack, "trainer", "--backend", "torch", "--steps", "3", "--env", "frozen_lake",
        "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "2",
        "--env-max-turns", "4", "--tail-batching")
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert [s.step for s in st.steps] == [1, 2, 3]
    assert [s.round for s in st.steps] == ["short", "short", "long"]
    assert [s.prompts_launched for s in st.steps] == [3, 3, 2]
    assert [s.prompts_deferred for s in st.steps] == [1, 1, 0]
    text = scrape(metrics_port)
    assert metric(text, 'rlh_trainer_rounds_total{kind="short"}') == 2
    assert metric(text, 'rlh_trainer_rounds_total{kind="long"}') == 1
    # Trained: 2 episodes x 2 trajectories per step; the cancelled ones are not counted.
    assert metric(text, 'rlh_trainer_trajectories_total{outcome="played"}') == 12


_NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a GPU trainer "
                             "(run on a GPU node by tools/gpu_fastpaths.sh)")
# Not imported to check: importing DeepSpeed fixes its accelerator for this whole process.
_NO_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                   reason="DeepSpeed is not installed on this GPU node")


@pytest.mark.parametrize(("device", "backend"), [
    ("cpu", "torch"),  # the same run on this machine: the test's own checks are proven here
    pytest.param("cuda", "torch", marks=_NO_GPU),
    pytest.param("cuda", "deepspeed", marks=[_NO_GPU, _NO_DEEPSPEED])])
async def test_a_trainer_on_its_device_publishes_each_version_as_a_delta_encoded_there(
        stack, etcd_client, device, backend):
    """``--device cuda``: the model trains on the GPU (DeepSpeed's accelerator follows the
    flag), every tensor of the loss is made there, and each version after the first is found,
    encoded and published as a bf16 delta from the GPU; the CPU workers pull every version."""
    await start_job(stack, 1)
    trainer, metrics_port = await start_trainer(
        stack, "trainer", "--device", device, "--backend", backend, "--steps", "3",
        "--publish-dtype", "bfloat16", "--lr", "1e-4", "--prompts-per-step", "2",
        "--samples-per-prompt", "2")
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert [s.step for s in st.steps] == [1, 2, 3] and all(s.tokens for s in st.steps)
    deadline = time.monotonic() + 60
    while set((await worker_versions(etcd_client)).values()) != {st.weight_version}:
        assert time.monotonic() < deadline, await worker_versions(etcd_client)
        await asyncio.sleep(0.2)
    changed = metric(scrape(metrics_port), "rlh_trainer_publish_changed_fraction")
    assert 0 < changed < 1, changed  # version 3 went as a delta, not dense
    log = trainer.process.log_tail(2000)
    assert f"training on {device}" in log and f"(encoded on {device}" in log, log
