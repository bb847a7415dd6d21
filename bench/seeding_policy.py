"""RLBoost Algorithm 1 on simulated steps: the adaptive seeding window against its ablations.

The real controller (``rlharvest/services/trainer/seeding_window.py``) tunes T_seed and N_prem step by step
on the simulated plant of ``rlharvest/sim/seeding.py`` while remote instances come and go (RLBoost Fig. 12:
most instances preempted, then returning in stages, then a second loss). Compared on the same
trace and the same completion lengths, in one run:

- ``full``: Algorithm 1 as written (window, cap, memory);
- ``no-seeding``: T_seed = 0, all rollout on remote instances (co-located only when none is up);
- ``fixed``: T_seed fixed at its initial value;
- ``no-memory``: Algorithm 1 with the memory of line 12-14 cleared every step;
- ``co-located``: no remote instance at all (the veRL analogue).

Throughput is tokens trained per simulated second over the whole trace; each ratio is the median
over ``--seeds`` draws of the completion lengths, with its spread. Paper (Fig. 12): full /
no-seeding >= 1.2x, full / no-memory >= 1.05x. Then a sweep of 0-6 remote instances (Fig. 11).

    python bench/seeding_policy.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.sim.manager_policy import long_tail_lengths  # noqa: E402
from rlharvest.services.trainer.seeding_window import SeedingWindow  # noqa: E402
from rlharvest.sim.seeding import Plant, simulate_step  # noqa: E402
from rlharvest.sim.spot_trace import SEGMENTS, synthesize  # noqa: E402
from results_file import results_path  # noqa: E402

PLANT = Plant()
T_INIT = 2.0
ETA = 2.0  # Algorithm 1's adaptation rate (--eta)
VARIANTS = ("full", "no-seeding", "fixed", "no-memory", "co-located")


def fig12_trace(steps: int) -> list[int]:
    """Remote instances available per step: 1 of 6 after mass preemption, returning in stages,
    a second loss, and back (RLBoost Fig. 12's shape)."""
    stages = [(0.2, 1), (0.3, 2), (0.4, 4), (0.6, 6), (0.75, 2), (1.01, 6)]
    return [next(n for frac, n in stages if s < frac * steps) for s in range(steps)]


def run(variant: str, trace: list[int], seed: int, requests: int) -> tuple[float, list[float]]:
    """Tokens per simulated second over the trace, and T_seed per step."""
    window = SeedingWindow(n_resv=PLANT.n_resv, eta=ETA, t_init=T_INIT)
    tokens = seconds = 0.0
    windows = []
    for step, available in enumerate(trace):
        lengths = long_tail_lengths(requests, seed * 10_007 + step, median=64, max_tokens=1024)
        t_seed = {"no-seeding": 0.0, "fixed": T_INIT, "co-located": 0.0}.get(
            variant, window.schedule.t_seed)
        if variant == "co-located":
            n_remote = 0
        elif variant in ("full", "no-memory"):  # Algorithm 1's cap: at most N_prem instances
            n_remote = min(available, window.schedule.n_prem)
        else:
            n_remote = available
        n_next = trace[step + 1] if step + 1 < len(trace) else available  # n-hat
        result = simulate_step(lengths, t_seed, n_remote, PLANT, n_next=n_next)
        if result.timings.n_prem_mean == 0:  # co-located: the window is the whole rollout
            window.measured_full_rollout(result.rollout_s)
        if variant == "no-memory":
            window.memory.clear()
        window.observe(result.timings)
        tokens += result.tokens
        seconds += result.step_s
        windows.append(t_seed)
    return tokens / seconds, windows


def ratios(values: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
    r = sorted(x / y for x, y in zip(values[a], values[b]))
    return statistics.median(r), r[0], r[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 steps, 3 seeds")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=64, help="completions per step")
    parser.add_argument("--eta", type=float, default=2.0, help="Algorithm 1's adaptation rate")
    args = parser.parse_args()
    global ETA
    ETA = args.eta
    if args.quick:
        args.steps, args.seeds = 40, 3
    trace = fig12_trace(args.steps)
    throughput: dict[str, list[float]] = {v: [] for v in VARIANTS}
    windows: dict[str, list[float]] = {}
    for seed in range(args.seeds):  # variants interleaved per seed: the same lengths for all
        for variant in VARIANTS:
            tps, per_step = run(variant, trace, seed, args.requests)
            throughput[variant].append(tps)
            windows.setdefault(variant, per_step)
    lines = [f"# seeding_policy\n\n`python bench/seeding_policy.py{' --quick' if args.quick else ''}`"
             f" — {args.steps} steps, {args.requests} completions per step (log-normal, median 64,"
             f" cap 1024 tokens), {args.seeds} seeds, eta {ETA:g}, T_init {T_INIT:g} s; trace "
             f"{trace_summary(trace)} remote instances.\n",
             "| variant | tokens/s (median) | full / variant (median) | spread |",
             "| --- | ---: | ---: | ---: |"]
    for variant in VARIANTS:
        med, lo, hi = ratios(throughput, "full", variant)
        lines.append(f"| {variant} | {statistics.median(throughput[variant]):.0f} | {med:.3f} | "
                     f"{lo:.3f}–{hi:.3f} |")
    lines.append("\nT_seed per step (full, seed 0): " + ", ".join(
        f"{t:.1f}" for t in windows["full"]))
    lines += ["", "RLBoost Table 5's segments (synthesized with their mean instances, "
              "allocations and preemptions; `rlharvest/sim/spot_trace.py`), median full / variant [spread over seeds]:", "",
              "| segment | availability per step | full / no-seeding | full / no-memory | "
              "full / co-located |", "| --- | --- | ---: | ---: | ---: |"]
    for name in sorted(SEGMENTS):
        seg = synthesize(name, seed=0).per_step(args.steps)
        got = {v: [run(v, seg, s, args.requests)[0] for s in range(args.seeds)]
               for v in ("full", "no-seeding", "no-memory", "co-located")}
        lines.append(f"| {name} | {trace_summary(seg)} | " + " | ".join(
            "{:.3f} [{:.3f}–{:.3f}]".format(*ratios(got, "full", v))
            for v in ("no-seeding", "no-memory", "co-located")) + " |")
    lines += ["", "Constant availability (Fig. 11), full vs no-seeding, tokens/s:", "",
              "| remote instances | full | no-seeding | co-located | full / no-seeding |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    for n in range(7):
        sweep = {v: [run(v, [n] * (args.steps // 2), s, args.requests)[0]
                     for s in range(args.seeds)] for v in ("full", "no-seeding", "co-located")}
        med, lo, hi = ratios(sweep, "full", "no-seeding")
        lines.append(f"| {n} | {statistics.median(sweep['full']):.0f} | "
                     f"{statistics.median(sweep['no-seeding']):.0f} | "
                     f"{statistics.median(sweep['co-located']):.0f} | {med:.3f} "
                     f"[{lo:.3f}–{hi:.3f}] |")
    text = "\n".join(lines) + "\n"
    print(text)
    # --quick (what `make bench` runs) must not overwrite the full results the README cites.
    out = results_path("seeding_policy", args.quick)
    out.write_text(text)


def trace_summary(trace: list[int]) -> str:
    runs, start = [], 0
    for i in range(1, len(trace) + 1):
        if i == len(trace) or trace[i] != trace[start]:
            runs.append(f"{trace[start]} x{i - start}")
            start = i
    return ", ".join(runs)


if __name__ == "__main__":
    main()
