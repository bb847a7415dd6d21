"""Provisioning cost and SLO attainment of WEAVE's placement vs. the optimum and baselines
(WEAVE §6.4–§6.5).

1. Static batches (all jobs concurrent) vs. the brute-force optimum, per Table 6 workload at
   residency 5, then the mixed workload at max group residency 2..5 (Fig. 15a, 15c; paper:
   WEAVE 1.01–1.12x of optimal, 100% SLO).
2. An online trace at the density of the paper's Philly segment (300 jobs in 580 h, mean
   14.4 h), residency 2..5, against the optimum under both readings of §6.5, each run on its
   own timeline: re-placing every alive job at each arrival only, or at each arrival and
   departure (migrations free).
3. An SLO sweep (1.2, 1.5, 2.0, U(1,2)) of the same trace at residency 5.
4. A rollout-heavy production-like trace (~17 concurrent jobs, mean duration 28 h): WEAVE vs.
   solo disaggregation, the paper's 1.84x.
5. The heavy mixed load of earlier versions, at worst-case and at actual durations.

Every policy is priced on its own timeline: its total $ for the same trace (the same work), with
its time-averaged $/h beside it. Traces repeat over seeds; cells are the median [min–max].
"WEAVE c/w" is Algorithm 1 with our cost-per-work admission objective (``Objective``).

    python bench/placement_cost.py [--quick] [--seeds N]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence

from rlharvest.sim.ratios import spread  # noqa: E402

from rlharvest.services.placement_scheduler.inter_group import Objective  # noqa: E402
from rlharvest.services.placement_scheduler.model import H20, H800, Job, PoolSpec  # noqa: E402
from rlharvest.sim import baselines, cluster, optimum, workloads  # noqa: E402
from results_file import results_path  # noqa: E402

RESIDENCIES = (2, 3, 4, 5)
PHILLY_INTERARRIVAL_S = 580 * 3600 / 300  # §6.5: 300 jobs over a 580-hour trace segment
PRODUCTION = dict(workload="rollout_heavy", mean_duration_s=28 * 3600,
                  mean_interarrival_s=28 * 3600 / 17)  # Little: 17 concurrent on average
SLOS: dict[str, tuple[float, float]] = {"1.2": (1.2, 1.2), "1.5": (1.5, 1.5),
                                        "2.0": (2.0, 2.0), "U(1,2)": (1.0, 2.0)}
Factory = Callable[[int, int], baselines.Placer]  # (residency, seed) -> a fresh policy


def _pools(residency: int) -> tuple[PoolSpec, PoolSpec]:
    return workloads.pools(residency, H20, H800)


POLICIES: dict[str, Factory] = {
    "WEAVE": lambda res, seed: baselines.Weave(*_pools(res)),
    "WEAVE c/w": lambda res, seed: baselines.Weave(*_pools(res), Objective.COST_PER_WORK),
    "WEAVE consol": lambda res, seed: baselines.Weave(*_pools(res), consolidate=True),
    "Random": lambda res, seed: baselines.RandomPlacer(*_pools(res), seed),
    "Greedy": lambda res, seed: baselines.MostIdlePlacer(*_pools(res)),
    "Solo-D": lambda res, seed: baselines.SoloDisaggregation(*_pools(res)),
}
OPTIMA: dict[str, Factory] = {
    "Opt arrivals": lambda res, seed: optimum.OptimumPlacer(*_pools(res), False),
    "Opt regrouped": lambda res, seed: optimum.OptimumPlacer(*_pools(res), True),
}


def _cell(values: Sequence[float]) -> str:
    return spread(list(values)) if len(values) > 1 else f"{values[0]:.2f}x"


# --- 1. static batches vs. the brute-force optimum --------------------------------------------
STATIC = ("WEAVE", "WEAVE batch", "WEAVE c/w", "Random", "Greedy")


def _static_row(batches: Sequence[Sequence[Job]], residency: int) -> dict[str, list]:
    """Per policy: (cost / optimum, SLO attainment) per batch. "WEAVE batch" admits the batch
    in the order ``batch_order`` finds cheapest (``--admission-window-s``), the others in the
    batch's own order."""
    rows: dict[str, list] = {p: [] for p in STATIC}
    for seed, jobs in enumerate(batches):
        best = optimum.offline_optimum(jobs, *_pools(residency))
        for p in STATIC:
            make = POLICIES["WEAVE" if p == "WEAVE batch" else p]
            order = make(residency, seed).scheduler.batch_order(jobs) \
                if p == "WEAVE batch" else jobs
            r = cluster.static_cost(order, lambda make=make: make(residency, seed))
            rows[p].append((r.cost_per_hour / best, r.slo_attainment))
    return rows


def _static_table(first: str, rows: dict[str, dict[str, list]]
                  ) -> tuple[str, dict[str, list[float]]]:
    """The table, and WEAVE's cost / optimum of every batch in it (in arrival order, and in
    batch order)."""
    lines = [f"| {first} | " + " | ".join(f"{p} mean / max (SLO)" for p in STATIC) + " |",
             "|---" * (len(STATIC) + 1) + "|"]
    for label, row in rows.items():
        cells = [f"{statistics.mean(s[0] for s in row[p]):.2f}x / "
                 f"{max(s[0] for s in row[p]):.2f}x ({statistics.mean(s[1] for s in row[p]):.0%})"
                 for p in STATIC]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines), {p: [s[0] for row in rows.values() for s in row[p]]
                              for p in ("WEAVE", "WEAVE batch")}


def by_workload(n_jobs: int, seeds: int) -> tuple[str, dict[str, list[float]]]:
    rows = {w: _static_row([workloads.static_jobs(n_jobs, w, s) for s in range(seeds)], 5)
            for w in workloads.WORKLOADS}
    return _static_table(f"workload ({n_jobs} jobs, {seeds} seeds, residency 5)", rows)


def by_residency(n_jobs: int, seeds: int) -> tuple[str, dict[str, list[float]]]:
    batches = [workloads.static_jobs(n_jobs, "mixed", s) for s in range(seeds)]
    rows = {str(r): _static_row(batches, r) for r in RESIDENCIES}
    return _static_table(f"residency (mixed, {n_jobs} jobs, {seeds} seeds)", rows)


# --- 2-4. traces, each policy on its own timeline ---------------------------------------------
def _runs(traces: Sequence[Sequence[workloads.SimJob]], residency: int,
          policies: dict[str, Factory]) -> dict[str, list[cluster.SimResult]]:
    """Every policy on every trace (policies interleaved per trace)."""
    runs: dict[str, list[cluster.SimResult]] = {p: [] for p in policies}
    for seed, trace in enumerate(traces):
        for p, make in policies.items():
            runs[p].append(cluster.simulate(trace, lambda make=make: make(residency, seed)))
    return runs


def _ratio(runs: dict[str, list[cluster.SimResult]], num: str, den: str) -> str:
    return _cell([a.total_cost / b.total_cost for a, b in zip(runs[num], runs[den])])


def _slo(results: list[cluster.SimResult]) -> str:
    return f"{statistics.mean(r.slo_attainment for r in results):.0%}"


def versus_optima(n_jobs: int, seeds: int) -> tuple[str, list[float]]:
    head = ["residency", "most concurrent", "WEAVE / Opt arrivals", "WEAVE / Opt regrouped",
            "WEAVE consol / Opt arrivals · regrouped (moves)", "WEAVE c/w / Opt arrivals",
            "Opt arrivals / Opt regrouped", "Solo-D / WEAVE", "$/h WEAVE · Opt arrivals",
            "SLO WEAVE · consol · c/w · Random · Greedy"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    ours: list[float] = []
    consol: list[list[float]] = []
    for res in RESIDENCIES:
        traces = [workloads.poisson_jobs(n_jobs, "mixed", s, PHILLY_INTERARRIVAL_S)
                  for s in range(seeds)]
        runs = _runs(traces, res, {**POLICIES, **OPTIMA})
        ours += [w.total_cost / o.total_cost
                 for w, o in zip(runs["WEAVE"], runs["Opt arrivals"])]
        crowd = max(len(s.job_ids) for r in runs["WEAVE"] for s in r.timeline)
        rate = (f"{statistics.median(r.mean_cost_per_hour for r in runs['WEAVE']):,.0f} · "
                f"{statistics.median(r.mean_cost_per_hour for r in runs['Opt arrivals']):,.0f}")
        slos = " · ".join(_slo(runs[p]) for p in ("WEAVE", "WEAVE consol", "WEAVE c/w",
                                                   "Random", "Greedy"))
        consol.append([c.total_cost / o.total_cost
                       for c, o in zip(runs["WEAVE consol"], runs["Opt arrivals"])])
        moves = statistics.median(r.moves for r in runs["WEAVE consol"])
        lines.append(f"| {res} | {crowd} | **{_ratio(runs, 'WEAVE', 'Opt arrivals')}** | "
                     f"{_ratio(runs, 'WEAVE', 'Opt regrouped')} | "
                     f"**{_ratio(runs, 'WEAVE consol', 'Opt arrivals')}** · "
                     f"{_ratio(runs, 'WEAVE consol', 'Opt regrouped')} ({moves:.0f}) | "
                     f"{_ratio(runs, 'WEAVE c/w', 'Opt arrivals')} | "
                     f"{_ratio(runs, 'Opt arrivals', 'Opt regrouped')} | "
                     f"{_ratio(runs, 'Solo-D', 'WEAVE')} | {rate} | {slos} |")
    flat = [r for per_res in consol for r in per_res]
    lines += ["", f"WEAVE consol / Opt arrivals: {min(flat):.2f}–{max(flat):.2f}x over every "
                  "residency and seed."]
    return "\n".join(lines), ours


def slo_sweep(n_jobs: int, seeds: int) -> str:
    head = ["SLO", "WEAVE / Opt arrivals", "WEAVE consol / Opt arrivals",
            "WEAVE c/w / Opt arrivals", "Solo-D / WEAVE", "Solo-D / WEAVE c/w", "WEAVE slowdown",
            "SLO met WEAVE · consol · c/w"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    policies = {p: POLICIES[p] for p in ("WEAVE", "WEAVE consol", "WEAVE c/w", "Solo-D")}
    for label, slo in SLOS.items():
        traces = [workloads.poisson_jobs(n_jobs, "mixed", s, PHILLY_INTERARRIVAL_S,
                                         slo_range=slo) for s in range(seeds)]
        runs = _runs(traces, 5, {**policies, "Opt arrivals": OPTIMA["Opt arrivals"]})
        slowdown = statistics.median(r.mean_slowdown for r in runs["WEAVE"])
        lines.append(f"| {label} | **{_ratio(runs, 'WEAVE', 'Opt arrivals')}** | "
                     f"**{_ratio(runs, 'WEAVE consol', 'Opt arrivals')}** | "
                     f"{_ratio(runs, 'WEAVE c/w', 'Opt arrivals')} | "
                     f"{_ratio(runs, 'Solo-D', 'WEAVE')} | {_ratio(runs, 'Solo-D', 'WEAVE c/w')} "
                     f"| {slowdown:.2f} | {_slo(runs['WEAVE'])} · {_slo(runs['WEAVE consol'])} · "
                     f"{_slo(runs['WEAVE c/w'])} |")
    return "\n".join(lines)


def production(n_jobs: int, seeds: int) -> tuple[str, list[float]]:
    """The rollout-heavy trace; the arrival-only optimum on seed 0's timeline only (with ~20
    rollout-heavy jobs alive one trace takes ~50 s; 200 jobs, whose crowds reach 25+, did not
    finish in 10 minutes)."""
    traces = [workloads.poisson_jobs(n_jobs, PRODUCTION["workload"], s,
                                     PRODUCTION["mean_interarrival_s"],
                                     PRODUCTION["mean_duration_s"]) for s in range(seeds)]
    policies = POLICIES
    runs = _runs(traces, 5, policies)
    best = cluster.simulate(traces[0], lambda: OPTIMA["Opt arrivals"](5, 0))
    crowd = statistics.median(
        statistics.fmean(len(s.job_ids) for s in r.timeline) for r in runs["WEAVE"])
    lines = [f"Mean alive jobs {crowd:.1f} (time-weighted over stretches: see the timeline).",
             "", "| policy | Solo-D / it (total $) | $/h | SLO met | slowdown | "
             "isolated / packed / scaled |", "|---" * 6 + "|"]
    for p in policies:
        mix = runs[p][0].strategies
        rate = statistics.median(r.mean_cost_per_hour for r in runs[p])
        slowdown = statistics.median(r.mean_slowdown for r in runs[p])
        lines.append(f"| {p} | **{_ratio(runs, 'Solo-D', p)}** | {rate:,.0f} | "
                     f"{_slo(runs[p])} | {slowdown:.2f} | {mix['isolated']} / "
                     f"{mix['direct_packing']} / {mix['rollout_scaling']} |")
    saving = [s.total_cost / w.total_cost for s, w in zip(runs["Solo-D"], runs["WEAVE"])]
    vs_opt = {p: runs[p][0].total_cost / best.total_cost for p in ("Solo-D", "WEAVE",
                                                                     "WEAVE consol", "WEAVE c/w")}
    moves = statistics.median(r.moves for r in runs["WEAVE consol"])
    lines += ["", f"Opt arrivals on seed 0: Solo-D / Opt **{vs_opt['Solo-D']:.2f}x**, WEAVE / "
                  f"Opt {vs_opt['WEAVE']:.2f}x, WEAVE consol / Opt {vs_opt['WEAVE consol']:.2f}x "
                  f"({moves:.0f} moves), WEAVE c/w / Opt {vs_opt['WEAVE c/w']:.2f}x "
                  f"(SLO {best.slo_attainment:.0%})."]
    return "\n".join(lines), saving


def heavy(n_jobs: int, seed: int, actual_range: tuple[float, float] | None = None,
          tail_range: tuple[float, float] | None = None, slots: int = 1) -> str:
    jobs = workloads.poisson_jobs(n_jobs, "mixed", seed, mean_interarrival_s=600,
                                  actual_range=actual_range, tail_range=tail_range)
    results = {p: cluster.simulate(jobs, lambda make=make: make(5, seed), slots)
               for p, make in POLICIES.items()}
    ours = results["WEAVE"].total_cost
    lines = ["| policy | total $ | vs WEAVE | mean $/h over its span | peak $/h | peak GPUs "
             "| SLO attainment | slowdown | isolated / packed / scaled |", "|---" * 9 + "|"]
    for name, r in results.items():
        mix = r.strategies
        lines.append(f"| {name} | {r.total_cost:,.0f} | **{r.total_cost / ours:.2f}x** | "
                     f"{r.mean_cost_per_hour:,.0f} | {r.peak_cost_per_hour:,.0f} | {r.peak_gpus} "
                     f"| {r.slo_attainment:.1%} | {r.mean_slowdown:.2f} | {mix['isolated']} / "
                     f"{mix['direct_packing']} / {mix['rollout_scaling']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer jobs and seeds")
    parser.add_argument("--seeds", type=int, default=None, help="trace seeds (default 3, 1 quick)")
    parser.add_argument("--sections", default="static,trace,sweep,production,heavy",
                        help="which to run (the report file is written only when all run)")
    args = parser.parse_args()
    seeds = args.seeds or (1 if args.quick else 3)
    wanted = set(args.sections.split(","))
    n_static, batches = (6, 2) if args.quick else (9, 5)
    n_trace, n_heavy = (60, 80) if args.quick else (300, 300)
    sections: dict[str, str] = {}
    values: dict[str, object] = {}

    def show(*names: str) -> None:
        print(*(sections[n] for n in names), sep="\n\n", end="\n\n", flush=True)

    if "static" in wanted:
        for name, make in (("static", lambda: by_workload(n_static, batches)),
                           ("residency", lambda: by_residency(n_static, batches))):
            sections[name], ratios = make()
            sections[name + "_ratios"] = "; ".join(
                f"{p} {statistics.mean(r):.2f}x mean, {max(r):.2f}x max"
                for p, r in ratios.items())
            show(name)
    if "trace" in wanted:
        sections["trace"], trace_ratios = versus_optima(n_trace, seeds)
        values.update(trace_mean=statistics.mean(trace_ratios), trace_max=max(trace_ratios))
        show("trace")
    if "sweep" in wanted:
        sections["sweep"] = slo_sweep(n_trace, seeds)
        show("sweep")
    if "production" in wanted:
        sections["production"], saving = production(120, seeds)
        values["saving"] = _cell(saving)
        show("production")
    if "heavy" in wanted:
        sections["heavy"] = heavy(n_heavy, 0)
        sections["actual"] = heavy(n_heavy, 0, actual_range=(0.5, 1.0))
        sections["tailed"] = heavy(n_heavy, 0, actual_range=(0.5, 1.0), tail_range=(0.4, 0.7),
                                   slots=8)
        show("heavy", "actual", "tailed")
    if wanted >= {"static", "trace", "sweep", "production", "heavy"}:
        out = results_path("placement_cost", args.quick)
        out.write_text(REPORT.format(
            command=f"python bench/placement_cost.py{' --quick' if args.quick else ''}",
            seeds=seeds, **values, **sections))


REPORT = """\
# Placement cost and SLO attainment (WEAVE §6.4–§6.5)

Command: `{command}` ({seeds} trace seeds; cells are median [min–max] over them). H20/H800 costs
from Table 1 (8-GPU nodes), Table 6 phase times, SLO ~ Unif(1,2) unless swept, 400 GB working
set per node and phase (a node of residency k holds k). A member's DP degree matches its group's
training pool (§4.2 fn 3): its training phase and sharded training memory divide over it.

## What the simulator charges

Provisioned node-hours and nothing else (`rlharvest/sim/cluster.py`); every policy, the optima included,
runs on its own timeline, so a policy that slows jobs pays for the longer lives. Compare total $
(the same work); $/h divides by each policy's own span.

## Static batches vs. brute-force optimum (paper Fig. 15a: WEAVE 1.01–1.12x, 100% SLO)

{static}

{static_ratios}.

### Max group residency 2–5 (paper Fig. 15c)

{residency}

{residency_ratios}.

## Trace at the paper's density vs. the optimum under both readings (§6.5)

Poisson arrivals at the Philly segment's rate, exponential durations (mean 14.4 h), mixed
workload. "Opt arrivals" re-places every alive job optimally at each arrival and leaves
departures alone (the reading that matches what an online scheduler can do without migrating
running jobs at departures); "Opt regrouped" also re-places at every departure. Both run on
their own timelines. Total $ ratios.

{trace}

WEAVE / Opt arrivals over all residencies and seeds: {trace_mean:.2f}x mean, {trace_max:.2f}x max.

## SLO sweep (residency 5, the same traces)

{sweep}

## Production-like trace: rollout-heavy, ~17 concurrent jobs, mean 28 h (paper: 1.84x vs Solo-D)

{production}

Solo-D / WEAVE: {saving}. "Opt arrivals" is the best any placement can do in this model (every
alive job re-placed optimally at each arrival), so its saving bounds what any policy that
never moves a job at a departure reaches. WEAVE consol does move jobs at departures (each move a
cold start the model does not charge); the optimum regrouping at every event bounds it.

## Heavy load: Poisson arrivals every 600 s, mixed workload, residency 5

{heavy}

### The same jobs at their actual durations

Each job runs at a share ~ U(0.5, 1) of the worst-case durations it was placed with
(`SimJob.actual`); periods, SLOs (against the actual solo time) and finish times follow the
actual durations, placement the estimates. WEAVE consol packs tighter on the estimates, so
against the actual solo times it misses more SLOs (about 67% against WEAVE's 76%).

{actual}

### ... with long-tail migration

Each rollout turns tail-bound at a share ~ U(0.4, 0.7) of its actual duration and keeps a
quarter of its GPU slots (8 a node, the scheduler's `--rollout-slots 8`); the others pass to the
next job's turn, whose rollout starts on them at once (§4.3, `Member.tail_s`). Compare with the
table above: WEAVE's groups are not overloaded, so the next rollout on a node waits for its own
job's training, not for the node, and the migration changes little; Greedy's overloaded groups
gain.

{tailed}
"""


if __name__ == "__main__":
    main()
