"""One streamed GRPO step trained by every rank of a ``torchrun`` launch (tests/integration/test_trainer_ranks.py).

Rank 0 leads a ``StreamingStep`` over ``LeaderRanks``; the other ranks ``follow``. Rank 0 writes
the updated parameters and the step's stats to ``--out``. ``--kill-follower-after N``: rank 1
SIGKILLs itself after its N-th command, and rank 0 writes what the step raised instead.
``--checkpoint DIR``: after the step every rank saves, then loads back into a perturbed model.
``--publish-to AGENT --publish-job JOB``: after the step every rank publishes its flat shard of
version 1 to that transfer agent; rank 0 pulls the version back and compares it with the model.
After the step rank 0 also times a forward pass on every rank (the placement profile's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
from pathlib import Path

import torch

from rlharvest.models.tokenizer import PAD_ID
from rlharvest.services.trainer import ranks
from rlharvest.services.trainer.backend import OptimConfig, make_backend
from rlharvest.services.trainer.grpo import LossConfig
from rlharvest.services.trainer.shard_publish import ShardTarget
from rlharvest.services.transfer_agent import client
from rlharvest.services.trainer.stream_trainer import StreamingStep
from tests.builders import rewarded_groups
from tests.unit.test_trainer_stream import GROUP_SIZE, bursts, fresh_model, seeded_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--aggregation", default="token")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--micro-batch-groups", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--kill-follower-after", type=int, default=0)
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--publish-to", default="")
    parser.add_argument("--publish-job", default="ranks")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = fresh_model(args.seed % 3)
    ref_model = seeded_model(99) if args.beta > 0 else None
    backend = make_backend("deepspeed", model, OptimConfig(
        lr=args.lr, optimizer="sgd", grad_clip=0.0, zero_stage=args.zero_stage,
        zero3_persistence_threshold=0))  # a tiny model, really partitioned at ZeRO-3
    group = ranks.control_group()
    if args.kill_follower_after and torch.distributed.get_rank() == 0:
        # torchrun SIGTERMs the survivors as soon as it sees rank 1 die; rank 0 must live long
        # enough to find the broken collective and report it (it exits right after).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if torch.distributed.get_rank() > 0:
        local = ranks.LocalRanks(backend, ref_model)
        if args.kill_follower_after:
            local = _Dying(local, args.kill_follower_after)
        ranks.follow(local, group)
        return

    leader = ranks.LeaderRanks(backend, ref_model, group)
    groups = rewarded_groups(args.seed)
    arrivals = groups[:]
    random.Random(args.seed + 1).shuffle(arrivals)
    step = StreamingStep(backend, num_groups=len(groups), group_size=GROUP_SIZE,
                         micro_batch_groups=args.micro_batch_groups,
                         loss=LossConfig(beta=args.beta, aggregation=args.aggregation),
                         pad_id=PAD_ID, ref_model=ref_model, ranks=leader)
    before = leader.weights()
    out: dict = {}
    try:
        for ready in bursts(arrivals, 2, args.seed + 2):
            step.add_groups(ready)
        stats = step.finish()
        out = {"loss": stats.loss, "grad_norm": stats.grad_norm}
    except ranks.RankFailed as exc:
        out = {"error": str(exc)}
    except RuntimeError as exc:  # the collective itself failed: a peer is gone
        out = {"error": f"collective: {exc}"}
    trained = leader.weights() if "error" not in out else model.state_dict()
    out["moved"] = any(not torch.equal(a, b) for a, b in zip(before.values(), trained.values()))
    if "error" not in out:  # the placement profile's forward, every rank in it (ZeRO-3 gathers)
        out["forward_s"] = leader.forward_seconds(2, 8)
    if args.publish_to and "error" not in out:
        out.update(publish_and_pull(leader, args.publish_to, args.publish_job, trained))
    if args.checkpoint and "error" not in out:
        leader.save(Path(args.checkpoint))
        leader.backward(step_batch(args.seed))  # move the weights away from the checkpoint
        leader.step(1.0)
        out["perturbed"] = any(not torch.equal(a, b) for a, b in
                               zip(trained.values(), leader.weights().values()))
        leader.load(Path(args.checkpoint))
        out["restored"] = all(torch.equal(a, b) for a, b in zip(trained.values(),
                                                                leader.weights().values()))
    torch.save(trained, args.out + ".pt")
    Path(args.out).write_text(json.dumps(out))
    if "error" not in out:
        leader.close()


def publish_and_pull(leader: ranks.LeaderRanks, agent: str, job: str,
                     trained: dict[str, torch.Tensor]) -> dict:
    """Every rank publishes its shard of version 1; the agent's joined version, pulled back."""
    leader.publish_shards(1, ShardTarget(agent, job, bucket_bytes=1 << 16, run=1))
    complete = leader.await_published(1)
    got = asyncio.run(client.pull(agent, job, version=1)).tensors
    exact = sorted(got) == sorted(trained) and all(torch.equal(got[n], t)
                                                   for n, t in trained.items())
    return {"publish_complete": complete, "published_exact": exact}


def step_batch(seed: int) -> ranks.MicroBatch:
    """Some samples of the test's groups as one micro-batch (lr 0.5: it moves every weight)."""
    group = rewarded_groups(seed)[0]
    samples = tuple(ranks.Sample(c.prompt_ids, c.completion_ids, None, 1.0 - i)
                    for i, c in enumerate(group.completions))
    return ranks.MicroBatch(samples, LossConfig(), PAD_ID, float(len(samples)))


class _Dying(ranks.LocalRanks):
    """A follower that SIGKILLs itself on its ``after``-th backward: a rank lost mid-step."""

    def __init__(self, local: ranks.LocalRanks, after: int) -> None:
        super().__init__(local.backend, local.ref_model)
        self._left = after

    def backward(self, batch: ranks.MicroBatch) -> float:
        self._left -= 1
        if self._left <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().backward(batch)


if __name__ == "__main__":
    main()
