"""Shared by the benchmarks and the simulators: how a repeated ratio is printed (median and
spread)."""

from __future__ import annotations

import statistics


def spread(values: list[float], digits: int = 2) -> str:
    """``median x [min-max]`` of repeated ratios: the machines are noisy, so never one number."""
    return (f"{statistics.median(values):.{digits}f}x "
            f"[{min(values):.{digits}f}-{max(values):.{digits}f}]")
