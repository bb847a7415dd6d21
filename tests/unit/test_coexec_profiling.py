"""Latency profiles measured on a real engine, written by the profiling command and loaded by
the co-executor instead of measuring at start."""

from __future__ import annotations

import json
import subprocess
import sys

from rlharvest.services.coexecutor.config import CoexecutorConfig
from rlharvest.services.coexecutor.latency_profile import LatencyProfile
from rlharvest.services.coexecutor.main import build_dual
from rlharvest.services.coexecutor.profiling import measure
from rlharvest.cli.launcher import child_environment
from rlharvest.services.rollout_worker.torch_engine import TorchEngine


def test_a_measured_profile_has_every_asked_point_and_leaves_the_engine_idle():
    engine = TorchEngine("tiny", max_running=16, max_len=128)
    profile = measure(engine, 128, lengths=(8, 120), batches=(1, 16), repeats=3)
    assert not engine.has_work()
    assert [n for n, _ in profile.prefill["mono"]] == [8, 120]
    assert [b for b, _ in profile.decode] == [1, 16]
    assert all(seconds > 0 for _, seconds in (*profile.prefill["mono"], *profile.decode))


def test_the_profile_subcommand_writes_what_the_coexecutor_loads(tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "rlharvest.services.coexecutor.main", "profile",
                           "--serving-model", "tiny", "--model", "tiny", "--max-len", "64",
                           "--repeats", "1", "--out", str(out)], capture_output=True,
                          text=True, env=child_environment(), timeout=120)
    assert done.returncode == 0, done.stderr
    written = json.loads(out.read_text())
    dual = build_dual(CoexecutorConfig(serving_model="tiny", model="tiny", max_len=64,
                                       profile=str(out)), deliver=lambda outputs: None)
    serving = LatencyProfile.from_dict(written["serving"])
    assert dual.scheduler.admission.profile.decode == serving.decode
    assert dual.rollout_profile.prefill == LatencyProfile.from_dict(written["rollout"]).prefill


def test_the_profile_subcommand_refuses_bad_input_and_is_listed_in_the_help():
    bad = subprocess.run([sys.executable, "-m", "rlharvest.services.coexecutor.main", "profile",
                          "--max-len", "2", "--out", "x.json"], capture_output=True, text=True,
                         env=child_environment(), timeout=120)
    assert bad.returncode == 2 and "--max-len" in bad.stderr
    shown = subprocess.run([sys.executable, "-m", "rlharvest.services.coexecutor.main", "--help"],
                           capture_output=True, text=True, env=child_environment(), timeout=120)
    assert shown.returncode == 0 and "rlharvest-coexecutor profile" in shown.stdout
