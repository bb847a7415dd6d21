"""The transfer agent as a real process, with real rollout workers pulling from it: publish and
pull, sparse deltas, a worker joining mid-way, training ranks publishing TP shards, publish never
waiting for pulls, a stalled puller delaying nobody, an agent SIGKILLed mid-pull, a corrupted
chunk, bad input, and relays scattered over several senders (or, where the senders serve no HTTP
data path, pulled from one of them) — over real gRPC and a real etcd."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from rlharvest.common import keys, registry
from rlharvest.common.local_etcd import free_port
from rlharvest.common.pb import transfer_agent_pb2 as pb, transfer_agent_pb2_grpc
from rlharvest.models.tiny_model import build_model
from rlharvest.models.tokenizer import CharTokenizer
from rlharvest.cli.launcher import LocalStack
from rlharvest.common.engine_types import EngineRequest, SamplingParams
from rlharvest.services.rollout_worker.torch_engine import TorchEngine
from rlharvest.services.trainer import metrics as trainer_metrics
from rlharvest.services.trainer.publish import Publisher
from rlharvest.services.transfer_agent import flat_shards, sharding
from rlharvest.services.transfer_agent.apply import apply_pull
from rlharvest.services.transfer_agent.bucketing import VersionManifest
from rlharvest.services.transfer_agent.checksum import ChecksumMismatchError, tensor_linear_sum
from rlharvest.services.transfer_agent.client import (
    DeltaApplyError,
    PublishError,
    _pack_dense,
    find_agent,
    holders,
    publish,
    publish_delta,
    pull,
    pull_request,
    weights_fingerprint,
)
from rlharvest.services.transfer_agent.data_path import BucketAssembler
from rlharvest.services.transfer_agent.delta_publish import LastPublished

from tests.fuzz_messages import fuzz_service, garbage_status
from tests.worker_sessions import add

from .worker_client import WorkerSession, health_status, launch_worker, start_worker, wait_serving

pytestmark = pytest.mark.integration
TOK = CharTokenizer()
PROMPT = TOK.encode("12+7=")
JOB = "job-main"


def start_agent(stack: LocalStack, name: str, *extra: str, cluster: str = "default"):
    port, metrics_port = free_port(), free_port()
    proc = stack.start("transfer_agent", name, [
        "--agent-id", name, "--node", f"node-{name}", "--cluster", cluster, "--port", str(port),
        "--metrics-port", str(metrics_port), "--lease-ttl", "2", "--json-logs", *extra])
    endpoint = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.alive(), "agent exited:\n" + proc.log_tail()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=1)
            return proc, endpoint, metrics_port
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"agent {name} not up:\n{proc.log_tail()}")


def scrape(metrics_port: int) -> dict[str, float]:
    """Prometheus samples as 'name{k=v,...}' -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _scraped(metrics_port: int) -> dict[str, float]:
    """``scrape``, or nothing while the process has not opened its metrics port yet."""
    try:
        return scrape(metrics_port)
    except (urllib.error.URLError, ConnectionError):
        return {}


async def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


async def worker_version(etcd, worker_id: str) -> int | None:
    found = await etcd.get(keys.member_key("rollout_worker", worker_id).encode())
    info = json.loads(found.value) if found is not None else {}
    return info.get("weight_version")


def version_of(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_model("tiny", seed).state_dict().items()}


def perturb(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """The next version: ``fraction`` of every tensor's elements nudged (ROSE: ~1% change)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        flat = t.clone().reshape(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[idx] += 1e-3 * torch.randn(k, generator=gen)
        out[name] = flat.reshape(t.shape)
    return out


def greedy_reference(tensors: dict[str, torch.Tensor], version: int, max_tokens: int = 12):
    """Tokens and logprobs of a greedy completion on a locally loaded model."""
    engine = TorchEngine(model="tiny", seed=0, max_running=2, max_len=64)
    engine.load_weights(tensors, version)
    engine.add(EngineRequest("ref", list(PROMPT), SamplingParams(temperature=0.0,
                                                                  max_tokens=max_tokens)))
    tokens, logprobs = [], []
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
    return tokens, logprobs


async def served_completion(endpoint: str, version: int, max_tokens: int = 12,
                            job: str = JOB):
    """The worker's greedy completion as ``job``'s manager would get it at ``version``."""
    session = WorkerSession(endpoint, job)
    try:
        await session.send(add("probe", PROMPT, max_tokens=max_tokens, temperature=0.0,
                               version=version, job=job))
        got = await session.finish(["probe"])
    finally:
        await session.close()
    assert "probe" not in got.errors, got.errors
    return got.completions["probe"]


@pytest.fixture(scope="module")
def agent(module_stack):
    # Small chunks so a 32 MB pull is many messages: a reader that stops reading holds it open.
    return start_agent(module_stack, "agent-a", "--chunk-bytes", str(256 << 10))


@pytest.fixture(scope="module")
def worker(module_stack, agent):
    return start_worker(module_stack, "puller-1", "--job", JOB, "--agent-pull")


@pytest.fixture
async def etcd(etcd_endpoint):
    client = await registry.connect(etcd_endpoint)  # no wipe: module processes keep their keys
    yield client
    await client.close()


V1 = version_of(seed=1)
V2 = perturb(V1, 0.01, seed=2)


async def test_published_version_is_pulled_loaded_and_served(agent, worker, etcd):
    _, endpoint, _ = agent
    assert await find_agent(etcd, node="node-agent-a") == endpoint
    await publish(endpoint, JOB, 1, V1)
    announced = await registry.get_versioned(etcd, keys.weights_announced_key(JOB))
    assert announced["version"] == 1
    await wait_for(lambda: worker_version(etcd, "puller-1"), what="worker membership")
    await wait_for(lambda: _equals(worker_version(etcd, "puller-1"), 1), what="version 1 loaded")
    served = await served_completion(worker.endpoint, 1)
    tokens, logprobs = greedy_reference(V1, 1)
    assert served.versions == {1}
    assert served.tokens == tokens
    assert served.logprobs == pytest.approx(logprobs, abs=1e-4)
    seed0_tokens, seed0_logprobs = greedy_reference(version_of(seed=0), 0)
    assert served.logprobs != pytest.approx(seed0_logprobs, abs=1e-4)  # weights did change
    metrics = scrape(worker.metrics_port)
    assert metrics["rlh_worker_weights_fingerprint"] == weights_fingerprint(V1)
    assert metrics["rlh_worker_pulls_total{kind=dense}"] == 1
    pairing = json.loads((await etcd.get(keys.pairing_key("puller-1").encode())).value)
    assert pairing["agent_id"] == "agent-a"


async def _equals(coro, expected) -> bool:
    return (await coro) == expected


async def test_worker_holding_previous_version_pulls_a_bit_exact_sparse_delta(agent, worker, etcd):
    _, endpoint, agent_metrics = agent
    await publish(endpoint, JOB, 2, V2)
    await wait_for(lambda: _equals(worker_version(etcd, "puller-1"), 2), what="version 2 loaded")
    metrics = scrape(worker.metrics_port)
    assert metrics["rlh_worker_pulls_total{kind=delta}"] == 1
    assert metrics["rlh_worker_pull_delta_ratio"] < 0.1  # 1% changed: a few % of dense bytes
    assert metrics["rlh_worker_weights_fingerprint"] == weights_fingerprint(V2)  # bit-exact
    assert scrape(agent_metrics)["rlh_agent_pulls_total{kind=delta}"] >= 1
    served = await served_completion(worker.endpoint, 2)
    tokens, logprobs = greedy_reference(V2, 2)
    assert served.versions == {2} and served.tokens == tokens
    assert served.logprobs == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a worker that holds "
                    "its copy on the GPU (run on a GPU node by tools/gpu_fastpaths.sh)")
async def test_a_gpu_worker_holding_its_copy_on_the_device_applies_the_delta_there(
        module_stack, agent, etcd):
    _, endpoint, _ = agent
    job = "gpu-held"
    gpu = start_worker(module_stack, "puller-gpu", "--job", job, "--agent-pull", "--device",
                       "cuda", "--held-weights", "device")
    await publish(endpoint, job, 1, V1)
    await wait_for(lambda: _equals(worker_version(etcd, "puller-gpu"), 1), what="version 1")
    await publish(endpoint, job, 2, V2)
    await wait_for(lambda: _equals(worker_version(etcd, "puller-gpu"), 2), what="version 2")
    metrics = scrape(gpu.metrics_port)
    assert metrics["rlh_worker_pulls_total{kind=delta}"] == 1
    assert metrics["rlh_worker_weights_fingerprint"] == weights_fingerprint(V2)
    # What the engine loaded: v2's tokens.
    served = await served_completion(gpu.endpoint, 2, job=job)
    assert served.versions == {2} and served.tokens == greedy_reference(V2, 2)[0]


async def test_a_trainers_delta_publish_is_pulled_as_published_and_verified_by_sums(agent):
    """The trainer publishes what changed; a worker holding the base gets those very
    encodings in the plan's reply and verifies them in O(changes); a worker without it gets
    the version dense; a delta against a base the agent lacks, or a held copy whose recorded
    sum is wrong, is refused with nothing changed."""
    _, endpoint, _ = agent
    job = "job-delta-publish"
    v1 = version_of(3)
    await publish(endpoint, job, 1, v1)
    first = await pull(endpoint, job, version=1)
    trainer = LastPublished(1, v1)
    v2 = perturb(v1, 0.01, seed=5)
    encoded, stats = trainer.encode_next(v2)
    assert 0 < stats.changed_fraction < 0.05
    with pytest.raises(PublishError) as refused:
        await publish_delta(endpoint, job, 2, 0, encoded)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    await publish_delta(endpoint, job, 2, 1, encoded)
    held = {name: t.clone() for name, t in first.tensors.items()}
    delta = await pull(endpoint, job, version=2, held=held, held_version=1, inplace=True,
                       held_sums=first.sums)
    assert delta.delta and delta.payload_bytes == sum(e.nbytes for e in encoded.values())
    assert weights_fingerprint(delta.tensors) == weights_fingerprint(v2)
    assert delta.sums == {name: tensor_linear_sum(t) for name, t in v2.items()}
    dense = await pull(endpoint, job, version=2)
    assert not dense.delta and weights_fingerprint(dense.tensors) == weights_fingerprint(v2)

    trainer = LastPublished.after(2, v2, encoded)
    v3 = perturb(v2, 0.01, seed=6)
    await publish_delta(endpoint, job, 3, 2, trainer.encode_next(v3)[0])
    wrong = {**delta.sums, next(iter(v2)): delta.sums[next(iter(v2))] ^ 1}
    with pytest.raises(DeltaApplyError, match="not the one it was encoded against") as err:
        await pull(endpoint, job, version=3, held=held, held_version=2, inplace=True,
                   held_sums=wrong)
    assert isinstance(err.value.__cause__, ChecksumMismatchError)
    assert weights_fingerprint(held) == weights_fingerprint(v2)  # nothing applied
    third = await pull(endpoint, job, version=3, held=held, held_version=2, inplace=True,
                       held_sums=delta.sums)
    assert weights_fingerprint(third.tensors) == weights_fingerprint(v3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: a GPU trainer's publish (run on a GPU "
    "node by tools/gpu_fastpaths.sh)"))])
async def test_the_trainers_publisher_sends_bf16_deltas_and_goes_dense_when_the_base_is_gone(
        agent, device, caplog):
    """On a GPU trainer (``--device cuda``) the weights come as device tensors: the record of
    the last version stays there and each delta is found and encoded there."""
    _, endpoint, _ = agent
    job = f"job-publisher-{device}"
    publisher = Publisher(None, job, endpoint, 1 << 20, deltas=True, dtype=torch.bfloat16)
    v1 = {name: t.to(device) for name, t in version_of(4).items()}
    await publisher.publish(1, v1)
    record = publisher._deltas_to._last
    assert record is not None and {t.device.type for t in record[1].tensors.values()} == {device}
    assert trainer_metrics.PUBLISH_CHANGED._value.get() == 1.0  # a first publish is all new
    first = await pull(endpoint, job, version=1)
    assert {t.dtype for t in first.tensors.values()} == {torch.bfloat16}
    v2 = {name: t.clone() for name, t in v1.items()}
    name = next(n for n, t in v2.items() if t.numel() > 1000)
    v2[name].view(-1)[:10] += 1.0  # ten elements move by far more than a bf16 ulp
    await publisher.publish(2, v2)
    expected = 10 / sum(t.numel() for t in v2.values())
    assert trainer_metrics.PUBLISH_CHANGED._value.get() == pytest.approx(expected)
    held = {n: t.clone() for n, t in first.tensors.items()}
    delta = await pull(endpoint, job, version=2, held=held, held_version=1, inplace=True,
                       held_sums=first.sums)
    assert delta.delta and delta.payload_bytes < delta.dense_bytes / 100
    bf16 = {n: t.to(torch.bfloat16).cpu() for n, t in v2.items()}
    assert weights_fingerprint(delta.tensors) == weights_fingerprint(bf16)
    # As after an agent restart: the publisher's base is one the agent does not hold (older
    # than the version, so it is tried and refused, then the version goes dense).
    record = publisher._deltas_to._last
    assert record is not None
    publisher._deltas_to._last = (endpoint, LastPublished(0, record[1].tensors))
    with caplog.at_level(logging.WARNING):
        await publisher.publish(3, v2)
    assert "no longer holds version 0: publishing version 3 dense" in caplog.text
    dense = await pull(endpoint, job, version=3)
    assert weights_fingerprint(dense.tensors) == weights_fingerprint(bf16)


async def test_worker_joining_midway_serves_current_version_after_one_pull(
        module_stack, agent, worker, etcd):
    late = start_worker(module_stack, "puller-late", "--job", JOB, "--agent-pull")
    await wait_for(lambda: _equals(worker_version(etcd, "puller-late"), 2), what="late worker")
    metrics = scrape(late.metrics_port)
    assert metrics["rlh_worker_pulls_total{kind=dense}"] == 1  # one pull, straight to v2
    assert metrics.get("rlh_worker_pulls_total{kind=delta}", 0) == 0
    assert metrics["rlh_worker_weights_fingerprint"] == weights_fingerprint(V2)
    served = await served_completion(late.endpoint, 2)
    assert served.versions == {2}
    late.process.kill()


async def test_a_warm_standby_pulls_unregistered_and_joins_at_the_current_version_on_sigusr1(
        module_stack, agent, etcd):
    """A standby worker keeps the job's version warm without joining the managers; on
    SIGUSR1 it registers at the version it holds and serves it at once (no start, no pull)."""
    standby = launch_worker(module_stack, "standby-1", "--job", JOB, "--agent-pull", "--standby")
    await wait_for(lambda: _scraped(standby.metrics_port).get(
        "rlh_worker_pulls_total{kind=dense}") == 1, timeout=90, what="the standby's pull")
    assert await worker_version(etcd, "standby-1") is None  # not registered: no manager sees it
    assert health_status(standby.endpoint) == "NOT_SERVING"  # nor a health check
    standby.process.activate()
    await wait_for(lambda: _equals(worker_version(etcd, "standby-1"), 2), what="activation")
    await asyncio.to_thread(wait_serving, standby, 30)
    assert scrape(standby.metrics_port)["rlh_worker_pulls_total{kind=dense}"] == 1  # no pull more
    served = await served_completion(standby.endpoint, 2)
    assert served.versions == {2}
    standby.process.kill()


async def test_tp_worker_pulls_only_its_shard(agent):
    _, endpoint, _ = agent
    got = await pull(endpoint, JOB, version=2, tp_rank=1, tp_size=2)
    for name, full in V2.items():
        assert torch.equal(got.tensors[name], sharding.take_shard(name, full, 1, 2)), name
    assert got.payload_bytes < sum(t.numel() * 4 for t in V2.values())


def rank_shards(tensors: dict[str, torch.Tensor], tp_size: int) -> list[dict[str, torch.Tensor]]:
    """What each training rank holds at TP ``tp_size``: its own slice of every tensor."""
    return [{name: sharding.take_shard(name, t, rank, tp_size).contiguous()
             for name, t in tensors.items()} for rank in range(tp_size)]


async def test_training_ranks_publish_tp_shards_and_workers_get_the_exact_full_model(
        module_stack, agent, etcd):
    """ROSE §4.2: a training side that publishes shards, not a gathered model, is served too."""
    _, endpoint, _ = agent
    job = "job-shards"
    shards = rank_shards(V1, 2)
    stale = rank_shards(V2, 2)[1]  # what a trainer that crashed meanwhile had staged
    staged = await publish(endpoint, job, 3, stale, tp_rank=1, tp_size=2)
    assert list(staged.shards_missing) == [0] and list(staged.held_versions) == []
    assert await etcd.get(keys.weights_announced_key(job).encode()) is None  # not yet whole
    again = await publish(endpoint, job, 3, shards[1], tp_rank=1, tp_size=2)  # replaces it
    assert list(again.shards_missing) == [0]
    with pytest.raises(PublishError, match="at tp_size 4, but other ranks did at tp_size 2"):
        await publish(endpoint, job, 3, rank_shards(V1, 4)[0], tp_rank=0, tp_size=4)
    done = await publish(endpoint, job, 3, shards[0], tp_rank=0, tp_size=2)
    assert list(done.shards_missing) == [] and list(done.held_versions) == [3]
    assert (await registry.get_versioned(etcd, keys.weights_announced_key(job)))["version"] == 3

    whole = await pull(endpoint, job, version=3)
    assert weights_fingerprint(whole.tensors) == weights_fingerprint(V1)
    half = await pull(endpoint, job, version=3, tp_rank=1, tp_size=2)
    assert all(torch.equal(half.tensors[name], shards[1][name]) for name in V1)

    # A worker pulls the whole model, then the ranks' next version (published at once) as a delta.
    late = start_worker(module_stack, "puller-shards", "--job", job, "--agent-pull")
    await wait_for(lambda: _equals(worker_version(etcd, "puller-shards"), 3), what="version 3")
    await asyncio.gather(*(publish(endpoint, job, 4, shard, tp_rank=rank, tp_size=2)
                           for rank, shard in enumerate(rank_shards(V2, 2))))
    await wait_for(lambda: _equals(worker_version(etcd, "puller-shards"), 4), what="version 4")
    metrics = scrape(late.metrics_port)
    assert metrics["rlh_worker_pulls_total{kind=delta}"] == 1
    assert metrics["rlh_worker_weights_fingerprint"] == weights_fingerprint(V2)  # bit-exact
    late.process.kill()


async def test_zero_ranks_publish_flat_shards_and_the_agent_holds_the_exact_model(agent, etcd):
    """ZeRO/DP ranks publish their flat slices; the agent joins them, nobody gathers."""
    _, endpoint, _ = agent
    job, ranks = "job-dp-shards", 3  # 3 ranks: most tensors' sizes leave padding on the last
    shapes = {name: tuple(t.shape) for name, t in V1.items()}

    async def publish_rank(tensors, version: int, rank: int, run: int):
        return await publish(endpoint, job, version, flat_shards.flat_shards(tensors, rank, ranks),
                             dp_rank=rank, dp_size=ranks, full_shapes=shapes, run=run)

    dead_run = await publish_rank(V2, 3, 2, run=1)  # a trainer run that died mid-publish
    assert list(dead_run.shards_missing) == [0, 1]
    assert list((await publish_rank(V1, 3, 0, run=2)).shards_missing) == [1, 2]  # drops run 1's
    with pytest.raises(PublishError, match="is from run 1, but run 2 has staged"):
        await publish_rank(V2, 3, 1, run=1)
    bad = flat_shards.flat_shards(V1, 1, ranks)
    name = next(iter(bad))
    bad[name] = bad[name][1:]
    with pytest.raises(PublishError, match=f"the flat shard of {name} has shape"):
        await publish(endpoint, job, 3, bad, dp_rank=1, dp_size=ranks, full_shapes=shapes, run=2)
    with pytest.raises(PublishError, match="as DP shards and TP shards"):
        await publish(endpoint, job, 3, bad, dp_rank=1, dp_size=ranks, full_shapes=shapes,
                      tp_rank=0, tp_size=2, run=2)
    assert list((await publish_rank(V1, 3, 1, run=2)).shards_missing) == [2]
    assert await etcd.get(keys.weights_announced_key(job).encode()) is None  # not yet whole
    done = await publish_rank(V1, 3, 2, run=2)
    assert list(done.shards_missing) == [] and list(done.held_versions) == [3]
    assert (await registry.get_versioned(etcd, keys.weights_announced_key(job)))["version"] == 3
    whole = await pull(endpoint, job, version=3)
    assert all(torch.equal(whole.tensors[n], V1[n]) for n in V1)

    await asyncio.gather(*(publish_rank(V2, 4, rank, run=2) for rank in range(ranks)))
    delta = await pull(endpoint, job, version=4, held=whole.tensors, held_version=3)
    assert delta.delta and delta.payload_bytes < delta.dense_bytes
    assert all(torch.equal(delta.tensors[n], V2[n]) for n in V2)


async def test_publish_returns_while_a_slow_pull_is_in_progress(agent, etcd):
    _, endpoint, _ = agent
    job = "job-slow"
    big = {"model.big.weight": torch.randn(8 << 20)}  # 32 MB: 128 chunks of 256 KiB
    await publish(endpoint, job, 1, big)
    async with grpc.aio.insecure_channel(endpoint) as chan:
        stub = transfer_agent_pb2_grpc.TransferAgentStub(chan)
        request = pull_request(job, 1)
        plan = await stub.PlanPull(request)
        manifest = VersionManifest.from_dict(json.loads(plan.manifest_json))
        assembler = BucketAssembler(manifest)
        stream = stub.PullBuckets(pb.BucketsRequest(pull=request, buckets=[0],
                                                    plan_id=plan.plan_id))
        first = await stream.read()
        assembler.add(first)  # the pull has started and its reader now stalls
        newer = {"model.big.weight": big["model.big.weight"] + 1}
        await asyncio.wait_for(publish(endpoint, job, 2, newer), timeout=30)
        announced = await registry.get_versioned(etcd, keys.weights_announced_key(job))
        assert announced["version"] == 2
        assert assembler.missing() == [0]  # the slow pull is still in progress
        while (chunk := await stream.read()) is not grpc.aio.EOF:
            assembler.add(chunk)
    assert assembler.missing() == [] and assembler.intact(0)
    pulled = apply_pull(manifest, assembler.buffers, {}, None)
    assert torch.equal(pulled["model.big.weight"], big["model.big.weight"])  # still version 1


async def test_a_stalled_puller_delays_no_other_worker_pulling_the_same_version(agent, etcd):
    """RLBoost §4.3: pulls are independent. One puller stops reading mid-bucket on each data path
    (HTTP range, gRPC stream); another worker's pulls of the same version still complete."""
    _, endpoint, _ = agent
    job = "job-stall"
    big = {"model.big.weight": torch.randn(8 << 20)}  # 32 MB: far beyond the socket buffers
    await publish(endpoint, job, 1, big)
    data = json.loads((await etcd.get(keys.member_key("transfer_agent", "agent-a").encode()))
                      .value)["data"]
    request = pull_request(job, 1)
    async with grpc.aio.insecure_channel(endpoint) as chan:
        stub = transfer_agent_pb2_grpc.TransferAgentStub(chan)
        plan = await stub.PlanPull(request)
        stalled_http = await stalled_range_reader(data, request, plan.plan_id)
        stalled_grpc = stub.PullBuckets(pb.BucketsRequest(pull=request, buckets=[0],
                                                          plan_id=plan.plan_id))
        await stalled_grpc.read()  # one chunk in, then nobody reads this stream again
        try:
            for transport in ("http", "grpc"):
                started = time.perf_counter()
                got = await asyncio.wait_for(pull(endpoint, job, version=1, transport=transport),
                                             timeout=30)
                assert torch.equal(got.tensors["model.big.weight"], big["model.big.weight"])
                assert time.perf_counter() - started < 15, transport
            assert stalled_grpc.done() is False  # the stalled pulls are still under way
        finally:
            stalled_grpc.cancel()
            stalled_http.transport.abort()  # a dead worker: its connection just vanishes
    after = await asyncio.wait_for(pull(endpoint, job, version=1), timeout=30)
    assert torch.equal(after.tensors["model.big.weight"], big["model.big.weight"])


async def stalled_range_reader(data: str, request: pb.PullRequest,
                               plan_id: int) -> asyncio.StreamWriter:
    """Ask the HTTP data path for all of bucket 0, read its first 64 KiB, then stop reading (a
    small receive buffer so the agent's writes back up at once)."""
    host, port = data.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=64 << 10)
    pull_header = base64.urlsafe_b64encode(request.SerializeToString()).decode()
    writer.write(f"GET /v1/buckets/0 HTTP/1.1\r\nHost: {data}\r\nX-RLH-Pull: {pull_header}\r\n"
                 f"X-RLH-Plan: {plan_id}\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readexactly(64 << 10)
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    return writer


async def test_bad_inputs_get_precise_statuses_and_the_agent_keeps_serving(agent, etcd):
    _, endpoint, _ = agent
    job = "job-bad"
    w = {"layer.weight": torch.randn(8, 8), "layer.bias": torch.randn(8)}
    for v in (1, 2, 3):  # max_versions 2: publishing 3 evicts 1
        await publish(endpoint, job, v, {k: t + v for k, t in w.items()})

    with pytest.raises(PublishError, match="not newer than the latest") as err:
        await publish(endpoint, job, 2, w)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(PublishError, match="shapes and dtypes must not change") as err:
        await publish(endpoint, job, 4, {"layer.weight": torch.randn(4, 16), "layer.bias": w["layer.bias"]})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(PublishError, match="differs from version 3 in tensors") as err:
        await publish(endpoint, job, 4, {**w, "layer.extra": torch.randn(2)})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT

    async def status_of(**kwargs) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await pull(endpoint, **kwargs)
        return exc.value.code(), exc.value.details()

    code, msg = await status_of(job=job, version=1)
    assert code == grpc.StatusCode.NOT_FOUND and "evicted (max_versions)" in msg
    code, msg = await status_of(job=job, version=3, names=["layer.nope"])
    assert code == grpc.StatusCode.NOT_FOUND and "no tensors named ['layer.nope']" in msg
    code, msg = await status_of(job="job-never", version=1)
    assert code == grpc.StatusCode.NOT_FOUND and "holds no version of job 'job-never'" in msg
    code, msg = await status_of(job=job, version=3, tp_rank=2, tp_size=2)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tp_rank 2 of tp_size 2" in msg
    code, msg = await status_of(job=job, version=2, held={}, held_version=3)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "newer than the requested 2" in msg

    async with grpc.aio.insecure_channel(endpoint) as chan:
        stub = transfer_agent_pb2_grpc.TransferAgentStub(chan)
        request = pull_request(job, 3)
        plan = await stub.PlanPull(request)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in stub.PullBuckets(pb.BucketsRequest(pull=request, buckets=[7])):
                pass
        assert exc.value.code() == grpc.StatusCode.OUT_OF_RANGE
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in stub.PullBuckets(pb.BucketsRequest(pull=request, buckets=[0],
                                                              plan_id=plan.plan_id ^ 1)):
                pass
        assert exc.value.code() == grpc.StatusCode.ABORTED
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Publish(iter([pb.PublishChunk(chunk=pb.BucketChunk(bucket=0, data=b"x"))]))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "starts with a header" in exc.value.details()
    # A publish stream of bytes that are no protobuf: INVALID_ARGUMENT, not grpc's UNKNOWN;
    # randomly filled requests to every method: precise statuses too.
    assert await garbage_status(endpoint, "/rlharvest.v1.TransferAgent/Publish") == \
        grpc.StatusCode.INVALID_ARGUMENT
    await fuzz_service(endpoint, pb.DESCRIPTOR.services_by_name["TransferAgent"],
                               rounds=15)

    # The HTTP data path refuses the same way: HTTP status, the message, the gRPC code name.
    data = json.loads((await etcd.get(keys.member_key("transfer_agent", "agent-a").encode()))
                      .value)["data"]
    pull_header = base64.urlsafe_b64encode(pull_request(job, 3).SerializeToString()).decode()

    def http_get(index: str, headers: dict) -> tuple[int, str, str]:
        req = urllib.request.Request(f"http://{data}/v1/buckets/{index}", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.headers.get("X-RLH-Code", ""), resp.read().decode("latin1")
        except urllib.error.HTTPError as err:
            return err.code, err.headers.get("X-RLH-Code", ""), err.read().decode()

    ok = {"X-RLH-Pull": pull_header, "X-RLH-Plan": str(plan.plan_id)}
    assert http_get("7", ok)[:2] == (416, "OUT_OF_RANGE")
    assert "bucket indices [7]" in http_get("7", ok)[2]
    status, code, msg = http_get("0", {**ok, "X-RLH-Plan": str(plan.plan_id ^ 1)})
    assert (status, code) == (409, "ABORTED") and "plan the pull again" in msg
    status, code, msg = http_get("0", {"X-RLH-Pull": "%%not-base64%%"})
    assert (status, code) == (400, "INVALID_ARGUMENT") and "malformed" in msg
    status, code, msg = http_get("0", {**ok, "Range": "bytes=50-10"})
    assert (status, code) == (416, "OUT_OF_RANGE") and "outside the bucket" in msg
    status, code, msg = http_get("x", ok)
    assert (status, code) == (400, "INVALID_ARGUMENT") and "not an integer" in msg
    status, _, body = http_get("0", {**ok, "Range": "bytes=0-9"})
    assert status == 206 and len(body) == 10

    # The memory bound's eviction is noted in etcd, and the agent still serves.
    record = json.loads((await etcd.get(keys.weights_holder_key(job, "agent-a").encode())).value)
    assert record["versions"] == [2, 3]
    assert [e["version"] for e in record["evicted"]] == [1]
    got = await pull(endpoint, job, version=3)
    assert torch.equal(got.tensors["layer.weight"], w["layer.weight"] + 3)


# ---- faults: their own agents and workers, killed at the end of each test -------------------


async def test_agent_killed_mid_pull_worker_ends_with_exact_weights_from_another(stack, etcd):
    job = "job-kill"
    # k1 sends at 16 KB/s, so the worker's 0.46 MB pull from it takes ~28 s: the kill, made as
    # soon as its first bytes leave, lands mid-pull however loaded the machine. (The worker pairs
    # with k1: ties go to the lower id. After the kill it pulls from k2 at full speed.)
    slow, slow_endpoint, slow_metrics = start_agent(stack, "k1-slow", "--chunk-bytes", "32768",
                                                    "--send-rate-bytes-per-s", "16384")
    _, fast_endpoint, _ = start_agent(stack, "k2-fast")
    await publish(slow_endpoint, job, 5, V1)
    await publish(fast_endpoint, job, 5, V1)
    worker = start_worker(stack, "puller-k", "--job", job, "--agent-pull")
    await wait_for(lambda: scrape(slow_metrics).get("rlh_agent_bytes_out_total{link=local}", 0) > 0,
                   what="the pull from k1-slow to start")
    assert scrape(worker.metrics_port)["rlh_worker_pull_in_progress"] == 1
    slow.kill()  # SIGKILL mid-pull
    await wait_for(lambda: _equals(worker_version(etcd, "puller-k"), 5), what="version 5 loaded")
    metrics = scrape(worker.metrics_port)
    assert metrics["rlh_worker_pull_failovers_total"] >= 1
    assert metrics["rlh_worker_weights_fingerprint"] == weights_fingerprint(V1)
    served = await served_completion(worker.endpoint, 5, job=job)
    assert served.tokens == greedy_reference(V1, 5)[0]


async def test_corrupted_chunk_is_rejected_by_checksum_and_pulled_again(stack, etcd):
    job = "job-corrupt"
    _, endpoint, agent_metrics = start_agent(stack, "c-agent", "--fault-corrupt-chunks", "1")
    await publish(endpoint, job, 7, V2)
    worker = start_worker(stack, "puller-c", "--job", job, "--agent-pull")
    await wait_for(lambda: _equals(worker_version(etcd, "puller-c"), 7), what="version 7 loaded")
    assert scrape(agent_metrics)["rlh_agent_fault_corrupted_chunks_total"] == 1
    metrics = scrape(worker.metrics_port)
    assert metrics["rlh_worker_pull_rejected_buckets_total"] == 1
    assert metrics["rlh_worker_weights_fingerprint"] == weights_fingerprint(V2)


async def test_relay_sends_exactly_one_copy_over_the_slow_link_and_every_agent_is_exact(stack, etcd):
    """WEAVE §5.2: cluster `train` holds the version on two agents, cluster `rollout` has three
    relaying agents; only the gateway pulls across the link — one copy, scattered over both
    senders — and the others pull its copy locally."""
    job = "job-relay"
    senders = {name: start_agent(stack, name, cluster="train") for name in ("src", "src2")}
    one_copy = _pack_dense(1, V1, 64 << 20)[0].total_bytes

    def crossed() -> list[float]:
        return [scrape(m).get("rlh_agent_bytes_out_total{link=cross}", 0)
                for _, _, m in senders.values()]

    # Both senders hold version 1 before any receiver runs, so the gateway sees two holders.
    for _, endpoint, _ in senders.values():
        await publish(endpoint, job, 1, V1)
    # Only this job: the session's etcd announces the other tests' jobs too.
    receivers = {name: start_agent(stack, name, "--relay", "--relay-jobs", job,
                                   cluster="rollout")
                 for name in ("r1", "r2", "r3")}

    async def everyone_holds(version: int) -> bool:
        records = await holders(etcd, job)
        return all(version in records.get(n, {}).get("versions", ()) for n in receivers)

    await wait_for(lambda: everyone_holds(1), what="every receiver to hold version 1")
    sent = crossed()
    assert sum(sent) == one_copy and all(sent), sent  # one copy, from both senders
    got = {name: scrape(m) for name, (_, _, m) in receivers.items()}
    from_each = [got["r1"].get(f"rlh_agent_relay_bytes_from_total{{agent={n}}}", 0)
                 for n in senders]
    assert sum(from_each) == one_copy and all(from_each), from_each
    assert [got[n].get("rlh_agent_relays_total{link=cross}", 0) for n in receivers] == [1, 0, 0]
    assert [got[n].get("rlh_agent_relays_total{link=local}", 0) for n in receivers] == [0, 1, 1]
    assert all(got[n]["rlh_agent_bytes_in_total{source=relay}"] == one_copy for n in receivers)
    for name, (_, endpoint, _) in receivers.items():
        pulled = await pull(endpoint, job, version=1)
        assert weights_fingerprint(pulled.tensors) == weights_fingerprint(V1), name

    # The next version crosses once too, as a sparse delta against the copy the gateway holds.
    for _, endpoint, _ in senders.values():
        await publish(endpoint, job, 2, V2)
    await wait_for(lambda: everyone_holds(2), what="every receiver to hold version 2")
    assert 0 < sum(crossed()) - one_copy < 0.1 * one_copy
    assert scrape(receivers["r1"][2])["rlh_agent_relays_total{link=cross}"] == 2
    for name, (_, endpoint, _) in receivers.items():
        pulled = await pull(endpoint, job, version=2)
        assert weights_fingerprint(pulled.tensors) == weights_fingerprint(V2), name


async def test_a_relay_sender_killed_mid_scatter_leaves_its_ranges_to_the_other(stack, etcd):
    job = "job-relay-kill"
    # k1, the one killed, sends at 8 KB/s: its half of the 0.46 MB copy would take ~28 s, so the
    # kill, made once both have sent their first bytes, lands mid-scatter however loaded the
    # machine. k2 at 64 KB/s sends its half and then k1's remainder in seconds.
    def slow(rate: int) -> tuple[str, ...]:
        return ("--chunk-bytes", "32768", "--send-rate-bytes-per-s", str(rate))

    senders = {name: start_agent(stack, name, *slow(rate), cluster="train-k")
               for name, rate in (("k1", 8192), ("k2", 65536))}
    for _, endpoint, _ in senders.values():
        await publish(endpoint, job, 1, V1)
    _, gateway, gateway_metrics = start_agent(stack, "kg", "--relay", "--relay-jobs", job,
                                              cluster="rollout-k")

    def sending(name: str) -> bool:
        return scrape(senders[name][2]).get("rlh_agent_bytes_out_total{link=cross}", 0) > 0

    await wait_for(lambda: sending("k1") and sending("k2"), what="both senders to send")
    senders["k1"][0].kill()  # SIGKILL mid-scatter
    await wait_for(lambda: _equals(_holds(etcd, job, "kg", 1), True), what="the gateway's copy")
    pulled = await pull(gateway, job, version=1)
    assert weights_fingerprint(pulled.tensors) == weights_fingerprint(V1)
    one_copy = _pack_dense(1, V1, 64 << 20)[0].total_bytes
    got = scrape(gateway_metrics)
    assert got["rlh_agent_relay_bytes_from_total{agent=k2}"] > one_copy / 2  # took k1's share


async def test_holders_without_an_http_data_path_still_relay_one_copy_over_grpc(stack, etcd):
    """The scatter takes the holders' HTTP data path; where they serve none, the gateway pulls
    its copy from one holder over the gRPC stream instead of retrying the scatter for ever."""
    job = "job-relay-grpc"
    senders = {name: start_agent(stack, name, "--no-http-data-path", cluster="train-g")
               for name in ("g1", "g2")}
    for _, endpoint, _ in senders.values():
        await publish(endpoint, job, 1, V1)
    _, gateway, gateway_metrics = start_agent(stack, "gg", "--relay", "--relay-jobs", job,
                                              cluster="rollout-g")
    await wait_for(lambda: _equals(_holds(etcd, job, "gg", 1), True), what="the gateway's copy")
    pulled = await pull(gateway, job, version=1)
    assert weights_fingerprint(pulled.tensors) == weights_fingerprint(V1)
    one_copy = _pack_dense(1, V1, 64 << 20)[0].total_bytes
    got = scrape(gateway_metrics)
    assert got["rlh_agent_relay_bytes_from_total{agent=g1}"] == one_copy
    assert got["rlh_agent_relays_total{link=cross}"] == 1


async def _holds(etcd, job: str, agent_id: str, version: int) -> bool:
    record = (await holders(etcd, job)).get(agent_id, {})
    return version in record.get("versions", ())
