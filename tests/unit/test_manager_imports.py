"""The control plane imports without torch: the manager, the simulator and the benchmarks that
only need the control plane run on machines without it (wire-neutral types live in common/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTROL_PLANE = [
    "rlharvest.services.rollout_manager.service",
    "rlharvest.services.rollout_manager.client",
    "rlharvest.services.rollout_manager.main",
    "rlharvest.sim.manager_policy",
    "rlharvest.sim.cluster",
    "rlharvest.sim.optimum",
    "rlharvest.sim.baselines",
    "rlharvest.sim.workloads",
    "bench.manager_policy",
    "bench.manager_relay",
    "bench.manager_relay_worker",
    "bench.manager_scale",
    "bench.manager_scale_workers",
    "bench.manager_preemption",
    "bench.manager_longtail",
]


def test_the_manager_the_simulator_and_the_control_plane_benchmarks_import_without_torch():
    # A fresh interpreter: this one may have imported torch for other tests.
    check = ("import importlib, sys\n"
             f"for name in {CONTROL_PLANE!r}:\n"
             "    importlib.import_module(name)\n"
             "    assert 'torch' not in sys.modules, f'{name} imports torch'\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _imports(path: Path) -> set[str]:
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_no_service_imports_the_local_tooling_or_a_benchmark():
    # rlharvest.cli (up, the demos, the launcher) drives the services; they never need it, nor
    # anything under bench/
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for top in ("services", "common", "sim")
                 for path in sorted((ROOT / "rlharvest" / top).rglob("*.py"))
                 if "pb" not in path.parts
                 for name in _imports(path)
                 if name.startswith(("rlharvest.cli", "bench"))]
    assert not offenders, offenders


# The manager's optional features and its step policies; they plug in behind ManagerObserver
# (observer.py) and StepPolicy (step_policy.py), and main.py declares which run.
MANAGER_FEATURES = ("stream_scaler", "stream_scaling", "stream_accounting", "tp_planner",
                    "tp_publisher", "tp_accounting", "lender", "lending", "seed_window",
                    "reattach", "tail_batching")


def test_the_managers_shell_names_no_optional_feature():
    shell = ROOT / "rlharvest" / "services" / "rollout_manager"
    named = [f"{name} in {path}" for path in ("service.py", "workers.py", "status.py")
             for name in _imports(shell / path)
             if name.rsplit(".", 1)[-1] in MANAGER_FEATURES]
    assert not named, named


def test_nothing_in_production_imports_or_holds_a_benchmark():
    # bench/ may import production, never the reverse: no module of the package imports bench/
    # or a module named for a benchmark, and none is named so (what production needs of a
    # benchmark's tools lives in a production module named for what it does).
    production = [path for path in sorted((ROOT / "rlharvest").rglob("*.py"))
                  if "pb" not in path.parts]
    named = [str(path.relative_to(ROOT)) for path in production
             if path.stem.startswith("bench") or path.stem.endswith("_harness")]
    imports = [f"{path.relative_to(ROOT)} imports {name}" for path in production
               for name in _imports(path)
               if any(part == "bench" or part.startswith("bench_") or part.endswith("_harness")
                      for part in name.split("."))]
    assert not named and not imports, named + imports
