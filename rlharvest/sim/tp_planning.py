"""RollPacker's parallelism planner on a length ramp, simulated (§6.4, Fig. 13a).

The paper trains Qwen2.5-14B on 16 GPUs and raises the maximum response length from 8k to 32k
tokens by 2k per step (13 steps), starting at TP 1: the planner moves to TP 2 and then 4 as the
KV cache fills, and rollout time grows far less than with TP fixed at 1 (1.9x on average).

The plant, deterministic given its seed:

- **lengths**: each step draws ``prompts * responses`` response lengths, lognormal around
  ``mean_share`` of the step's maximum and truncated at it (the long tail RL rollouts show);
- **groups**: the GPUs form ``gpus // tp`` TP groups; requests are dealt round robin;
- **engine** (vLLM-like, recompute preemption): each group admits waiting requests while their
  context plus one chunk of tokens fits its KV room, then decodes a chunk of ``chunk`` tokens
  for every running request at ``chunk * step_s(tp, running)``. When the chunk would overflow
  the room, the most recently admitted request is evicted (a preemption) to the front of the
  queue, keeping its tokens; readmitting it recomputes its context;
- **costs** (``Plant.profile``): a decode step reads the weights (split over TP), pays a fixed
  per-step overhead, an all-reduce cost per doubling of TP, and per-sequence work; KV room is
  the memory left after the weight shard and a reserve. The planner's cost model sees the same
  profile (exact profiles), but not the engine: it predicts with its own analytic model.

A step's rollout time is its slowest group's. The planner is fed each step's preemption count
and response-length histogram and picks the next step's TP.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from rlharvest.services.rollout_manager.tp_planner import (
    CostModel, TpPlanner, TpProfile, length_histogram, tp_sizes)

_GB = 1e9


@dataclass(frozen=True)
class Plant:
    """Qwen2.5-14B-like on 80 GB GPUs (the paper's §6.4 setting), rounded."""

    gpus: int = 16
    gpus_per_node: int = 8
    usable_gb: float = 72.0  # 90% of 80 GB for the engine
    weights_gb: float = 28.0  # 14B parameters in bf16, split over the TP group
    reserve_gb: float = 4.0  # activations, graphs: per GPU, whatever the TP
    kv_bytes_per_token: int = 196_608  # 48 layers x 8 KV heads x 128 x (K, V) x 2 bytes
    weight_read_s: float = 0.0084  # reading 28 GB at ~3.3 TB/s, once per decode step
    overhead_s: float = 0.006  # scheduling and launches per step, whatever the TP
    allreduce_s: float = 0.005  # per doubling of TP: two all-reduces per layer per step
    per_sequence_s: float = 0.0003  # per running sequence per step at TP 1 (attention, MLP)
    prefill_s_per_token: float = 0.00008  # 28 GFLOP per token at ~350 TFLOP/s, at TP 1
    prompt_tokens: int = 1024
    chunk: int = 256  # tokens a running request gains per simulated engine iteration

    def step_s(self, tp: int, batch: int) -> float:
        comm = self.allreduce_s * math.log2(tp)
        return self.overhead_s + comm + (self.weight_read_s + self.per_sequence_s * batch) / tp

    def kv_tokens(self, tp: int) -> int:
        free = tp * (self.usable_gb - self.reserve_gb) - self.weights_gb
        return int(free * _GB / self.kv_bytes_per_token)

    def profile(self) -> TpProfile:
        """What offline profiling would measure on this plant."""
        sizes = tp_sizes(self.gpus_per_node)
        batches = [1 << i for i in range(11)]  # 1 .. 1024
        return TpProfile(
            decode_s={tp: {b: self.step_s(tp, b) for b in batches} for tp in sizes},
            kv_tokens={tp: self.kv_tokens(tp) for tp in sizes},
            prefill_s_per_token={tp: self.prefill_s_per_token / tp for tp in sizes})


@dataclass(frozen=True)
class Ramp:
    """The workload: maximum response length from ``start`` to ``stop`` by ``increment``."""

    start: int = 8192
    stop: int = 32768
    increment: int = 2048
    prompts: int = 128
    responses: int = 8
    mean_share: float = 0.3  # median response as a share of the maximum
    sigma: float = 0.6  # lognormal spread: a few percent of responses hit the maximum
    seed: int = 0

    def max_lengths(self) -> list[int]:
        return list(range(self.start, self.stop + 1, self.increment))

    def lengths(self, step: int, max_length: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + step)
        median = self.mean_share * max_length
        return [max(1, min(max_length, int(median * math.exp(rng.gauss(0.0, self.sigma)))))
                for _ in range(self.prompts * self.responses)]


@dataclass(frozen=True)
class StepRow:
    step: int
    max_length: int
    tp: int
    rollout_s: float
    preemptions: int


@dataclass(frozen=True)
class RampResult:
    fixed: list[StepRow]  # TP held at 1
    adaptive: list[StepRow]  # the planner's TP, step by step

    @property
    def speedup(self) -> float:
        """Total rollout time with TP fixed over the planner's."""
        return sum(r.rollout_s for r in self.fixed) / sum(r.rollout_s for r in self.adaptive)


@dataclass
class _Request:
    length: int
    generated: int = 0

    def context(self, prompt: int) -> int:
        return prompt + self.generated


def run_rollout(lengths: Sequence[int], tp: int, plant: Plant) -> tuple[float, int]:
    """One step's rollout at ``tp``: (time of the slowest group, preemptions over all)."""
    groups = plant.gpus // tp
    shares: list[list[int]] = [list(lengths[g::groups]) for g in range(groups)]
    results = [_run_group(share, tp, plant) for share in shares]
    return max(t for t, _ in results), sum(p for _, p in results)


def _run_group(lengths: Sequence[int], tp: int, plant: Plant) -> tuple[float, int]:
    room, prompt, chunk = plant.kv_tokens(tp), plant.prompt_tokens, plant.chunk
    if lengths and max(lengths) + prompt > room:
        raise ValueError(f"a {max(lengths)}-token response with a {prompt}-token prompt does "
                         f"not fit a TP {tp} group's {room} KV tokens; use a bigger TP or GPU")
    prefill_s = plant.prefill_s_per_token / tp
    waiting = deque(_Request(n) for n in lengths)
    running: list[_Request] = []
    now, preemptions = 0.0, 0
    while waiting or running:
        used = sum(r.context(prompt) for r in running)
        while waiting and used + waiting[0].context(prompt) + chunk <= room:
            request = waiting.popleft()
            now += request.context(prompt) * prefill_s  # a prompt, or a recomputed context
            used += request.context(prompt)
            running.append(request)
        if not running:  # room for the context but not its next chunk: admit it anyway
            running.append(waiting.popleft())
            now += running[0].context(prompt) * prefill_s
        # The chunk's growth must fit: evict the newest request until it does (vLLM's order).
        while len(running) > 1 and sum(_after(r, prompt, chunk) for r in running) > room:
            waiting.appendleft(running.pop())
            preemptions += 1
        now += chunk * plant.step_s(tp, len(running))
        for r in running:
            r.generated = min(r.length, r.generated + chunk)
        running = [r for r in running if r.generated < r.length]
    return now, preemptions


def _after(request: _Request, prompt: int, chunk: int) -> int:
    return prompt + min(request.length, request.generated + chunk)


def simulate(plant: Plant = Plant(), ramp: Ramp = Ramp(), kind: str = "short",
             use_cost_model: bool = True) -> RampResult:
    """The ramp with TP fixed at 1 and with the planner (starting at 1, as in §6.4); every step
    is a round of ``kind``. ``use_cost_model`` False: the paper's heuristic alone."""
    model = CostModel(plant.profile(), plant.gpus, plant.prompt_tokens) if use_cost_model \
        else None
    planner = TpPlanner(plant.gpus_per_node, 1, model=model)
    fixed, adaptive = [], []
    for step, max_length in enumerate(ramp.max_lengths()):
        lengths = ramp.lengths(step, max_length)
        fixed.append(StepRow(step, max_length, 1, *run_rollout(lengths, 1, plant)))
        tp = planner.plan(kind)
        row = StepRow(step, max_length, tp, *run_rollout(lengths, tp, plant))
        adaptive.append(row)
        planner.observe(kind, row.preemptions, length_histogram(lengths, plant.chunk))
    return RampResult(fixed, adaptive)


def format_table(result: RampResult) -> str:
    lines = [f"{'step':>4} {'max len':>7} | {'fixed TP':>8} {'time s':>8} {'preempt':>7} | "
             f"{'plan TP':>7} {'time s':>8} {'preempt':>7}"]
    for f, a in zip(result.fixed, result.adaptive):
        lines.append(f"{f.step:>4} {f.max_length:>7} | {f.tp:>8} {f.rollout_s:>8.1f} "
                     f"{f.preemptions:>7} | {a.tp:>7} {a.rollout_s:>8.1f} {a.preemptions:>7}")
    return "\n".join(lines)


def main() -> None:
    result = simulate()
    print(format_table(result))
    total_fixed = sum(r.rollout_s for r in result.fixed)
    total_adaptive = sum(r.rollout_s for r in result.adaptive)
    print(f"total rollout: fixed TP 1 {total_fixed:.1f} s, planner {total_adaptive:.1f} s, "
          f"fixed/planner {result.speedup:.2f}x")
    heuristic = simulate(use_cost_model=False)
    print(f"heuristic alone (no cost model): fixed/planner {heuristic.speedup:.2f}x, TP by step "
          f"{[r.tp for r in heuristic.adaptive]}")


if __name__ == "__main__":
    main()
