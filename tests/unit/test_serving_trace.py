"""Serving traces: the synthetic one has the published shape; Azure-format files replay."""

from __future__ import annotations

import statistics

import pytest

from rlharvest.sim.serving_trace import (
    TraceError,
    peak_to_mean,
    read_azure_csv,
    synthetic,
)


def test_the_synthetic_trace_is_bursty_with_a_diurnal_peak_and_the_asked_rate():
    trace = synthetic(600, 5.0, seed=3, cv=2.0)
    assert 0.85 * 3000 < len(trace) < 1.15 * 3000
    gaps = [b.arrival - a.arrival for a, b in zip(trace, trace[1:])]
    assert statistics.stdev(gaps) / statistics.mean(gaps) > 1.3  # second-level bursts
    assert 1.4 < peak_to_mean(trace, 60) < 2.1  # the diurnal envelope, minute windows
    assert peak_to_mean(trace, 1) > 4  # per-second peaks far above the mean (ROSE: 4.22x)
    assert all(1 <= r.prompt_tokens < 2048 and 1 <= r.output_tokens < 2048 for r in trace)
    assert synthetic(600, 5.0, seed=3) == trace  # seeded


def test_density_scales_the_arrivals_not_the_lengths():
    base, dense = synthetic(300, 4.0, seed=1), synthetic(300, 4.0, seed=1, density=2.0)
    assert 1.7 < len(dense) / len(base) < 2.3
    assert abs(statistics.median(r.prompt_tokens for r in dense)
               - statistics.median(r.prompt_tokens for r in base)) < 40


def test_an_azure_trace_file_replays_relative_scaled_and_clamped(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2024-05-10 00:00:10.0039210,100,20\n"
                    "2024-05-10 00:00:00.0039210,4000,300\n"
                    "2024-05-10 00:00:30.5039210,7,0\n")
    trace = read_azure_csv(path, time_scale=10, length_scale=0.5, max_tokens=1024)
    assert [round(r.arrival, 3) for r in trace] == [0.0, 1.0, 3.05]
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [(1023, 150), (50, 10), (4, 1)]
    assert len(read_azure_csv(path, limit=2)) == 2


def test_bad_trace_files_and_settings_are_refused_with_the_place(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(TraceError, match="Azure LLM inference trace format"):
        read_azure_csv(bad)
    broken = tmp_path / "broken.csv"
    broken.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,ten,3\n")
    with pytest.raises(TraceError, match=r"broken.csv:2"):
        read_azure_csv(broken)
    with pytest.raises(TraceError, match="peak_to_mean"):
        synthetic(60, 1.0, peak_to_mean=2.5)


def test_loadgen_density_multiplies_the_arrival_rate_of_a_trace_file(tmp_path):
    from rlharvest.cli.loadgen import load_trace

    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2024-05-10 00:00:{10 * i:02d}.0,100,20\n" for i in range(5)))
    given = dict(seconds=0, rps=0, seed=0, time_scale=1.0, length_scale=1.0, max_len=1024)
    assert [r.arrival for r in load_trace(str(path), density=1, **given)] == [0, 10, 20, 30, 40]
    assert [r.arrival for r in load_trace(str(path), density=2, **given)] == [0, 5, 10, 15, 20]
    with pytest.raises(TraceError, match="density must be > 0"):
        load_trace(str(path), density=0, **given)
