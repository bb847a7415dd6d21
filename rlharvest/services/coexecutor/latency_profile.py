"""Latency profiles of one model on one device (ROSE §4.1): T̂_prf(L, m) and T̂_dec(b).

Prefill time is profiled as a function of prompt length L for two modes, ``mono`` (the whole
prompt in one forward; serving prefills) and ``chunk`` (rollout prefill in chunks of 512
tokens); decode time per engine step as a function of batch size b (the paper's T̂_dec ignores
context length, and so does this). Between profiled points the time is interpolated linearly;
past the last point the last segment is extended; below the first, the first segment (never
under zero).

Online correction (ours; the paper profiles offline only): each kind (prefill, decode) keeps a
multiplicative factor, an exponentially weighted mean of measured / predicted, so a profile
taken on a quieter box or another build drifts back to what the device does now.

Pure: no I/O. ``to_dict`` / ``from_dict`` are the JSON the ``profile`` subcommand writes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rlharvest.common.errors import InvalidArgument

PREFILL_MODES = ("mono", "chunk")
PROFILE_FORMAT = 1


class ProfileError(InvalidArgument, ValueError):
    """A profile that cannot be used; the message names the field."""


Points = tuple[tuple[int, float], ...]


def _check_points(what: str, points: Sequence[Sequence[float]]) -> Points:
    out = tuple((int(x), float(y)) for x, y in points)
    if not out:
        raise ProfileError(f"{what}: at least one (x, seconds) point is needed")
    xs = [x for x, _ in out]
    if any(x < 1 for x in xs) or xs != sorted(set(xs)):
        raise ProfileError(f"{what}: x must be >= 1 and strictly increasing, got {xs}")
    if any(not math.isfinite(y) or y < 0 for _, y in out):
        raise ProfileError(f"{what}: seconds must be finite and >= 0")
    return out


def _interpolate(points: Points, x: float) -> float:
    if len(points) == 1:
        x0, y0 = points[0]
        return y0 * x / x0  # one point: proportional
    i = min(max(bisect.bisect_left([p[0] for p in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class LatencyProfile:
    prefill: dict[str, Points]  # mode -> ((prompt tokens, seconds), ...)
    decode: Points  # ((batch size, seconds per step), ...)
    alpha: float = 0.2  # weight of each new measurement in the correction
    correction: dict[str, float] = field(default_factory=lambda: {"prefill": 1.0, "decode": 1.0})

    def __post_init__(self) -> None:
        missing = [m for m in PREFILL_MODES if m not in self.prefill]
        if missing:
            raise ProfileError(f"prefill profile lacks modes {missing}")
        self.prefill = {m: _check_points(f"prefill[{m}]", p) for m, p in self.prefill.items()}
        self.decode = _check_points("decode", self.decode)
        if not 0 < self.alpha <= 1:
            raise ProfileError(f"alpha must be in (0, 1], got {self.alpha}")

    @classmethod
    def linear(cls, *, prefill_base_s: float, prefill_per_token_s: float, decode_base_s: float,
               decode_per_seq_s: float, chunk_tokens: int = 512, max_tokens: int = 8192,
               max_batch: int = 256) -> LatencyProfile:
        """A profile of straight lines (tests, the simulator): prefill = base + per_token * L
        (chunked: that per chunk of ``chunk_tokens``), decode = base + per_seq * b."""
        lengths = sorted({1, chunk_tokens, max_tokens})
        mono = tuple((n, prefill_base_s + prefill_per_token_s * n) for n in lengths)
        chunk = tuple((n, math.ceil(n / chunk_tokens) * prefill_base_s + prefill_per_token_s * n)
                      for n in lengths)
        batches = sorted({1, max_batch})
        decode = tuple((b, decode_base_s + decode_per_seq_s * b) for b in batches)
        return cls({"mono": mono, "chunk": chunk}, decode)

    def prefill_s(self, tokens: int, mode: str = "mono") -> float:
        if mode not in self.prefill:
            raise ProfileError(f"prefill mode {mode!r} is not one of {PREFILL_MODES}")
        if tokens <= 0:
            return 0.0
        return _interpolate(self.prefill[mode], tokens) * self.correction["prefill"]

    def decode_s(self, batch: int) -> float:
        if batch <= 0:
            return 0.0
        return _interpolate(self.decode, batch) * self.correction["decode"]

    def observe_prefill(self, tokens: int, mode: str, measured_s: float) -> None:
        self._observe("prefill", self.prefill_s(tokens, mode) / self.correction["prefill"],
                      measured_s)

    def observe_decode(self, batch: int, measured_s: float) -> None:
        self._observe("decode", self.decode_s(batch) / self.correction["decode"], measured_s)

    def observe_step(self, executing: int, prefill_tokens: int, measured_s: float) -> None:
        """One measured engine step (a decode of ``executing`` requests, plus a monolithic
        prefill of ``prefill_tokens``): a pure decode step teaches the decode curve, a step that
        also prefilled teaches the prefill curve (its decode part predicted)."""
        if prefill_tokens:
            self.observe_prefill(prefill_tokens, "mono",
                                 max(0.0, measured_s - self.decode_s(executing)))
        elif executing:
            self.observe_decode(executing, measured_s)

    def _observe(self, kind: str, raw_s: float, measured_s: float) -> None:
        if raw_s <= 0 or not math.isfinite(measured_s) or measured_s < 0:
            return  # nothing to learn from a zero prediction or a broken measurement
        self.correction[kind] += self.alpha * (measured_s / raw_s - self.correction[kind])

    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT,
                "prefill": {m: [list(p) for p in pts] for m, pts in self.prefill.items()},
                "decode": [list(p) for p in self.decode]}

    @classmethod
    def from_dict(cls, data: Mapping) -> LatencyProfile:
        try:
            if data.get("format") != PROFILE_FORMAT:
                raise ProfileError(f"profile format {data.get('format')!r} is not "
                                   f"{PROFILE_FORMAT}; run the profile subcommand again")
            return cls({m: tuple(map(tuple, p)) for m, p in data["prefill"].items()},
                       tuple(map(tuple, data["decode"])))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ProfileError(f"malformed latency profile ({type(exc).__name__}: {exc})") \
                from None
