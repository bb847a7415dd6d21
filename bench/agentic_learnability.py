"""Does the tiny model learn FrozenLake from multi-turn GRPO on a CPU?

In one process: a TorchEngine generates the turns (all trajectories of a step batched, through
the same ``play`` the trainer runs against the manager), the environment answers, and a
StreamingStep (torch backend) trains each group with observations masked out of the loss. After
each step the engine loads the new weights (on-policy). Each step plays ``--prompts`` episodes
(reset seeds) x ``--group-size`` trajectories.

Reported per step: the success rate (episodes reaching G, gymnasium's reward) and the mean
trajectory reward (with ``frozen_lake_shaped``, progress included). Then the success rate of the
first 3 steps against the last 3. The baseline is the same model before training.

    python bench/agentic_learnability.py [--quick] [--steps 120] [--lr 2e-3] [--seeds 3] [--env frozen_lake_shaped]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rlharvest.common.engine_types import EngineRequest, SamplingParams  # noqa: E402
from rlharvest.models.tiny_model import build_model  # noqa: E402
from rlharvest.models.tokenizer import PAD_ID  # noqa: E402
from rlharvest.services.rollout_worker.torch_engine import TorchEngine  # noqa: E402
from rlharvest.services.trainer.backend import OptimConfig, make_backend  # noqa: E402
from rlharvest.services.trainer.environments.catalog import load_environment  # noqa: E402
from rlharvest.services.trainer.environments.runner import (  # noqa: E402
    PlayConfig,
    play_group,
    rewarded_group,
)
from rlharvest.services.trainer.grpo import LossConfig  # noqa: E402
from rlharvest.services.trainer.stream_trainer import StreamingStep  # noqa: E402


class EngineGenerator:
    """``Generate`` over an in-process engine: concurrent calls join one batch; the engine steps
    while any is outstanding."""

    def __init__(self, engine: TorchEngine, cfg: PlayConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self._waiting: dict[str, asyncio.Future] = {}
        self._out: dict[str, tuple[list[int], list[float]]] = {}
        self._stepping: asyncio.Task | None = None

    async def __call__(self, trajectory_id: str, turn: int, history: list[int],
                       seed: int) -> tuple[list[int], list[float]]:
        rid = f"{trajectory_id}-{turn}"
        self.engine.add(EngineRequest(rid, history, SamplingParams(
            temperature=self.cfg.temperature, max_tokens=self.cfg.max_new_tokens, seed=seed)))
        self._out[rid] = ([], [])
        future = self._waiting[rid] = asyncio.get_running_loop().create_future()
        if self._stepping is None or self._stepping.done():
            self._stepping = asyncio.create_task(self._step())
        return await future

    async def _step(self) -> None:
        while self.engine.has_work():
            await asyncio.sleep(0)  # let every trajectory that can submit its turn do so
            for out in self.engine.step():
                tokens, logprobs = self._out[out.request_id]
                tokens += out.new_token_ids
                logprobs += out.new_logprobs
                if out.finished:
                    self._waiting.pop(out.request_id).set_result(self._out.pop(out.request_id))


async def run_step(generator: EngineGenerator, env_class: type, step: int, prompts: int,
                   group_size: int, cfg: PlayConfig):
    return await asyncio.gather(*(
        play_group(generator, env_class, f"s{step}-g{g}", 1000 * step + g, group_size, cfg)
        for g in range(prompts)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="30 steps")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--env", default="frozen_lake_shaped")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seeds", type=int, default=0, help="runs, seeds 0..N-1 (3; 2 quick)")
    parser.add_argument("--verbose", action="store_true", help="print every step")
    args = parser.parse_args()
    steps = 30 if args.quick else args.steps
    seeds = args.seeds or (2 if args.quick else 3)
    torch.set_num_threads(2)
    started = time.perf_counter()
    firsts, lasts = [], []
    for seed in range(seeds):
        success = train(args, seed, steps)
        firsts.append(sum(success[:3]) / 3)
        lasts.append(sum(success[-3:]) / 3)
        print(f"seed {seed}: success rate {firsts[-1]:.1%} (first 3 steps) -> {lasts[-1]:.1%} "
              f"(last 3)", flush=True)
    print(f"\n{args.env}, tiny model, lr {args.lr:g}, {args.prompts}x{args.group_size} "
          f"trajectories per step, {steps} steps, {seeds} seeds in "
          f"{time.perf_counter() - started:.0f} s: success rate of the last 3 steps median "
          f"{statistics.median(lasts):.1%} [{min(lasts):.1%}-{max(lasts):.1%}] (first 3 steps: "
          f"median {statistics.median(firsts):.1%})")


def train(args: argparse.Namespace, seed: int, steps: int) -> list[float]:
    """One run: the success rate of each step's trajectories."""
    torch.manual_seed(seed)
    env_class = load_environment(args.env)
    model = build_model("tiny", seed=seed)
    backend = make_backend("torch", model, OptimConfig(lr=args.lr, grad_clip=1.0))
    cfg = PlayConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, context=512)
    engine = TorchEngine("tiny", seed=seed, max_running=args.prompts * args.group_size,
                         max_len=512)
    generator = EngineGenerator(engine, cfg)
    success = []
    for step in range(steps):
        groups = asyncio.run(run_step(generator, env_class, step + 10_000 * seed,
                                      args.prompts, args.group_size, cfg))
        played = [t for group in groups for t in group]
        reached = sum(t.done and t.reward >= 1.0 for t in played) / len(played)
        success.append(reached)
        train = StreamingStep(backend, num_groups=args.prompts, group_size=args.group_size,
                              micro_batch_groups=args.prompts, loss=LossConfig(), pad_id=PAD_ID)
        train.add_groups([rewarded_group(g, group) for g, group in enumerate(groups)])
        stats = train.finish()
        engine.load_weights(model.state_dict(), step + 1)
        if args.verbose:
            print(f"seed {seed} step {step:3d}  success {reached:5.1%}  mean reward "
                  f"{stats.mean_reward:+.3f}  turns/trajectory "
                  f"{sum(t.turns for t in played) / len(played):.1f}", flush=True)
    return success


if __name__ == "__main__":
    main()
