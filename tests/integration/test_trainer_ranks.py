"""The trainer as many ranks (torchrun or the deepspeed launcher, gloo on CPU, DeepSpeed): two and four ranks apply exactly
the single-process monolithic update at ZeRO 0-3 and publish it exactly as per-rank shards;
every rank checkpoints its part; a rank SIGKILLed mid-step fails the step with nothing applied;
and the trainer service, run as two ranks on the real stack publishing shards, trains, survives
a SIGKILLed rank (torchrun restarts the group) and resumes from its newest complete checkpoint
at a version above any announced; and its ranks publish their shards in the serving dtype, each
version after the first as deltas."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlharvest.common import keys, registry
from rlharvest.cli.launcher import child_environment
from rlharvest.services.trainer import checkpoint
from rlharvest.services.trainer.grpo import LossConfig
from rlharvest.services.transfer_agent import client
from tests.builders import rewarded_groups
from tests.unit.test_trainer_stream import fresh_model, monolithic_update, seeded_model

from .test_trainer import (
    metric,
    scrape,
    start_job,
    start_trainer,
    wait_trainer,
    worker_versions,
)
from .test_transfer_agent import start_agent

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def agent(module_stack) -> str:
    return start_agent(module_stack, "ranks-agent")[1]


def run_ranks(out: Path, *flags: str, ranks: int = 2, launcher: str = "torchrun") -> dict:
    """tests/rank_job.py under torchrun or the deepspeed launcher; what rank 0 wrote."""
    script = [str(ROOT / "tests" / "rank_job.py"), "--out", str(out), *flags]
    extra = {"OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", *script]
    else:  # on CPU its accelerator counts LOCAL_SIZE "devices"
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", f"--num_gpus={ranks}",
               "--no_local_rank", *script]
        extra["LOCAL_SIZE"] = str(ranks)
    env = child_environment(extra)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), f"rank 0 wrote nothing (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    ("launcher", "ranks", "zero_stage", "aggregation", "beta", "micro_batch_groups", "seed"), [
        ("torchrun", 2, 0, "token", 0.0, 2, 0),
        ("torchrun", 2, 1, "sequence", 0.05, 3, 5),
        ("deepspeed", 2, 2, "token", 0.05, 1, 7),
        # ZeRO 3 runs below at 4 ranks; sequence aggregation and beta 0 run above.
        # 4 ranks, micro-batches of one 3-sample group: a rank with an empty share each time.
        ("torchrun", 4, 3, "token", 0.05, 1, 2),
    ])
def test_many_ranks_apply_exactly_the_monolithic_single_process_update(
        tmp_path, agent, launcher, ranks, zero_stage, aggregation, beta, micro_batch_groups,
        seed):
    """... and every rank's flat shard, published to a real agent, joins into exactly it."""
    out = tmp_path / "out.json"
    ckpt = tmp_path / "ckpt"  # ZeRO 2 and 3 also checkpoint: each rank writes its partition
    stats = run_ranks(out, "--zero-stage", str(zero_stage), "--aggregation", aggregation,
                      "--beta", str(beta), "--micro-batch-groups", str(micro_batch_groups),
                      "--seed", str(seed), "--publish-to", agent,
                      "--publish-job", f"ranks-{launcher}-{ranks}-{zero_stage}",
                      *(("--checkpoint", str(ckpt)) if zero_stage >= 2 else ()),
                      ranks=ranks, launcher=launcher)
    assert "error" not in stats, stats
    assert stats["publish_complete"] and stats["published_exact"], stats
    assert stats["forward_s"] > 0  # timed by every rank: alone, rank 0's ZeRO-3 forward hangs
    if zero_stage >= 2:
        assert_partitioned_checkpoint(ckpt, stats, ranks, zero_stage)
    expected = fresh_model(seed % 3)
    monolithic_update(expected, rewarded_groups(seed),
                      LossConfig(beta=beta, aggregation=aggregation),
                      seeded_model(99) if beta else None, lr=0.5)
    trained = torch.load(str(out) + ".pt", weights_only=True)
    base = fresh_model(seed % 3).state_dict()
    for name, want in expected.state_dict().items():
        assert torch.allclose(trained[name], want, atol=1e-6, rtol=0), \
            f"{name} differs by {(trained[name] - want).abs().max().item():.3g}"
    assert any(not torch.equal(trained[n], base[n]) for n in base), "no update at all"


def assert_partitioned_checkpoint(ckpt: Path, stats: dict, ranks: int, zero_stage: int) -> None:
    """Every rank wrote its ZeRO partition, and the trained weights load back from them."""
    assert stats["perturbed"] is True and stats["restored"] is True, stats
    parts = sorted(p.name for p in (ckpt / "deepspeed" / "deepspeed").glob("zero_pp_rank_*"))
    assert [p for p in parts if "optim_states" in p] == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ranks)]
    if zero_stage == 3:  # the parameters themselves are partitioned too
        assert f"zero_pp_rank_{ranks - 1}_mp_rank_00_model_states.pt" in parts, parts


def test_a_rank_sigkilled_mid_step_fails_the_step_with_no_parameter_moved(tmp_path):
    stats = run_ranks(tmp_path / "out.json", "--kill-follower-after", "2")
    assert "error" in stats, stats
    assert stats["moved"] is False


async def test_the_trainer_service_as_two_ranks_survives_a_sigkilled_rank_and_resumes(
        stack, etcd_client, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--backend",
             "deepspeed", "--zero-stage", "2", "--steps", "0", "--publish-mode", "shards"]
    await start_job(stack, 2)
    trainer, metrics_port = await start_trainer(stack, "trainer", *flags, ranks=2, restarts=1)
    assert "rank 1 of 2 following rank 0" in trainer.process.log_path.read_text()
    first = await wait_trainer(trainer, lambda s: s.steps_done >= 3)
    assert first.steps[-1].loss == first.steps[-1].loss  # trained, not NaN
    text = await asyncio.to_thread(scrape, metrics_port)
    assert metric(text, "rlh_trainer_ranks") == 2
    # Every rank publishes its own shard of each version; nobody gathers the weights.
    for command in ("Backward", "Step", "Save", "PublishShard", "AwaitPublished"):
        assert metric(text, f'rlh_trainer_rank_command_seconds_count{{command="{command}"}}') > 0
    assert metric(text, 'rlh_trainer_rank_command_seconds_count{command="Weights"}') == 0
    saved = checkpoint.list_checkpoints(ckpt)
    assert saved, "no checkpoint of two ranks before the kill"
    follower = trainer.process.rank_pids()[1]
    os.kill(follower, signal.SIGKILL)

    # torchrun restarts both ranks; rank 0 comes back on the same port and resumes.
    deadline = time.monotonic() + 180
    while True:
        assert time.monotonic() < deadline, trainer.process.log_tail(80)
        try:
            st = await wait_trainer(trainer, lambda s: s.resumed_from_step >= 0, timeout=5)
            break
        except Exception:  # between the groups: no trainer answers for a moment
            await asyncio.sleep(0.5)
    assert st.resumed_from_step >= 2 and st.resumed_from_step % 2 == 0
    assert follower not in trainer.process.rank_pids()
    announced_before = (await registry.get_versioned(
        etcd_client, keys.weights_announced_key("default")))["version"]
    resumed = await wait_trainer(trainer, lambda s: s.steps_done >= st.resumed_from_step + 2)
    assert resumed.steps[-1].step == resumed.steps_done
    assert resumed.weight_version >= announced_before
    # SIGTERM reaches torchrun, which forwards it: rank 0 stops gracefully and tells rank 1.
    # (torchrun itself then exits non-zero by design: it reports the signal it was sent.)
    trainer.process.terminate()
    log = trainer.process.log_path.read_text()
    assert "trainer trainer-0 stopped (shutting down on a signal; exit code 0)" in log
    assert "rank 1: rank 0 says stop" in log


async def test_two_ranks_publish_shards_in_the_serving_dtype_and_later_versions_as_deltas(
        stack, etcd_client):
    """The GPU overlay's trainer, on CPU: two ranks publishing shards with ``--publish-dtype
    bfloat16``. The version the workers pull is bf16, and every version after the first goes
    as each rank's delta against the shard it published last (the changed fraction of the
    step's summary, over both ranks, strictly between 0 and 1; fewer bytes sent than dense)."""
    await start_job(stack, 1)
    trainer, metrics_port = await start_trainer(
        stack, "trainer", "--backend", "deepspeed", "--publish-mode", "shards",
        "--publish-dtype", "bfloat16", "--steps", "3", "--lr", "1e-4",
        "--prompts-per-step", "2", "--samples-per-prompt", "2", ranks=2)
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert [s.step for s in st.steps] == [1, 2, 3] and all(s.tokens for s in st.steps)
    text = await asyncio.to_thread(scrape, metrics_port)
    assert metric(text, 'rlh_trainer_rank_command_seconds_count{command="PublishShard"}') >= 3
    deadline = time.monotonic() + 60
    while set((await worker_versions(etcd_client)).values()) != {st.weight_version}:
        assert time.monotonic() < deadline, await worker_versions(etcd_client)
        await asyncio.sleep(0.2)
    agent = await client.find_agent(etcd_client)
    pulled = await client.pull(agent, "default", version=st.weight_version)
    assert {t.dtype for t in pulled.tensors.values() if t.is_floating_point()} == \
        {torch.bfloat16}
    # Version 1 is every rank's first shard: dense. Versions 2 and 3 are deltas.
    assert st.steps[0].published_changed == 1.0, st.steps
    for s in st.steps[1:]:
        assert 0 < s.published_changed < 1, st.steps
        assert 0 < s.published_payload_ratio < 1, st.steps
    assert 0 < metric(text, "rlh_trainer_publish_changed_fraction") < 1
    # SIGTERM to torchrun, which forwards it: the stack's teardown alone leaves the ranks behind.
    trainer.process.terminate()
