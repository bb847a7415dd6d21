"""Publishing one version from 2 trainer ranks: rank 0 gathers, or every rank sends its shard.

Two ways for a multi-rank trainer to hand a new version to its node's transfer agent
(a real agent process, real gRPC over loopback, a real etcd):

- ``gather``: rank 0 takes the whole model (under ZeRO-3 a gather every rank joins) and
  publishes it; the other ranks send nothing;
- ``shards``: every rank copies its flat slice of every tensor (under ZeRO-3 the partition it
  holds: no gather) and publishes it on its own thread; the agent joins the slices
  (``rlharvest/services/trainer/shard_publish.py``, ``transfer_agent/flat_shards.py``).

One ``torchrun`` launch of 2 ranks per ZeRO stage alternates the two ways version after version
(the order swaps every round) and times, on rank 0, (a) ``blocked``: how long the trainer cannot
go on (the snapshot; the send runs in the background in both ways) and (b) ``held``: until the
agent holds the version. Prints the medians and the median ratio gather / shards with the spread
over rounds (> 1: shards is faster). The model is a random-init Qwen3 shape, sized by flags.

``--deltas``: the way the trainer publishes by default, in bf16 and as deltas (gather: rank 0's
``Publisher``, encoding against the version it last published; shards: each rank against its
own last shard), each way to its own job. Every round the ranks first take one SGD step (lr
1e-4, one micro-batch of random tokens, untimed), which both ways then publish, so each version
changes what one training step changes; the changed share of the elements is printed too.

    python bench/trainer_publish.py [--quick] [--zero-stage 2 3] [--hidden 768 --layers 8]
                                    [--deltas]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rlharvest.sim.ratios import spread  # noqa: E402

MODES = ("gather", "shards")


def build(args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rlharvest.models.tiny_model import tiny_config

    shape = tiny_config("small").to_dict()
    shape.pop("layer_types", None)  # derived from the layer count
    shape.update(hidden_size=args.hidden, num_hidden_layers=args.layers,
                 intermediate_size=3 * args.hidden, num_attention_heads=args.hidden // 64,
                 num_key_value_heads=args.hidden // 128, head_dim=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3Config(**shape))


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: rank 0 publishes version after version both ways; rank 1 follows."""
    import torch

    from rlharvest.services.trainer import ranks
    from rlharvest.services.trainer.backend import OptimConfig, make_backend
    from rlharvest.services.trainer.publish import Publisher
    from rlharvest.services.trainer.shard_publish import ShardTarget
    from rlharvest.services.transfer_agent import client

    torch.set_num_threads(1)
    model = build(args)
    backend = make_backend("deepspeed", model, OptimConfig(
        lr=1e-4, optimizer="sgd", zero_stage=args.stage, zero3_persistence_threshold=0))
    group = ranks.control_group()
    if torch.distributed.get_rank() > 0:
        ranks.follow(ranks.LocalRanks(backend), group)
        return
    leader = ranks.LeaderRanks(backend, None, group)
    dtype = torch.bfloat16 if args.deltas else None
    jobs = {m: f"{args.job}-{m}" if args.deltas else args.job for m in MODES}
    target = ShardTarget(args.agent, jobs["shards"], args.bucket_bytes, run=1, dtype=dtype,
                         deltas=args.deltas)
    publisher = Publisher(None, jobs["gather"], args.agent, args.bucket_bytes, deltas=True,
                          dtype=dtype) if args.deltas else None
    times: dict[str, dict[str, list[float]]] = {m: {"blocked": [], "held": []} for m in MODES}
    changed: dict[str, list[float]] = {m: [] for m in MODES}
    versions = dict.fromkeys(MODES, 0)
    for r in range(args.warmup + args.rounds):
        if args.deltas:  # one training step per round, untimed: both ways publish its change
            leader.backward(_batch(r, model.config.vocab_size))
            leader.step(1.0)
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            versions[mode] += 1
            version = versions[mode]
            start = time.perf_counter()
            if mode == "gather":
                tensors = leader.weights()
                blocked = time.perf_counter() - start
                if publisher is not None:
                    asyncio.run(publisher.publish(version, tensors))
                else:
                    asyncio.run(client.publish(args.agent, jobs[mode], version, tensors,
                                               bucket_bytes=args.bucket_bytes))
                stats = publisher.last_stats if publisher is not None else None
            else:
                leader.publish_shards(version, target)
                blocked = time.perf_counter() - start
                if not leader.await_published(version):
                    raise RuntimeError(f"version {version} was not completed by the shards")
                stats = leader.last_stats
            held = time.perf_counter() - start
            if r >= args.warmup:
                times[mode]["blocked"].append(blocked)
                times[mode]["held"].append(held)
                if stats is not None and version > 1:
                    changed[mode].append(stats.changed_fraction)
    nbytes = sum(t.numel() * t.element_size() for t in leader.weights().values())
    leader.close()
    Path(args.out).write_text(json.dumps({"times": times, "bytes": nbytes, "changed": changed}))


def _batch(seed: int, vocab: int):
    """Two samples of random tokens: one micro-batch whose gradient moves every weight."""
    import random

    from rlharvest.services.trainer import ranks
    from rlharvest.services.trainer.grpo import LossConfig

    rng = random.Random(seed)
    samples = tuple(ranks.Sample([rng.randrange(vocab) for _ in range(16)],
                                 [rng.randrange(vocab) for _ in range(16)], None, adv)
                    for adv in (1.0, -1.0))
    return ranks.MicroBatch(samples, LossConfig(), 0, 32.0)


def launch(args: argparse.Namespace, stage: int, agent: str, out: Path) -> dict:
    flags = [f"--stage={stage}", f"--agent={agent}", f"--job=publish-zero{stage}",
             f"--out={out}", f"--hidden={args.hidden}", f"--layers={args.layers}",
             f"--rounds={args.rounds}", f"--warmup={args.warmup}",
             f"--bucket-bytes={args.bucket_bytes}", *(["--deltas"] if args.deltas else [])]
    from rlharvest.cli.launcher import child_environment

    env = child_environment({"OMP_NUM_THREADS": "1"})  # the ranks import this very checkout
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", __file__, "--worker", *flags], env=env,
                          capture_output=True, text=True)
    if done.returncode or not out.exists():
        raise RuntimeError(f"ZeRO-{stage} run failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def report(stage: int, result: dict) -> None:
    times = result["times"]
    print(f"ZeRO-{stage}, 2 ranks, {result['bytes'] / 1e6:.0f} MB per version (fp32):")
    for mode, fractions in result.get("changed", {}).items():
        if fractions:
            print(f"  {mode}: {100 * statistics.median(fractions):.2f}% of the elements changed "
                  "per version (median)")
    for what in ("blocked", "held"):
        ratios = [g / s for g, s in zip(times["gather"][what], times["shards"][what])]
        print(f"  {what:8s} gather {1000 * statistics.median(times['gather'][what]):8.1f} ms   "
              f"shards {1000 * statistics.median(times['shards'][what]):8.1f} ms   "
              f"gather/shards {spread(ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--agent", default="", help=argparse.SUPPRESS)
    parser.add_argument("--job", default="", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--zero-stage", type=int, nargs="+", default=[2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (a multiple of 128)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-bytes", type=int, default=64 << 20)
    parser.add_argument("--deltas", action="store_true",
                        help="bf16 deltas, as the trainer publishes by default (module doc)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.hidden, args.layers, args.rounds = 256, 2, 3
    from transfer_harness import local_stack, start_agent

    stack = local_stack()
    try:
        agent, _ = start_agent(stack, "publish-agent")
        print(f"random-init Qwen3 shape: hidden {args.hidden}, {args.layers} layers; "
              f"{args.rounds} rounds after {args.warmup} warm-up{' (quick)' if args.quick else ''}"
              f"{'; bf16 deltas after an SGD step' if args.deltas else '; dense, as held'}")
        with tempfile.TemporaryDirectory() as tmp:
            for stage in args.zero_stage:
                report(stage, launch(args, stage, agent, Path(tmp) / f"zero{stage}.json"))
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
