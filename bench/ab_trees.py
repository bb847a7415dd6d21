"""A/B one benchmark across two checkouts, interleaved: the code before a change vs after it.

A refactor must not cost speed, and on a noisy 2-core box only a same-run comparison says so.
This runs ``bench/<script>`` in checkout A, then in checkout B, then A again, ... ``--repeat``
times each, pulls one figure out of each run's output with ``--metric`` (a regex with one
group), and prints every pair, the per-round ratio B/A, and the median ratio with its spread.
Each checkout runs with itself first on PYTHONPATH, so each imports its own code (a checkout
older than the rlharvest/ link folder needs one made by hand: ``rlharvest/{common,services,sim}``
linking its top-level folders).

    git worktree add /tmp/before <rev>      # the "before" tree
    python bench/ab_trees.py --a /tmp/before --b . --script manager_relay.py \\
        --metric 'per manager CPU-second \\(one core\\) \\| ([\\d,]+)' --repeat 3 -- --quick --no-write
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path


def run_once(tree: Path, script: str, args: list[str], metric: re.Pattern[str]) -> float:
    # The tree first; what PYTHONPATH already holds (a GPU node's extra packages) after it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)}
    # A path names one script for both trees (one the "before" tree lacks); a bare name is
    # each tree's own bench/<name>.
    path = Path(script) if Path(script).is_absolute() else tree / "bench" / script
    out = subprocess.run([sys.executable, str(path), *args], cwd=tree,
                         env=env, capture_output=True, text=True, timeout=1800)
    found = metric.search(out.stdout)
    if out.returncode != 0 or found is None:
        raise SystemExit(f"{script} in {tree} exited {out.returncode} or printed no "
                         f"{metric.pattern!r}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return float(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="baseline checkout (before)")
    parser.add_argument("--b", type=Path, required=True, help="checkout under test (after)")
    parser.add_argument("--script", required=True, help="file name under bench/ (each tree's own), or an "
                        "absolute path (that one script run in both trees)")
    parser.add_argument("--metric", required=True, help="regex with one group: the figure")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("bench_args", nargs="*", help="arguments for the script (after --)")
    args = parser.parse_args()
    metric = re.compile(args.metric)
    a_tree, b_tree = args.a.resolve(), args.b.resolve()
    ratios = []
    print(f"{args.script} {' '.join(args.bench_args)}: A={a_tree} B={b_tree}")
    for k in range(args.repeat):
        a = run_once(a_tree, args.script, args.bench_args, metric)
        b = run_once(b_tree, args.script, args.bench_args, metric)
        ratios.append(b / a)
        print(f"round {k + 1}: A {a:,.3f}  B {b:,.3f}  B/A {b / a:.3f}", flush=True)
    print(f"median B/A = {statistics.median(ratios):.3f}  "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} rounds)")


if __name__ == "__main__":
    main()
