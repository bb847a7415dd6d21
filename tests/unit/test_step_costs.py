"""tools/step_costs.py: it measures the torch engine's steps, fits the agentic
simulator's cost model to them, and prints a simulator command that runs."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("step_costs", ROOT / "tools" / "step_costs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fit_keeps_both_costs_non_negative():
    fit = _tool().fit
    # A step that does not grow with the batch: flat at its mean.
    assert fit({1: 0.027, 8: 0.027, 16: 0.021, 32: 0.021}) == (0.024, 0.0)
    intercept, slope = fit({256: 0.012, 512: 0.022, 1024: 0.042})  # an ordinary line
    assert abs(intercept - 0.002) < 1e-9 and abs(slope - 3.90625e-05) < 1e-12
    intercept, slope = fit({1: 0.001, 2: 0.003})  # a negative intercept: through the origin
    assert intercept == 0.0 and abs(slope - 0.0014) < 1e-12


def test_the_measured_fit_drives_the_simulator():
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "step_costs.py"), "--preset", "tiny", "--context",
         "48", "--prefills", "32", "64", "--batches", "1", "2", "--steps", "2", "--repeats", "1"],
        capture_output=True, text=True, timeout=120, check=True, cwd=ROOT)
    text = run.stdout
    fitted = json.loads(text[:text.rindex("}") + 1])
    assert set(fitted["decode_step_s"]) == {"1", "2"} and set(fitted["prefill_step_s"]) == {"32", "64"}
    costs = ("decode_s", "per_request_s", "prefill_token_s")
    assert all(fitted[cost] >= 0 for cost in costs) and fitted["decode_s"] + fitted[
        "per_request_s"] > 0
    command = shlex.split(text.strip().splitlines()[-1])
    assert command[:3] == ["python3", "-m", "rlharvest.sim.agentic"]
    sim = subprocess.run([sys.executable, *command[1:], "--trajectories", "8"],
                         capture_output=True, text=True, timeout=120, check=True, cwd=ROOT)
    modes = [line.split()[0] for line in sim.stdout.splitlines() if "makespan" in line]
    assert modes == ["pinned", "pinned-static", "turnwise", "turnwise+affinity"]
