"""The demo's serving co-executor (ROSE): production-like traffic on its OpenAI-compatible API
while the demo job borrows it for rollouts, and per RL step what that did to serving (SLO
attainment of the requests that finished in the step) and what the job harvested (rollout
tokens the co-executor generated in the step).

The traffic is a synthetic bursty trace (``rlharvest/sim/serving_trace.py``: a diurnal envelope compressed
to the run, Gamma inter-arrivals with CV 2, lognormal lengths) replayed open loop with
``loadgen.one_request``, which measures TTFT and TPOT at the client.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from rlharvest.common import observability
from rlharvest.cli.loadgen import RequestResult, fit_to_context, meets_slo, one_request
from rlharvest.sim.serving_trace import synthetic

_HARVEST_METRIC = "rlh_coexec_rollout_tokens_total"


@dataclass(frozen=True)
class StepServing:
    requests: int  # serving requests that finished during the step
    attained: int  # of which met both SLOs
    harvested_tokens: int  # rollout tokens the co-executor generated during the step

    @property
    def attainment(self) -> float | None:
        return self.attained / self.requests if self.requests else None


def rollout_tokens(metrics_port: int) -> int:
    """The co-executor's harvested rollout tokens so far (its Prometheus counter)."""
    return int(observability.sample(observability.scrape(f"127.0.0.1:{metrics_port}"),
                                    _HARVEST_METRIC))


class DemoServing:
    def __init__(self, url: str, metrics_port: int, model: str, *, slo_s: tuple[float, float],
                 seconds: float, rps: float, max_len: int = 128, seed: int = 0) -> None:
        self._url = url
        self._metrics_port = metrics_port
        self._model = model
        self._slo_s = slo_s
        self._trace = [fit_to_context(r, max_len) for r in synthetic(
            seconds, rps, seed=seed, max_tokens=max_len, prompt_median=max_len // 4,
            output_median=max_len // 8)]
        self._finished: list[tuple[float, RequestResult]] = []
        self._last_close = time.monotonic()
        self._last_tokens = 0
        self.steps: dict[int, StepServing] = {}

    async def run(self) -> None:
        """Replay the trace (until cancelled or done)."""
        start = time.monotonic()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def at_time(request) -> None:
                await asyncio.sleep(max(0.0, request.arrival - (time.monotonic() - start)))
                result = await one_request(http, self._url, self._model, request, 60.0)
                self._finished.append((time.monotonic(), result))

            await asyncio.gather(*(at_time(r) for r in self._trace))

    async def close_step(self, step: int) -> StepServing:
        """Step ``step`` just finished: what served and harvested since the previous one did."""
        now = time.monotonic()
        done = [r for at, r in self._finished if self._last_close <= at < now]
        met = sum(meets_slo(r, *self._slo_s) for r in done)
        tokens = await asyncio.to_thread(rollout_tokens, self._metrics_port)
        self.steps[step] = StepServing(len(done), met, tokens - self._last_tokens)
        self._last_close, self._last_tokens = now, tokens
        return self.steps[step]
