"""Measuring a latency profile on the engine itself (ROSE §4.1: "we pre-profile runtime costs").

``measure`` times, on an idle engine, one prefill per prompt length (a request of that many
tokens and max_tokens 1: the step that admits it is its prefill) and one decode step per batch
size (b requests prefilled first, then the step that decodes all of them). Each point is the
median of ``repeats``. The chunked-prefill curve is the monolithic one summed per 512-token chunk
(the torch engine prefills a prompt in one forward). Takes a second or two for the presets.

``rlharvest-coexecutor profile --serving-model small --model tiny --out profile.json`` writes
both models' profiles for ``rlharvest-coexecutor --profile profile.json`` (the co-executor
measures them itself at start when it is given none).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import typer

from rlharvest.common.engine_types import EngineRequest, SamplingParams
from rlharvest.common.worker_core.engine import Engine
from rlharvest.services.coexecutor.latency_profile import LatencyProfile

CHUNK_TOKENS = 512


def measure(engine: Engine, max_len: int, *, lengths: Sequence[int] = (16, 64, 256),
            batches: Sequence[int] = (1, 4, 16), repeats: int = 3) -> LatencyProfile:
    if engine.has_work():
        raise RuntimeError("profile an idle engine")
    lengths = sorted({min(n, max_len - 2) for n in lengths if n >= 1})
    mono = tuple((n, _median(lambda n=n: _prefill(engine, n), repeats)) for n in lengths)
    decode = tuple((b, _median(lambda b=b: _decode(engine, b), repeats)) for b in sorted(batches))
    measured = LatencyProfile({"mono": mono, "chunk": mono}, decode)
    chunk = tuple((n, _chunked(measured, n)) for n in lengths)
    return LatencyProfile({"mono": mono, "chunk": chunk}, decode)


def _median(run, repeats: int) -> float:
    return statistics.median(run() for _ in range(repeats))


def _request(rid: str, tokens: int, max_tokens: int) -> EngineRequest:
    return EngineRequest(rid, [4 + i % 32 for i in range(tokens)],
                         SamplingParams(temperature=0.0, max_tokens=max_tokens))


def _prefill(engine: Engine, tokens: int) -> float:
    engine.add(_request("profile-prefill", tokens, 1))
    started = time.perf_counter()
    engine.step()
    took = time.perf_counter() - started
    _drain(engine)
    return took


def _decode(engine: Engine, batch: int) -> float:
    for i in range(batch):
        engine.add(_request(f"profile-decode-{i}", 8, 2))
    engine.step()  # prefill all of them (and their first token)
    started = time.perf_counter()
    engine.step()  # one decode step of the batch (their second and last token)
    took = time.perf_counter() - started
    _drain(engine)
    return took


def _drain(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def _chunked(profile: LatencyProfile, tokens: int) -> float:
    """Full 512-token chunks and the rest, each a monolithic prefill of its own."""
    full, rest = divmod(tokens, CHUNK_TOKENS)
    return full * profile.prefill_s(CHUNK_TOKENS) + profile.prefill_s(rest)


app = typer.Typer(add_completion=False, help="Measure the co-executor's latency profiles.")


@app.command()
def main(out: Path = typer.Option(..., help="the JSON file to write"),
         serving_model: str = typer.Option("small", help="preset or checkpoint directory"),
         model: str = typer.Option("tiny", help="the RL job's model (rollout side)"),
         max_len: int = typer.Option(512, min=8),
         torch_threads: int = typer.Option(0, min=0, help="0 keeps torch's default"),
         device: str = typer.Option("cpu", help="cpu, cuda or cuda:N (as the co-executor's)"),
         dtype: str = typer.Option("float32", help="float32, bfloat16 or float16"),
         repeats: int = typer.Option(3, min=1)) -> None:
    import torch

    from rlharvest.common import engine_device
    from rlharvest.services.rollout_worker.torch_engine import TorchEngine

    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        where, torch_dtype = engine_device.resolve(device, dtype)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    profiles = {}
    for role, name in (("serving", serving_model), ("rollout", model)):
        engine = TorchEngine(model=name, max_running=16, max_len=max_len, device=where,
                             dtype=torch_dtype)
        profiles[role] = measure(engine, max_len, repeats=repeats).to_dict()
        decode = profiles[role]["decode"]
        typer.echo(f"{role} ({name}): prefill {profiles[role]['prefill']['mono']} "
                   f"decode {decode}")
    out.write_text(json.dumps(profiles, indent=1))
    typer.echo(f"wrote {out}")


def run(args: list[str]) -> int:
    """``rlharvest-coexecutor profile ARGS``: this command's exit code."""
    try:
        app(args=args, prog_name="rlharvest-coexecutor profile", standalone_mode=True)
    except SystemExit as done:
        return int(done.code or 0)
    return 0


if __name__ == "__main__":
    app()
