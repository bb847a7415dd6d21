"""Decode throughput of TorchEngine against transformers ``model.generate`` on the same model.

Both sides generate the same number of tokens for the same static batch of prompts, with sampling
on (temperature 1, top-k 50, top-p 0.95) and no stop token, so every request runs to
max_new_tokens. The ratio is engine tokens/s over generate tokens/s (target >= 0.6 at batch 16
and 64). Each side is timed as the best of ``--repeats`` runs after a warm-up run, with one torch
thread unless ``--threads`` says otherwise.

    python bench/engine_throughput.py            # tiny + small, batch 1/16/64, 128 new tokens
    python bench/engine_throughput.py --quick    # tiny only, 32 new tokens
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from rlharvest.common.tiny_model import build_model
from rlharvest.common.engine_types import EngineRequest, SamplingParams
from rlharvest.services.rollout_worker.torch_engine import TorchEngine

TOP_K, TOP_P, TEMPERATURE = 50, 0.95, 1.0
RESULTS = Path(__file__).parent / "results" / "engine_throughput.md"


def prompts(batch: int, prompt_len: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, prompt_len), generator=gen)


def hf_generate_seconds(model, batch_prompts: torch.Tensor, new_tokens: int) -> float:
    config = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              eos_token_id=None, pad_token_id=0)
    mask = torch.ones_like(batch_prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(batch_prompts, attention_mask=mask, generation_config=config)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == batch_prompts.shape[1] + new_tokens, "generate stopped early"
    return elapsed


def engine_seconds(engine: TorchEngine, batch_prompts: torch.Tensor, new_tokens: int) -> float:
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
                             max_tokens=new_tokens, seed=i) for i in range(len(batch_prompts))]
    start = time.perf_counter()
    for i, row in enumerate(batch_prompts.tolist()):
        engine.add(EngineRequest(f"r{i}", row, params[i]))
    produced = 0
    while engine.has_work():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = time.perf_counter() - start
    assert produced == len(batch_prompts) * new_tokens, "engine stopped early"
    return elapsed


def best_of(repeats: int, run) -> float:
    run()  # warm-up: allocator, kernels, lazy imports
    return min(run() for _ in range(repeats))


def bench_preset(preset: str, batches: list[int], prompt_len: int, new_tokens: int,
                 repeats: int) -> list[tuple]:
    model = build_model(preset, seed=0)
    engine = TorchEngine(preset, seed=0, max_running=max(batches),
                         max_len=prompt_len + new_tokens)
    rows = []
    for batch in batches:
        batch_prompts = prompts(batch, prompt_len, model.config.vocab_size)
        tokens = batch * new_tokens
        hf_s = best_of(repeats, lambda: hf_generate_seconds(model, batch_prompts, new_tokens))
        ours_s = best_of(repeats, lambda: engine_seconds(engine, batch_prompts, new_tokens))
        hf, ours = tokens / hf_s, tokens / ours_s
        rows.append((preset, batch, hf, ours, ours / hf))
        print(f"{preset:>6} batch {batch:>3}: generate {hf:9.0f} tok/s   TorchEngine "
              f"{ours:9.0f} tok/s   ratio {ours / hf:5.2f}", flush=True)
    return rows


def write_results(rows: list[tuple], args: argparse.Namespace) -> None:
    lines = [
        "# engine_throughput",
        "",
        f"`python bench/engine_throughput.py{' --quick' if args.quick else ''}` — "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, sampling on "
        f"(T={TEMPERATURE}, top-k {TOP_K}, top-p {TOP_P}), no stop; "
        f"torch threads: {torch.get_num_threads()}; best of {args.repeats}.",
        "",
        "| model | batch | HF generate tok/s | TorchEngine tok/s | ratio |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {p} | {b} | {hf:.0f} | {ours:.0f} | {ratio:.2f} |"
              for p, b, hf, ours, ratio in rows]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny only, 32 new tokens (< 20 s)")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    # One thread by default: on a shared 2-core machine, OpenMP threads spin-waiting for a busy
    # core swamp these small ops and turn both sides' timings into noise.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    args = parser.parse_args()
    if args.quick:
        args.presets, args.new_tokens, args.repeats = ["tiny"], 32, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for preset in args.presets:
        rows += bench_preset(preset, args.batches, args.prompt_len, args.new_tokens, args.repeats)
    write_results(rows, args)


if __name__ == "__main__":
    main()
