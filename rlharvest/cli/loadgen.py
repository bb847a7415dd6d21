"""`rlharvest-loadgen`: replay serving traffic against an OpenAI-compatible endpoint.

Open loop, as serving traffic is: each request is sent at its trace time whether or not earlier
ones have finished (a closed loop would slow down with the server and hide its queueing). The
trace is an Azure LLM inference trace CSV from a local file or a synthetic bursty one
(``rlharvest/sim/serving_trace.py``). Each request streams ``POST /v1/completions`` with token-id prompts
of the trace's length and ``ignore_eos`` with ``min_tokens = max_tokens`` = the trace's output
length (vLLM's extensions), so the server generates exactly what the trace says. Measured at the
client: TTFT (send to the first token) and TPOT ((last token - first token) / (n - 1)); printed
as P50/P99 and SLO attainment (both SLOs met). Bounded in requests and seconds; loopback by
default, as a benchmark tool should be.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import aiohttp
import typer

from rlharvest.sim.serving_trace import TraceError, TraceRequest, read_azure_csv, synthetic

_PROMPT_IDS = range(4, 40)  # ordinary tokens of every vocabulary this project serves


@dataclass
class RequestResult:
    arrival_s: float
    ok: bool
    ttft_s: float = float("nan")
    tpot_s: float = float("nan")
    tokens: int = 0
    error: str = ""


@dataclass
class LoadReport:
    sent: int
    failed: int
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    attainment: float  # requests meeting both SLOs / requests sent
    duration_s: float


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def meets_slo(result: RequestResult, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """Answered, first token within the TTFT SLO, and (two tokens or more) within the TPOT SLO."""
    return result.ok and result.ttft_s <= ttft_slo_s and (result.tokens < 2
                                                          or result.tpot_s <= tpot_slo_s)


def report(results: list[RequestResult], ttft_slo_s: float, tpot_slo_s: float,
           duration_s: float) -> LoadReport:
    ok = [r for r in results if r.ok]
    met = [r for r in ok if meets_slo(r, ttft_slo_s, tpot_slo_s)]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tokens >= 2]
    return LoadReport(len(results), len(results) - len(ok), quantile(ttft, 0.5),
                      quantile(ttft, 0.99), quantile(tpot, 0.5), quantile(tpot, 0.99),
                      len(met) / len(results) if results else 1.0, duration_s)


async def one_request(http: aiohttp.ClientSession, url: str, model: str, request: TraceRequest,
                      timeout_s: float) -> RequestResult:
    prompt = [_PROMPT_IDS[i % len(_PROMPT_IDS)] for i in range(request.prompt_tokens)]
    body = {"model": model, "prompt": prompt, "max_tokens": request.output_tokens,
            "min_tokens": request.output_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0}
    result = RequestResult(request.arrival, ok=False)
    sent = time.perf_counter()
    first = last = 0.0
    try:
        async with http.post(f"{url}/v1/completions", json=body,
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # one chunk per engine step, its text may be empty
                    last = time.perf_counter()
                    first = first or last
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.ok = first > 0 or result.tokens == 0
    result.ttft_s = first - sent if first else float("nan")
    if result.tokens >= 2:
        result.tpot_s = (last - first) / (result.tokens - 1)
    return result


async def replay(url: str, model: str, trace: list[TraceRequest], *, max_requests: int = 1000,
                 max_seconds: float = 300.0, timeout_s: float = 60.0) -> list[RequestResult]:
    """Send the trace's requests at their times (the first ``max_requests`` within
    ``max_seconds``); returns every one's result, in trace order."""
    chosen = [r for r in trace if r.arrival < max_seconds][:max_requests]
    start = time.perf_counter()
    limits = aiohttp.TCPConnector(limit=0)  # open loop: never queue at the client
    async with aiohttp.ClientSession(connector=limits) as http:
        async def at_time(request: TraceRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, request.arrival - (time.perf_counter() - start)))
            return await one_request(http, url, model, request, timeout_s)

        return list(await asyncio.gather(*(at_time(r) for r in chosen)))


def load_trace(trace: str, *, seconds: float, rps: float, density: float, seed: int,
               time_scale: float, length_scale: float, max_len: int) -> list:
    """The requests to replay: a synthetic trace, or an Azure-format CSV replayed
    ``time_scale`` times faster; ``density`` multiplies the arrival rate of either."""
    if density <= 0:
        raise TraceError(f"density must be > 0, got {density:g}")
    if trace == "synthetic":
        return synthetic(seconds, rps, seed=seed, density=density, max_tokens=max_len,
                         prompt_median=max_len // 4, output_median=max_len // 8)
    # A rate density times higher: arrival times density times closer (read_azure_csv divides
    # them by its time_scale).
    return read_azure_csv(trace, time_scale=time_scale * density, length_scale=length_scale,
                          max_tokens=max_len)


app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(url: str = typer.Option("http://127.0.0.1:8000", help="the server's base URL"),
         model: str = typer.Option(..., help="the model name the server serves"),
         trace: str = typer.Option("synthetic", help="'synthetic' or an Azure-format CSV file"),
         seconds: float = typer.Option(60.0, help="synthetic: trace length"),
         rps: float = typer.Option(1.0, help="synthetic: mean requests per second"),
         density: float = typer.Option(1.0, help="multiply the arrival rate"),
         seed: int = typer.Option(0),
         time_scale: float = typer.Option(1.0, help="CSV: replay this many times faster"),
         length_scale: float = typer.Option(1.0, help="CSV: scale prompt and output lengths"),
         max_len: int = typer.Option(256, help="cap prompt + output at the server's context"),
         max_requests: int = typer.Option(1000),
         max_seconds: float = typer.Option(300.0),
         ttft_slo_ms: float = typer.Option(500.0),
         tpot_slo_ms: float = typer.Option(150.0),
         out: Optional[Path] = typer.Option(None, help="write the report and every request "
                                            "as JSON")) -> None:
    try:
        requests = load_trace(trace, seconds=seconds, rps=rps, density=density, seed=seed,
                              time_scale=time_scale, length_scale=length_scale, max_len=max_len)
    except (TraceError, OSError) as exc:
        typer.echo(f"rlharvest-loadgen: {exc}", err=True)
        raise typer.Exit(2) from None
    requests = [fit_to_context(r, max_len) for r in requests]
    started = time.perf_counter()
    results = asyncio.run(replay(url, model, requests, max_requests=max_requests,
                                 max_seconds=max_seconds))
    summary = report(results, ttft_slo_ms / 1000, tpot_slo_ms / 1000,
                     time.perf_counter() - started)
    typer.echo(f"{summary.sent} requests, {summary.failed} failed, in {summary.duration_s:.1f} s")
    typer.echo(f"TTFT P50 {1000 * summary.ttft_p50_s:.1f} ms  P99 {1000 * summary.ttft_p99_s:.1f} "
               f"ms   TPOT P50 {1000 * summary.tpot_p50_s:.1f} ms  P99 "
               f"{1000 * summary.tpot_p99_s:.1f} ms   SLO attainment {summary.attainment:.1%} "
               f"(TTFT {ttft_slo_ms:g} ms, TPOT {tpot_slo_ms:g} ms)")
    errors = sorted({r.error for r in results if r.error})
    for error in errors[:5]:
        typer.echo(f"  error: {error}", err=True)
    if out is not None:
        out.write_text(json.dumps({"report": asdict(summary),
                                   "requests": [asdict(r) for r in results]}, indent=1))


def fit_to_context(request: TraceRequest, max_len: int) -> TraceRequest:
    """Prompt + output within the context: the output is cut first, down to one token."""
    output = max(1, min(request.output_tokens, max_len - 1 - min(request.prompt_tokens,
                                                                 max_len - 2)))
    return TraceRequest(request.arrival, min(request.prompt_tokens, max_len - 1 - output), output)


if __name__ == "__main__":
    app()
