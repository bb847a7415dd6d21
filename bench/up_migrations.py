"""Migrations per completion under `rlharvest up --trainer` as a user runs it: the cost-aware
migration rule (the default) vs the paper's (`--migration-rule paper`, through RLH_MIGRATION_RULE).

The default stack (three torch workers of 64 slots, a manager and its standby, an agent, a trainer
of 64 samples a step) runs for `--seconds` under each rule in turn, `--rounds` times, a fresh stack
each time. After each run the leading manager's /metrics (found through etcd) give the executing-
case migrations and the completions, and the trainer's its applied steps. Here the paper's rule
moved about two requests per completion: the first worker holding a step's new weights takes all
64 requests, and each worker that joins idle gets all but B (1-3 on this CPU engine) from the
busiest, which is the one that just received them.

    python bench/up_migrations.py [--seconds 90] [--rounds 2] [--rules cost-aware,paper]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common import registry  # noqa: E402

from results_file import results_path  # noqa: E402

SAMPLE = re.compile(r"^(rlh_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$")


async def _members(endpoint: str) -> dict:
    client = await registry.connect(endpoint)
    try:
        return dict(await registry.list_members(client))
    finally:
        await client.close()


def scrape(endpoint: str) -> dict[str, float]:
    """Every member's samples of the series read here, summed over members (a standby's are
    zero)."""
    totals: dict[str, float] = {}
    for info in asyncio.run(_members(endpoint)).values():
        if not info.get("metrics"):
            continue
        text = urllib.request.urlopen(f"http://{info['metrics']}/metrics", timeout=5).read()
        for line in text.decode().splitlines():
            if (m := SAMPLE.match(line)) is not None:
                key = m.group(1) + (m.group(2) or "")
                totals[key] = totals.get(key, 0.0) + float(m.group(3))
    return totals


def run(rule: str, seconds: float) -> tuple[float, float, float]:
    """(executing migrations, completions, trainer steps) of one stack run under ``rule``."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"rlh-up-{rule}-"))
    env = {**os.environ, "RLH_MIGRATION_RULE": rule}
    up = subprocess.Popen([sys.executable, "-m", "rlharvest.cli.main", "up", "--trainer",
                           "--log-dir", str(log_dir / "logs")], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        endpoint = None
        assert up.stdout is not None
        for line in up.stdout:  # "rlharvest status --etcd HOST:PORT" once every member is up
            if (m := re.search(r"status --etcd (\S+)", line)) is not None:
                endpoint = m.group(1)
                break
        if endpoint is None:
            raise RuntimeError(f"rlharvest up ended before it was up (logs in {log_dir})")
        time.sleep(seconds)
        got = scrape(endpoint)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(120)
    return (got.get('rlh_manager_migrations_total{cause="executing"}', 0.0),
            got.get('rlh_manager_completions_total{outcome="finished"}', 0.0),
            got.get('rlh_trainer_steps_total{outcome="applied"}', 0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="each run, once it is up")
    parser.add_argument("--rounds", type=int, default=2, help="runs per rule, interleaved")
    parser.add_argument("--rules", default="cost-aware,paper")
    args = parser.parse_args()
    rules = args.rules.split(",")
    runs: dict[str, list[tuple[float, float, float]]] = {r: [] for r in rules}
    for _ in range(args.rounds):
        for rule in rules:  # interleaved: the box's load hits both alike
            runs[rule].append(run(rule, args.seconds))
            print(rule, runs[rule][-1], flush=True)
    lines = [f"`rlharvest up --trainer` (defaults), {args.rounds} run(s) of {args.seconds:.0f} s "
             "per rule, interleaved", "",
             "| migration rule | executing migrations | completions | per completion | "
             "trainer steps per run (mean) | steps vs the first rule |", "| --- | --- | --- | --- | --- | --- |"]
    base = sum(s for _, _, s in runs[rules[0]]) or 1.0
    for rule in rules:
        moved, done, steps = (sum(x[i] for x in runs[rule]) for i in range(3))
        lines.append(f"| {rule} | {moved:.0f} | {done:.0f} | {moved / max(done, 1):.2f} | "
                     f"{steps / args.rounds:.1f} | {steps / base:.2f}x |")
    print("\n".join(lines))
    results_path("up_migrations", False).write_text(
        "# Migrations per completion under `rlharvest up --trainer`\n\n"
        f"`python bench/up_migrations.py --seconds {args.seconds:.0f} --rounds {args.rounds} "
        f"--rules {args.rules}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
