"""Serving traffic traces (ROSE §2.1, §6): what a serving device's users send.

Two sources, one form (``TraceRequest``: arrival second, prompt and output tokens):

- ``read_azure_csv``: the Azure LLM inference trace format (``TIMESTAMP,ContextTokens,
  GeneratedTokens``; ROSE's "24-h Microsoft trace" is the 2024 release of it), from a local file
  (nothing is downloaded), arrivals relative to the first, with time and length scaling;
- ``synthetic``: bursty traffic with the published shape when no trace file is at hand — a
  diurnal envelope whose peak is ``peak_to_mean`` (1.7, the paper's minute-level figure) times
  the mean, compressed into ``duration_s``; Gamma inter-arrivals with a coefficient of variation
  over 1 (BurstGPT-style second-level bursts); lognormal prompt and output lengths.

``density`` multiplies the arrival rate (ROSE App. D's 1x/1.5x/2x). Pure and seeded.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rlharvest.common.errors import InvalidArgument


class TraceError(InvalidArgument, ValueError):
    """A trace file or setting that cannot be replayed; the message says where."""


@dataclass(frozen=True, order=True)
class TraceRequest:
    arrival: float  # seconds from the trace's start
    prompt_tokens: int
    output_tokens: int


def synthetic(duration_s: float, mean_rps: float, *, seed: int = 0, peak_to_mean: float = 1.7,
              cv: float = 2.0, prompt_median: int = 256, output_median: int = 128,
              sigma: float = 0.8, max_tokens: int = 2048, density: float = 1.0,
              ) -> list[TraceRequest]:
    """Requests over ``duration_s`` seconds at ``mean_rps * density`` per second on average."""
    checks = {"duration_s": duration_s > 0, "mean_rps": mean_rps > 0, "cv": cv > 0,
              "peak_to_mean": 1 <= peak_to_mean < 2, "density": density > 0,
              "max_tokens": max_tokens >= 2, "sigma": sigma >= 0}
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise TraceError(f"synthetic trace setting {bad[0]} is out of range (duration_s, "
                         "mean_rps, cv, density > 0; peak_to_mean in [1, 2); max_tokens >= 2)")
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)  # Gamma(k, theta): CV = 1 / sqrt(k)
    swing = peak_to_mean - 1.0  # rate(t) = mean * (1 + swing * sin(...)): peak / mean as asked
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        rate = mean_rps * density * (1 + swing * math.sin(2 * math.pi * t / duration_s))
        t += rng.gammavariate(shape, 1.0 / (shape * rate))
        if t >= duration_s:
            return out
        out.append(TraceRequest(t, _length(rng, prompt_median, sigma, max_tokens - 1),
                                _length(rng, output_median, sigma, max_tokens - 1)))


def _length(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def read_azure_csv(path: str | Path, *, time_scale: float = 1.0, length_scale: float = 1.0,
                   max_tokens: int = 2048, limit: int = 0) -> list[TraceRequest]:
    """The Azure LLM inference trace's rows as requests: arrivals relative to the first row,
    divided by ``time_scale`` (10: ten times faster), lengths times ``length_scale``, each
    clamped to [1, max_tokens - 1]; ``limit`` rows at most (0: all)."""
    if time_scale <= 0 or length_scale <= 0:
        raise TraceError("time_scale and length_scale must be > 0")
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need <= set(reader.fieldnames or ()):
            raise TraceError(f"{path}: the header must have {sorted(need)} (the Azure LLM "
                             f"inference trace format), got {reader.fieldnames}")
        for line, row in enumerate(reader, start=2):
            try:
                rows.append((_seconds(row["TIMESTAMP"]), int(row["ContextTokens"]),
                             int(row["GeneratedTokens"])))
            except ValueError as exc:
                raise TraceError(f"{path}:{line}: {exc}") from None
            if limit and len(rows) >= limit:
                break
    if not rows:
        raise TraceError(f"{path} has no requests")
    start = min(t for t, _, _ in rows)
    cap = max_tokens - 1
    return sorted(TraceRequest((t - start) / time_scale,
                               max(1, min(cap, round(p * length_scale))),
                               max(1, min(cap, round(g * length_scale))))
                  for t, p, g in rows)


def _seconds(stamp: str) -> float:
    """A TIMESTAMP: seconds as a number, or a datetime (the Azure files' '2024-05-10
    00:00:00.0039210' has 7 fractional digits, one more than fromisoformat takes)."""
    try:
        return float(stamp)
    except ValueError:
        pass
    head, dot, frac = stamp.strip().partition(".")
    return datetime.fromisoformat(head).timestamp() + (float("0." + frac) if dot else 0.0)


def peak_to_mean(requests: Sequence[TraceRequest], window_s: float) -> float:
    """The busiest window's arrivals over the mean window's (a trace's burstiness)."""
    if not requests:
        return 0.0
    end = max(r.arrival for r in requests)
    windows = max(1, math.ceil(end / window_s))
    counts = [0] * windows
    for r in requests:
        counts[min(windows - 1, int(r.arrival // window_s))] += 1
    return max(counts) / (len(requests) / windows)
