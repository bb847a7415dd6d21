"""RollPacker's tail batching vs plain synchronous rollout, on one tiny torch engine.

A long-tailed length model: each prompt has a difficulty that persists across its attempts
(log-normal) and each response adds its own noise (log-normal), giving max/median lengths near
20x. Every configuration trains the same prompts (the data, then the flush of the deferred
queue): plain rollout runs P0 prompts x R0 responses per step until the last one finishes; tail
batching runs the trainer's round planner (``rlharvest/services/trainer/tail_batcher.py``) and the
manager's acceptance rule (``rlharvest/services/rollout_manager/tail_batching.py``) against the engine —
short rounds of ceil(eta_P P0) x ceil(eta_R R0) cancelled at P0 accepted prompts, long rounds
of the deferred ones. Reported per configuration, interleaved and repeated: rollout seconds for
the whole data, the ratio plain / configuration (median [spread]), the mean over steps of the
longest accepted response, and the tokens discarded (generated for cancelled requests).
``--step-delay-ms 5`` adds a flat cost per engine step (GPU-like: decode time barely depends on
the batch), where the paper reports up to 3.9x.

    python bench/tail_batching.py [--quick] [--steps 20] [--repeats 3] [--step-delay-ms 0]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rlharvest.common.engine_types import EngineRequest, SamplingParams  # noqa: E402
from rlharvest.services.rollout_manager.tail_batching import TailBatchingStep  # noqa: E402
from rlharvest.services.rollout_worker.torch_engine import TorchEngine  # noqa: E402
from rlharvest.services.trainer.tail_batcher import Round, TailBatcher  # noqa: E402

P0, R0 = 8, 4
MAX_TOKENS = 240
CONFIGS = {"plain": (1.0, 1.0), "eta 1.1": (1.1, 1.1), "eta 1.25": (1.25, 1.25),
           "eta 1.5": (1.5, 1.5), "prompts only 1.25": (1.25, 1.0),
           "responses only 1.25": (1.0, 1.25)}


def response_length(prompt: int, attempt: int, response: int, seed: int) -> int:
    difficulty = random.Random(f"{seed}-p{prompt}").lognormvariate(math.log(20), 0.9)
    noise = random.Random(f"{seed}-p{prompt}-a{attempt}-r{response}").lognormvariate(0, 0.5)
    return max(2, min(MAX_TOKENS, round(difficulty * noise)))


@dataclass
class Progress:
    """A round as the acceptance rule reads it (``step_policy.StepProgress``)."""

    request_ids: tuple[str, ...]
    outstanding: set[str]
    succeeded: dict[str, int] = field(default_factory=dict)
    step_id: str = "round"
    weight_version: int = 0
    started_at: float = 0.0


@dataclass
class Outcome:
    accepted: list[int]
    longest: int
    discarded: int


def run_round(engine: TorchEngine, plan: Round, attempts: dict[int, int], seed: int,
              delay_s: float) -> Outcome:
    groups, lengths = {}, {}
    for prompt in plan.prompts:
        attempt = attempts.get(prompt, 0)
        attempts[prompt] = attempt + 1
        for r in range(plan.responses):
            rid = f"p{prompt}-a{attempt}-r{r}"
            groups[rid] = str(prompt)
            lengths[rid] = response_length(prompt, attempt, r, seed)
            engine.add(EngineRequest(rid, [1, 2 + prompt % 100, 3], SamplingParams(
                max_tokens=lengths[rid], seed=prompt * 31 + r)))
    rule = TailBatchingStep(groups, plan.accept_prompts, plan.accept_responses) \
        if plan.speculative else None
    progress = Progress(tuple(groups), set(groups))
    generated = {rid: 0 for rid in groups}
    while progress.outstanding:
        for out in engine.step():
            generated[out.request_id] += len(out.new_token_ids)
            if out.finished:
                progress.outstanding.discard(out.request_id)
                progress.succeeded[out.request_id] = len(progress.succeeded) + 1
        if delay_s:
            time.sleep(delay_s)
        for rid in rule.cut(progress, 0.0) if rule is not None else ():
            engine.abort(rid)
            progress.outstanding.discard(rid)
    if rule is None:
        accepted = list(plan.prompts)
        trained = list(groups)
    else:
        accepted = [int(g) for g in rule.accepted]
        firsts = sorted(progress.succeeded, key=progress.succeeded.__getitem__)
        trained = [rid for g in rule.accepted
                   for rid in [r for r in firsts if groups[r] == g][:plan.accept_responses]]
    discarded = sum(generated[rid] for rid in groups if rid not in set(trained))
    return Outcome(accepted, max(lengths[rid] for rid in trained), discarded)


def run_config(eta: tuple[float, float], prompts: int, seed: int, delay_s: float) -> dict:
    engine = TorchEngine("tiny", seed=0, max_running=64, max_len=MAX_TOKENS + 8)
    batcher = TailBatcher(P0, R0, prompts, eta_prompts=eta[0], eta_responses=eta[1])
    attempts: dict[int, int] = {}
    trained: list[int] = []
    longest, discarded, rounds = [], 0, 0
    started = time.perf_counter()
    while not batcher.done:
        plan = batcher.plan()
        outcome = run_round(engine, plan, attempts, seed, delay_s)
        batcher.commit(plan, outcome.accepted)
        trained += outcome.accepted
        longest.append(outcome.longest)
        discarded += outcome.discarded
        rounds += 1
    return {"seconds": time.perf_counter() - started, "trained": sorted(trained),
            "longest": statistics.mean(longest), "discarded": discarded, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-delay-ms", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 5, 1
    torch.set_num_threads(1)
    prompts = args.steps * P0
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for rep in range(args.repeats):  # interleaved: every configuration once per repeat
        names = list(CONFIGS)
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            results[name].append(run_config(CONFIGS[name], prompts, args.seed,
                                             args.step_delay_ms / 1000))
        print(f"  repeat {rep} done", flush=True)
    plain = results["plain"]
    print(f"{prompts} prompts ({args.steps} steps of P0={P0} x R0={R0}) + flush, tiny model, one "
          f"thread, step delay {args.step_delay_ms:g} ms, {args.repeats} repeat(s)")
    print(f"{'config':22s} {'rollout s':>9s} {'plain / this':>20s} {'longest':>8s} "
          f"{'discarded':>9s} {'rounds':>6s}")
    for name, runs in results.items():
        assert all(r["trained"] == list(range(prompts)) for r in runs), name  # same prompts
        ratios = [p["seconds"] / r["seconds"] for p, r in zip(plain, runs)]
        print(f"{name:22s} {statistics.median(r['seconds'] for r in runs):9.2f} "
              f"{statistics.median(ratios):8.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] "
              f"{statistics.median(r['longest'] for r in runs):8.0f} "
              f"{statistics.median(r['discarded'] for r in runs):9.0f} "
              f"{runs[0]['rounds']:6d}")


if __name__ == "__main__":
    main()
