"""The demo's step time: `make run`'s whole local stack (every service a process), its median
seconds per GRPO step, so a change to any service's shell can be A/B'd on the path users run.

Runs ``python -m rlharvest.cli.demo`` in the checkout this script is started in (cwd), reads the
``steps.json`` it writes, and prints the median step time and its spread over the run's steps.
The first step is left out: it includes the workers' first weight pull.

    python bench/demo_steps.py [--steps 8] [-- <more demo flags>]
    python bench/ab_trees.py --a /tmp/before --b . --script $PWD/bench/demo_steps.py \\
        --metric 'median step s = ([\\d.]+)' --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _demo_module() -> str:
    """The demo's module in the checkout this runs in (before the package took its local
    tooling into rlharvest/cli, the demo lived among the services)."""
    return "rlharvest.cli.demo" if (Path.cwd() / "rlharvest" / "cli" / "demo.py").exists() \
        else "rlharvest.services.demo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("demo_args", nargs="*", help="more flags for the demo (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="demo-steps-") as tmp:
        out = Path(tmp)
        # --min-rise -1: the step time is the figure here, not whether 8 steps learned.
        run = subprocess.run([sys.executable, "-m", _demo_module(), "--steps",
                              str(args.steps), "--out", str(out / "out"), "--log-dir",
                              str(out / "logs"), "--min-rise", "-1", *args.demo_args],
                             capture_output=True, text=True, timeout=900)
        steps_file = out / "out" / "steps.json"
        if run.returncode != 0 or not steps_file.is_file():
            raise SystemExit(f"the demo exited {run.returncode}:\n{run.stdout[-3000:]}\n"
                             f"{run.stderr[-3000:]}")
        times = [s["step_time_s"] for s in json.loads(steps_file.read_text())][1:]
    print(f"{len(times)} steps: {', '.join(f'{t:.2f}' for t in times)}")
    print(f"median step s = {statistics.median(times):.3f} "
          f"(min {min(times):.3f}, max {max(times):.3f})")


if __name__ == "__main__":
    main()
