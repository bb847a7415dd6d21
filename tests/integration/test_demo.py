"""`make run` in miniature: the demo's CLI starts the whole local stack, trains a few steps with
a serving co-executor under traffic that the job borrows for rollouts and tail batching's short
and long rounds, and leaves its step table
and plot; a run that is too short to show learning is judged with the
rise check turned permissive (tests/unit/test_trainer_demo.py covers the check itself)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_the_demo_runs_a_few_steps_and_writes_its_table_and_plot(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "rlharvest.cli.demo", "--steps", "3", "--workers", "2",
         "--prompts", "2", "--samples", "4", "--preempt-at", "", "--backend", "torch",
         "--min-rise", "-1", "--timeout", "90", "--out", str(out), "--tail-batching", "1.5",
         "--kill-manager-at", "2", "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "one GRPO step per row" in result.stdout
    steps = json.loads((out / "steps.json").read_text())
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["tokens_per_second"] > 0 for s in steps)
    # The trainer runs Algorithm 1's cap (--instance-cap auto): one spot worker, so N_prem is 1.
    assert [s["n_prem"] for s in steps] == [1, 1, 1], steps
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The co-executor: per step, serving requests judged against the SLOs and rollout tokens
    # harvested there; the job did borrow it.
    assert all({"serving_requests", "serving_attained", "harvested_tokens"} <= set(s)
               for s in steps), steps
    assert all(0 <= s["serving_attained"] <= s["serving_requests"] for s in steps)
    assert sum(s["harvested_tokens"] for s in steps) > 0, steps
    assert "rollout tokens harvested on it" in result.stdout
    # Tail batching (eta 1.5 of 2 prompts): short rounds of 3 defer 1 each; two deferred make
    # the third step a long round of them.
    assert [(s["round"], s["prompts_launched"], s["prompts_deferred"]) for s in steps] == \
        [("short", 3, 1), ("short", 3, 1), ("long", 2, 0)], steps
    # --kill-manager-at 2: the leader died in step 2 (or 3: the tiny steps can pass between two
    # looks); its standby took over and the step went on there, nothing generated twice.
    assert any(e.startswith("SIGKILL the leading manager") for s in steps[1:]
               for e in s["events"]), result.stdout[-4000:]
    assert "tokens generated twice: 0" in result.stdout, result.stdout[-3000:]


def test_the_placed_demo_runs_two_jobs_on_one_worker_and_reports_the_switches(tmp_path):
    """`demo --placement-jobs 2`: two GRPO jobs take turns on one placed worker and one
    training node under the placement scheduler; both finish, and the worker switched jobs."""
    result = subprocess.run(
        [sys.executable, "-m", "rlharvest.cli.demo", "--placement-jobs", "2", "--steps", "3",
         "--timeout", "90", "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = " ".join(result.stdout.split())  # rich wraps long lines
    assert "job-a step 3" in out and "job-b step 3" in out, out[-2000:]
    switches = re.search(r"switched jobs (\d+) times warm .* and (\d+) cold", out)
    assert switches is not None, out[-2000:]
    assert int(switches.group(2)) == 2 and int(switches.group(1)) >= 1  # each job loaded once
