"""`rlharvest-loadgen` against the co-executor's serving API on loopback: an open-loop replay of
a bursty trace, every request answered with exactly the trace's output length, TTFT and TPOT
measured at the client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from rlharvest.cli import loadgen
from rlharvest.cli.launcher import child_environment
from rlharvest.sim.serving_trace import TraceRequest, synthetic

from .test_openai_api import MODEL, serve


async def test_an_open_loop_replay_gets_every_request_at_its_trace_length():
    runner, backend, _, url = await serve(max_waiting=64)
    try:
        trace = [loadgen.fit_to_context(r, 64) for r in synthetic(3.0, 5.0, seed=2, max_tokens=64,
                                                        prompt_median=12, output_median=6)]
        results = await loadgen.replay(url, MODEL, trace, max_requests=30, max_seconds=3.0)
    finally:
        await runner.cleanup()
        await backend.close()
    assert len(results) == min(30, len(trace)) > 5
    assert all(r.ok for r in results), [r.error for r in results if r.error]
    assert [r.tokens for r in results] == [t.output_tokens for t in trace[:len(results)]]
    assert all(r.ttft_s > 0 for r in results)
    assert all(r.tpot_s > 0 for r in results if r.tokens >= 2)
    summary = loadgen.report(results, ttft_slo_s=10.0, tpot_slo_s=10.0, duration_s=3.0)
    assert summary.failed == 0 and summary.attainment == 1.0
    assert summary.ttft_p50_s <= summary.ttft_p99_s
    tight = loadgen.report(results, ttft_slo_s=1e-6, tpot_slo_s=10.0, duration_s=3.0)
    assert tight.attainment == 0.0


def test_refused_requests_count_as_failed_not_as_fast():
    ok = loadgen.RequestResult(0.0, True, ttft_s=0.1, tpot_s=0.01, tokens=5)
    refused = loadgen.RequestResult(0.5, False, error="HTTP 503: full")
    summary = loadgen.report([ok, refused], ttft_slo_s=1.0, tpot_slo_s=1.0, duration_s=1.0)
    assert summary.failed == 1 and summary.attainment == 0.5
    assert loadgen.fit_to_context(TraceRequest(0.0, 500, 500), 256) == TraceRequest(0.0, 254, 1)


def test_the_cli_names_a_bad_trace_file_and_exits_2(tmp_path):
    bad = tmp_path / "trace.csv"
    bad.write_text("a,b\n1,2\n")
    done = subprocess.run([sys.executable, "-m", "rlharvest.cli.loadgen", "--model", "m",
                           "--trace", str(bad), "--out", str(tmp_path / "o.json")],
                          capture_output=True, text=True, env=child_environment(), timeout=60)
    assert done.returncode == 2 and "Azure LLM inference trace format" in done.stderr
    assert not (tmp_path / "o.json").exists()


async def test_the_cli_replays_a_synthetic_trace_and_writes_its_report(tmp_path):
    runner, backend, _, url = await serve(max_waiting=64)
    try:
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rlharvest.cli.loadgen", "--url", url, "--model", MODEL,
            "--seconds", "2", "--rps", "4", "--max-len", "48", "--out", str(tmp_path / "r.json"),
            env=child_environment(), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(cli.communicate(), 120)
    finally:
        await runner.cleanup()
        await backend.close()
    assert cli.returncode == 0, stderr.decode()
    assert "SLO attainment" in stdout.decode()
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["report"]["sent"] == len(written["requests"]) > 0
    assert written["report"]["failed"] == 0
