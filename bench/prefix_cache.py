"""The engine's prefix cache on multi-turn trajectories, one torch engine in-process.

Agentic rollout sends each trajectory's whole history every turn: the last prompt, the last
completion and the environment's reply. ROSE (Table 3) measures prefill at 77–86% of such
tokens. Here: ``--trajectories`` trajectories of ``--turns`` turns. Each starts from a 300-token
prompt; a turn samples 32 tokens and the environment answers with 150. So histories grow
300 -> ~850 tokens. All trajectories' turn t run as one batch, as a rollout step would send them.
Both configurations generate exactly the same tokens (seeded sampling, checked each round):

- ``no cache``: paged KV, every turn prefills its whole history;
- ``prefix cache``: the same engine with ``prefix_cache=True``: a turn reads its cached history.

Reported: rollout seconds of all turns per configuration (interleaved rounds, the order
alternating), the ratio no cache / cache (median [spread]), the hit rate and the prefill tokens
saved.

    python bench/prefix_cache.py [--quick] [--rounds 5] [--model small] [--threads 1]
                                 [--prefill-chunk 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rlharvest.common.engine_types import EngineRequest, SamplingParams  # noqa: E402
from rlharvest.services.rollout_worker.torch_engine import TorchEngine  # noqa: E402

PROMPT, COMPLETION, OBSERVATION = 300, 32, 150


def run(engine: TorchEngine, trajectories: int, turns: int) -> tuple[float, list[list[int]]]:
    """All trajectories turn by turn; the seconds the engine ran and every turn's tokens."""
    rng = random.Random(0)
    history = [[1] + [rng.randrange(3, 128) for _ in range(PROMPT - 1)]
               for _ in range(trajectories)]
    completions: list[list[int]] = []
    seconds = 0.0
    for turn in range(turns):
        for t in range(trajectories):
            engine.add(EngineRequest(f"t{t}.{turn}", history[t], SamplingParams(
                temperature=1.0, max_tokens=COMPLETION, seed=1000 * t + turn)))
        done: dict[str, list[int]] = {f"t{t}.{turn}": [] for t in range(trajectories)}
        started = time.perf_counter()
        while engine.has_work():
            for out in engine.step():
                done[out.request_id] += out.new_token_ids
        seconds += time.perf_counter() - started
        for t in range(trajectories):
            tokens = done[f"t{t}.{turn}"]
            completions.append(tokens)
            reply = [rng.randrange(3, 128) for _ in range(OBSERVATION)]
            history[t] = history[t] + tokens + reply
    return seconds, completions


def make(model: str, cached: bool, trajectories: int, turns: int,
         prefill_chunk: int = 0) -> TorchEngine:
    longest = PROMPT + (turns - 1) * (COMPLETION + OBSERVATION) + COMPLETION
    pages = trajectories * (longest // 16 + 2) * 2  # room for every history twice
    return TorchEngine(model, max_running=trajectories, max_len=longest, kv_pages=pages,
                       page_tokens=16, prefix_cache=cached, prefill_chunk=prefill_chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, 4 trajectories")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--model", default="small")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="chunked prefill of this many tokens per step (both engines)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.trajectories = 2, 4
    if args.threads:
        torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = {"no cache": [], "prefix cache": []}
    load = None
    for r in range(args.rounds):
        order = ["no cache", "prefix cache"] if r % 2 == 0 else ["prefix cache", "no cache"]
        outputs = {}
        for name in order:
            engine = make(args.model, name == "prefix cache", args.trajectories, args.turns,
                          args.prefill_chunk)
            seconds, outputs[name] = run(engine, args.trajectories, args.turns)
            times[name].append(seconds)
            if name == "prefix cache":
                load = engine.load()
        if outputs["no cache"] != outputs["prefix cache"]:
            raise SystemExit("the prefix cache changed the generated tokens")
    ratios = sorted(a / b for a, b in zip(times["no cache"], times["prefix cache"]))
    assert load is not None
    history = PROMPT + (args.turns - 1) * (COMPLETION + OBSERVATION)
    print(f"{args.model}, {args.trajectories} trajectories x {args.turns} turns, histories "
          f"{PROMPT}-{history} tokens, {COMPLETION} sampled per turn, {args.rounds} rounds, "
          f"prefill chunk {args.prefill_chunk or 'none'}; tokens identical with and without "
          "the cache")
    for name, secs in times.items():
        print(f"  {name:13s} {statistics.median(secs):7.2f} s (median)")
    print(f"  speed-up no cache / prefix cache: {statistics.median(ratios):.2f}x "
          f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]")
    print(f"  hits {load.prefix_hits}/{load.prefix_lookups} requests, prefill tokens read from "
          f"the cache: {load.prefix_cached_tokens} per round")


if __name__ == "__main__":
    main()
