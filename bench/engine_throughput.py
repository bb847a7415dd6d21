"""Decode throughput of TorchEngine against transformers ``model.generate`` on the same model.

Both sides generate the same number of tokens for the same static batch of prompts, with sampling
on (temperature 1, top-k 50, top-p 0.95) and no stop token, so every request runs to
max_new_tokens. The ratio is engine tokens/s over generate tokens/s: the median over interleaved
rounds, with its spread (targets: >= 0.6 at batch 16 and 64 on the presets; >= 1.0 at batch 16 on
an HF checkpoint directory). The models are the presets and real HF checkpoint directories of a
preset's shape (Qwen3 and Llama, built locally), each loaded by both sides from the same place.
One torch thread unless ``--threads`` says otherwise.

    python bench/engine_throughput.py            # presets + HF dirs, batch 1/16/64, 128 tokens
    python bench/engine_throughput.py --quick    # tiny preset + tiny HF dirs, 32 new tokens
    python bench/engine_throughput.py --device cuda --dtype bfloat16 --presets qwen3-0.6b \
        --checkpoints --batches 16 64 256 --new-tokens 64 --rounds 3   # on a GPU

``--engine vllm`` measures vLLM v1 (``VllmEngine``, the worker's ``--engine vllm``) against
TorchEngine instead, both on one `small` Qwen3 checkpoint directory (vLLM's CPU attention needs
head_dim >= 32), batches 1/16/64: the ratio is vLLM tokens/s over TorchEngine tokens/s. It also
times weight loads into each engine, a whole version and a 99%-unchanged delta (the one tensor
nearest 1% of the model's elements), and prints vLLM's time over TorchEngine's.

    python bench/engine_throughput.py --engine vllm [--quick]
    python bench/engine_throughput.py --engine vllm --device cuda --dtype bfloat16 \
        --checkpoint-size qwen3-0.6b --batches 16 64 256 --new-tokens 64   # on a GPU node
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common.engine_types import EngineRequest, SamplingParams  # noqa: E402
from rlharvest.models.tiny_model import build_model  # noqa: E402
from rlharvest.services.rollout_worker.torch_engine import TorchEngine  # noqa: E402
from results_file import results_path  # noqa: E402

TOP_K, TOP_P, TEMPERATURE = 50, 0.95, 1.0


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
    if out.is_cuda:  # the engine's steps end in a host copy; generate's tensor may still be queued
        torch.cuda.synchronize(out.device)
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


def ratio_rounds(rounds: int, generate, engine) -> tuple[list[float], list[float]]:
    """Both sides once as a warm-up (allocator, kernels, lazy imports), then ``rounds`` rounds,
    each timing both sides back to back, the order alternating: the machine's noise then falls
    on both alike. Returns each side's seconds per round."""
    generate(), engine()
    hf_times, ours_times = [], []
    for r in range(rounds):
        first, second = (generate, engine) if r % 2 == 0 else (engine, generate)
        a, b = first(), second()
        hf_times.append(a if first is generate else b)
        ours_times.append(b if first is generate else a)
    return hf_times, ours_times


def bench_model(label: str, model_ref: str, args: argparse.Namespace) -> list[tuple]:
    """TorchEngine vs HF generate on one model: a preset name or a checkpoint directory, both
    on ``args.device`` in ``args.dtype``."""
    batches, prompt_len, new_tokens, rounds = (args.batches, args.prompt_len, args.new_tokens,
                                               args.rounds)
    dtype = getattr(torch, args.dtype)
    model = build_model(model_ref, seed=0).to(args.device, dtype)
    engine = TorchEngine(model_ref, seed=0, max_running=max(batches),
                         max_len=prompt_len + new_tokens, device=args.device, dtype=dtype)
    rows = []
    for batch in batches:
        batch_prompts = prompts(batch, prompt_len, model.config.vocab_size).to(args.device)
        tokens = batch * new_tokens
        hf_times, ours_times = ratio_rounds(
            rounds, lambda: hf_generate_seconds(model, batch_prompts, new_tokens),
            lambda: engine_seconds(engine, batch_prompts, new_tokens))
        ratios = sorted(hf / ours for hf, ours in zip(hf_times, ours_times))
        hf_tps, ours_tps = tokens / statistics.median(hf_times), tokens / statistics.median(
            ours_times)
        rows.append((label, batch, hf_tps, ours_tps, statistics.median(ratios), ratios[0],
                     ratios[-1]))
        print(f"{label:>18} batch {batch:>3}: generate {hf_tps:9.0f} tok/s   TorchEngine "
              f"{ours_tps:9.0f} tok/s   ratio median {rows[-1][4]:5.2f} "
              f"[{ratios[0]:.2f}, {ratios[-1]:.2f}] over {rounds} rounds", flush=True)
    return rows


def checkpoint_models(families: list[str], size: str, root: Path) -> list[tuple[str, str]]:
    """Real HF checkpoint directories of a preset's shape (``rlharvest build-checkpoint``)."""
    from rlharvest.models.hf_checkpoint import build_checkpoint

    return [(f"{family}-{size} (HF dir)",
             str(build_checkpoint(root / family, family=family, size=size))) for family in families]


def write_results(rows: list[tuple], args: argparse.Namespace, command: str) -> None:
    lines = [
        "# engine_throughput",
        "",
        f"`{command}` — prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, sampling "
        f"on (T={TEMPERATURE}, top-k {TOP_K}, top-p {TOP_P}), no stop; torch threads: "
        f"{torch.get_num_threads()}; {args.device} {args.dtype}; {args.rounds} interleaved "
        "rounds after a warm-up.",
        "",
        "| model | batch | HF generate tok/s | TorchEngine tok/s | ratio (median) | spread |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {m} | {b} | {hf:.0f} | {ours:.0f} | {ratio:.2f} | {lo:.2f}–{hi:.2f} |"
              for m, b, hf, ours, ratio, lo, hi in rows]
    # --quick (what `make bench` runs) must not overwrite the full results the README cites.
    out = results_path("engine_throughput", args.quick)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def engine_rounds(rounds: int, vllm, torch_side) -> tuple[list[float], list[float]]:
    """Like ``ratio_rounds``: a warm-up of both, then interleaved rounds; each side's seconds."""
    vllm(), torch_side()
    v_times, t_times = [], []
    for r in range(rounds):
        if r % 2 == 0:
            v_times.append(vllm())
            t_times.append(torch_side())
        else:
            t_times.append(torch_side())
            v_times.append(vllm())
    return v_times, t_times


def load_seconds(engine, tensors: dict, version: list[int]) -> float:
    version[0] += 1
    start = time.perf_counter()
    engine.load_weights(tensors, version[0])
    return time.perf_counter() - start


def resume_agreement(engine, vocab: int, args: argparse.Namespace) -> tuple[int, int, int]:
    """How often a sampled request resumed after 8 tokens continues as it would have: vLLM
    draws from one generator per request, so the resumed draws are new ones."""
    total, cut, new = 32, 8, 24
    batch_prompts = prompts(total, args.prompt_len, vocab).tolist()

    def generate(tag: str, done: list[list[int]] | None) -> list[list[int]]:
        for i, row in enumerate(batch_prompts):
            engine.add(EngineRequest(f"{tag}{i}", row, SamplingParams(
                temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, max_tokens=cut + new,
                seed=i), generated_token_ids=done[i][:cut] if done else []))
        out: dict[str, list[int]] = {}
        while engine.has_work():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[f"{tag}{i}"] for i in range(total)]

    whole = generate("whole", None)
    resumed = generate("resumed", whole)
    same = sum(w[cut:] == r for w, r in zip(whole, resumed))
    first = sum(w[cut] == r[0] for w, r in zip(whole, resumed))
    print(f"sampled resumes: {same}/{total} identical continuations, first token {first}/"
          f"{total}", flush=True)
    return same, total, first


def bench_vllm(args: argparse.Namespace) -> None:
    from rlharvest.models.hf_checkpoint import build_checkpoint
    from rlharvest.services.rollout_worker.vllm_engine import VllmEngine, vllm_missing

    if (missing := vllm_missing()):
        sys.exit(f"--engine vllm: {missing}")
    dtype = getattr(torch, args.dtype)
    rows, load_rows = [], []
    with tempfile.TemporaryDirectory(prefix="rlh-bench-vllm-") as root:
        # --checkpoint-size picks the shape (qwen3-0.6b on a GPU node); `tiny` is too small for
        # vLLM's CPU attention, so the default here is `small`
        size = "small" if args.checkpoint_size == "tiny" else args.checkpoint_size
        ckpt = str(build_checkpoint(Path(root) / size, size=size))
        max_len = args.prompt_len + args.new_tokens
        vllm = VllmEngine(ckpt, max_len=max_len, max_running=max(args.batches), dtype=dtype,
                          device=torch.device(args.device).type, kv_cache_gib=0.5)
        ours = TorchEngine(ckpt, max_running=max(args.batches), max_len=max_len,
                           device=args.device, dtype=dtype)
        for batch in args.batches:
            batch_prompts = prompts(batch, args.prompt_len, ours.vocab_size)
            v_times, t_times = engine_rounds(
                args.rounds, lambda: engine_seconds(vllm, batch_prompts, args.new_tokens),
                lambda: engine_seconds(ours, batch_prompts, args.new_tokens))
            ratios = sorted(t / v for v, t in zip(v_times, t_times))
            tokens = batch * args.new_tokens
            rows.append((batch, tokens / statistics.median(v_times),
                         tokens / statistics.median(t_times), statistics.median(ratios),
                         ratios[0], ratios[-1]))
            print(f"batch {batch:>3}: vLLM {rows[-1][1]:8.0f} tok/s   TorchEngine "
                  f"{rows[-1][2]:8.0f} tok/s   ratio median {rows[-1][3]:5.2f} "
                  f"[{ratios[0]:.2f}, {ratios[-1]:.2f}]", flush=True)
        agreement = resume_agreement(vllm, ours.vocab_size, args)
        whole = ours.weights()
        # 99% unchanged: the one tensor nearest 1% of the model's elements
        total = sum(t.numel() for t in whole.values())
        name = min(whole, key=lambda n: abs(whole[n].numel() - total // 100))
        for label, tensors in (("whole version", whole), (f"delta ({name})", {name: whole[name]})):
            versions = [0]
            v_times, t_times = engine_rounds(args.rounds, lambda: load_seconds(vllm, tensors,
                                                                               versions),
                                             lambda: load_seconds(ours, tensors, versions))
            ratios = sorted(v / t for v, t in zip(v_times, t_times))
            load_rows.append((label, statistics.median(v_times) * 1e3,
                              statistics.median(t_times) * 1e3, statistics.median(ratios),
                              ratios[0], ratios[-1]))
            print(f"load {label}: vLLM {load_rows[-1][1]:.1f} ms   TorchEngine "
                  f"{load_rows[-1][2]:.1f} ms   vLLM/torch median {load_rows[-1][3]:.1f} "
                  f"[{ratios[0]:.1f}, {ratios[-1]:.1f}]", flush=True)
        vllm.close()
    command = "python bench/engine_throughput.py " + " ".join(sys.argv[1:])
    lines = ["# engine_throughput --engine vllm", "",
             f"`{command}` — vLLM v1 (VllmEngine) vs TorchEngine on one `{size}` Qwen3 "
             f"checkpoint, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
             f"sampling on, no stop; {args.device} {args.dtype}; {args.rounds} interleaved rounds "
             "after a warm-up.", "",
             "| batch | vLLM tok/s | TorchEngine tok/s | vLLM / torch (median) | spread |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {b} | {v:.0f} | {t:.0f} | {r:.2f} | {lo:.2f}–{hi:.2f} |"
              for b, v, t, r, lo, hi in rows]
    lines += ["", "| weight load | vLLM ms | TorchEngine ms | vLLM / torch time (median) | "
              "spread |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {label} | {v:.1f} | {t:.1f} | {r:.1f} | {lo:.1f}–{hi:.1f} |"
              for label, v, t, r, lo, hi in load_rows]
    same, total, first = agreement
    lines += ["", f"Sampled resume agreement (T=1, top-k {TOP_K}, top-p {TOP_P}): {same} of "
              f"{total} requests resumed after 8 tokens continued exactly as uninterrupted; the "
              f"first resumed token agreed in {first} of {total} (vLLM's sampling is not keyed "
              "by token position; greedy resumes agree always, tests/integration/"
              "test_vllm_engine.py)."]
    out = results_path("engine_throughput_vllm", args.quick)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny preset and tiny HF "
                        "checkpoints, 32 new tokens, 3 rounds")
    parser.add_argument("--presets", nargs="*", default=["tiny", "small"])
    parser.add_argument("--checkpoints", nargs="*", default=["qwen3", "llama"],
                        help="families of HF checkpoint directories to build and measure")
    parser.add_argument("--checkpoint-size", default="tiny", help="a preset's shape")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both sides)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    # One thread by default: on a shared 2-core machine, OpenMP threads spin-waiting for a busy
    # core swamp these small ops and turn both sides' timings into noise.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"],
                        help="vllm: vLLM v1 against TorchEngine instead of HF generate")
    args = parser.parse_args()
    if args.engine == "vllm":
        if args.quick:
            args.new_tokens, args.rounds = 32, 3
        if args.threads:
            torch.set_num_threads(args.threads)
        bench_vllm(args)
        return
    if args.quick:
        args.presets, args.new_tokens, args.rounds = ["tiny"], 32, 3
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlh-bench-ckpt-") as root:
        models = [(p, p) for p in args.presets]
        models += checkpoint_models(args.checkpoints, args.checkpoint_size, Path(root))
        for label, ref in models:
            rows += bench_model(label, ref, args)
    write_results(rows, args, "python bench/engine_throughput.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
