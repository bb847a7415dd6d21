"""Provisioning cost and SLO attainment of WEAVE's placement vs. baselines (WEAVE §6.4–§6.5).

1. Small static batches (all jobs concurrent) vs. the brute-force offline optimum, per Table 6
   workload at residency 5, then for the mixed workload at max group residency 2..5 (Fig. 15a,
   15c; paper: WEAVE 1.01–1.12x of optimal, 100% SLO). Random and Greedy (Most-Idle) alongside.
2. An online trace at the density of the paper's Philly segment (300 jobs in 580 h, mean 14.4 h)
   at residency 2..5, time-integrated against the optimum regrouped at every arrival and
   departure (§6.5 "Offline Optimal"); it also splits WEAVE's gap into Algorithm 1 itself
   (placing the alive jobs afresh) and never regrouping after departures.
3. Heavy Poisson arrivals of the mixed workload: WEAVE vs. solo disaggregation (paper: 1.84x
   lower cost), Random and Greedy.

Policies are compared on the total $ of the same trace (the same work): the time-averaged $/h
divides by a span that SLO-blind policies stretch by slowing jobs down.

    python bench/placement_cost.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from rlharvest.services.placement_scheduler.model import H20, H800, Job, PoolSpec
from rlharvest.sim import baselines, cluster, optimum, workloads

RESIDENCIES = (2, 3, 4, 5)
PHILLY_INTERARRIVAL_S = 580 * 3600 / 300  # §6.5: 300 jobs over a 580-hour trace segment
Factory = Callable[[int, int], baselines.Placer]  # (residency, seed) -> a fresh policy


def _pools(residency: int) -> tuple[PoolSpec, PoolSpec]:
    return workloads.pools(residency, H20, H800)


POLICIES: dict[str, Factory] = {
    "WEAVE": lambda res, seed: baselines.Weave(*_pools(res)),
    "Random": lambda res, seed: baselines.RandomPlacer(*_pools(res), seed),
    "Greedy": lambda res, seed: baselines.MostIdlePlacer(*_pools(res)),
    "Solo-D": lambda res, seed: baselines.SoloDisaggregation(*_pools(res)),
}


# --- 1. static batches vs. the brute-force optimum --------------------------------------------
def _static_row(batches: Sequence[Sequence[Job]], residency: int) -> dict[str, list]:
    """Per policy: (cost / optimum, SLO attainment, $ per unit of work / WEAVE's) per batch."""
    rows: dict[str, list] = {p: [] for p in POLICIES}
    for seed, jobs in enumerate(batches):
        best = optimum.offline_optimum(jobs, *_pools(residency))
        results = {p: cluster.static_cost(jobs, lambda make=make: make(residency, seed))
                   for p, make in POLICIES.items()}
        ours = results["WEAVE"].cost_per_work
        for p, r in results.items():
            rows[p].append((r.cost_per_hour / best, r.slo_attainment, r.cost_per_work / ours))
    return rows


def _cell(samples: list) -> str:
    ratios = [s[0] for s in samples]
    return (f"{statistics.mean(ratios):.2f}x / {max(ratios):.2f}x "
            f"({statistics.mean(s[1] for s in samples):.0%})")


def _work_cell(samples: list) -> str:
    return f"{statistics.mean(s[2] for s in samples):.2f}x"


def _static_table(first: str, rows: dict[str, dict[str, list]]) -> tuple[str, list[float]]:
    """The table, and WEAVE's cost / optimum of every batch in it."""
    lines = [f"| {first} | " + " | ".join(f"{p} mean / max (SLO)" for p in POLICIES)
             + " | Random / Greedy $ per work vs WEAVE |", "|---" * (len(POLICIES) + 2) + "|"]
    for label, row in rows.items():
        lines.append(f"| {label} | " + " | ".join(_cell(row[p]) for p in POLICIES) + " | "
                     f"{_work_cell(row['Random'])} / {_work_cell(row['Greedy'])} |")
    return "\n".join(lines), [s[0] for row in rows.values() for s in row["WEAVE"]]


def by_workload(n_jobs: int, seeds: int) -> tuple[str, list[float]]:
    rows = {w: _static_row([workloads.static_jobs(n_jobs, w, s) for s in range(seeds)], 5)
            for w in workloads.WORKLOADS}
    return _static_table(f"workload ({n_jobs} jobs, {seeds} seeds, residency 5)", rows)


def by_residency(n_jobs: int, seeds: int) -> tuple[str, list[float]]:
    batches = [workloads.static_jobs(n_jobs, "mixed", s) for s in range(seeds)]
    rows = {str(r): _static_row(batches, r) for r in RESIDENCIES}
    return _static_table(f"residency (mixed, {n_jobs} jobs, {seeds} seeds)", rows)


# --- 2. online trace vs. the regrouping optimum --------------------------------------------
def _trace_row(n_jobs: int, seed: int, residency: int) -> tuple[str, float]:
    """The table row, and WEAVE's time-integrated cost / optimum."""
    trace = workloads.poisson_jobs(n_jobs, "mixed", seed, PHILLY_INTERARRIVAL_S)
    jobs = {s.job.job_id: s.job for s in trace}
    runs = {p: cluster.simulate(trace, lambda make=make: make(residency, seed))
            for p, make in POLICIES.items()}
    timeline = runs["WEAVE"].timeline
    best = optimum.regrouping_optimum((s.job_ids for s in timeline), jobs, *_pools(residency),
                                      max_jobs=24)
    opt_total = sum(best[frozenset(s.job_ids)] * s.seconds for s in timeline) / 3600
    afresh = _afresh_total(timeline, jobs, residency)
    worst = max(s.cost_per_hour / best[frozenset(s.job_ids)] for s in timeline)
    crowd = max(len(s.job_ids) for s in timeline)
    ratio = {p: r.total_cost / opt_total for p, r in runs.items()}
    slo = {p: r.slo_attainment for p, r in runs.items()}
    row = (f"| {residency} | {crowd} | **{ratio['WEAVE']:.2f}x** ({slo['WEAVE']:.0%}) | "
           f"{worst:.2f}x | {afresh / opt_total:.2f}x | " + " | ".join(
               f"{ratio[p]:.2f}x ({slo[p]:.0%})" for p in ("Random", "Greedy", "Solo-D")) + " |")
    return row, ratio["WEAVE"]


def _afresh_total(timeline: Sequence[cluster.Stretch], jobs: dict[str, Job],
                  residency: int) -> float:
    """Total $ had Algorithm 1 placed each stretch's alive jobs from scratch, in arrival order."""
    cost: dict[frozenset[str], float] = {}
    total = 0.0
    for stretch in timeline:
        key = frozenset(stretch.job_ids)
        if key not in cost:
            cost[key] = cluster.static_cost([jobs[j] for j in stretch.job_ids],
                                            lambda: POLICIES["WEAVE"](residency, 0)).cost_per_hour
        total += cost[key] * stretch.seconds / 3600
    return total


def versus_regrouping_optimum(n_jobs: int, seed: int) -> tuple[str, list[float]]:
    lines = ["| residency | most concurrent jobs | WEAVE total / opt (SLO) | WEAVE worst instant "
             "| Alg. 1 afresh / opt | Random (SLO) | Greedy (SLO) | Solo-D (SLO) |",
             "|---" * 8 + "|"]
    rows = [_trace_row(n_jobs, seed, r) for r in RESIDENCIES]
    return "\n".join(lines + [row for row, _ in rows]), [ratio for _, ratio in rows]


# --- 3. heavy Poisson arrivals vs. solo disaggregation ----------------------------------------
def online(n_jobs: int, seed: int, actual_range: tuple[float, float] | None = None) -> str:
    jobs = workloads.poisson_jobs(n_jobs, "mixed", seed, mean_interarrival_s=600,
                                  actual_range=actual_range)
    results = {p: cluster.simulate(jobs, lambda make=make: make(5, seed))
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
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n_static, seeds = (6, 2) if args.quick else (9, 5)
    static, static_ratios = by_workload(n_static, seeds)
    print(static, end="\n\n", flush=True)
    residency, residency_ratios = by_residency(n_static, seeds)
    print(residency, end="\n\n", flush=True)
    trace, trace_ratios = versus_regrouping_optimum(60 if args.quick else 300, args.seed)
    print(trace, end="\n\n", flush=True)
    dynamic = online(80 if args.quick else 300, args.seed)
    print(dynamic, end="\n\n", flush=True)
    actual = online(80 if args.quick else 300, args.seed, actual_range=(0.5, 1.0))
    print(actual, flush=True)
    batches = static_ratios + residency_ratios
    out = Path(__file__).parent / "results" / ("placement_cost_quick.md" if args.quick
                                               else "placement_cost.md")
    out.write_text(REPORT.format(
        command=f"python bench/placement_cost.py{' --quick' if args.quick else ''}",
        seed=args.seed, static=static, residency=residency, trace=trace, dynamic=dynamic,
        actual=actual,
        batch_mean=statistics.mean(batches), batch_max=max(batches),
        batch_verdict=_verdict(max(batches)), trace_min=min(trace_ratios),
        trace_max=max(trace_ratios), trace_verdict=_verdict(max(trace_ratios))))


def _verdict(worst: float) -> str:
    return "within the paper's 1.01–1.12x" if worst <= 1.12 else "outside the paper's 1.01–1.12x"


REPORT = """\
# Placement cost and SLO attainment (WEAVE §6.4–§6.5)

Command: `{command}` (seed {seed}). H20/H800 costs from Table 1 (8-GPU nodes), Table 6 phase
times, SLO ~ Unif(1,2), 400 GB working set per node and phase (a node of residency k holds k).

## What the simulator charges

Provisioned node-hours and nothing else (`sim/cluster.py`). Packing past an SLO is not
penalised by itself: a round-robin group that is overloaded keeps its bottleneck pool busy, there
is no cold start (every policy keeps memory residency) and no interference beyond round-robin
queueing. SLO-blind packing costs only through slower jobs living longer. So:

- in a static batch (one instant) Random and Greedy can cost *less* than the SLO-constrained
  optimum: the price is SLO attainment and slower jobs, which the last column prices as $ per
  job-hour of solo-speed progress, relative to WEAVE;
- on a trace, compare the total $ of the same work. The time-averaged $/h that earlier versions
  of this benchmark headlined divided by each policy's own span, which slowed jobs stretch, and
  so flattered Random and Greedy (compare the two columns of the heavy-load run below).

## Static batches vs. brute-force optimum (paper Fig. 15a: WEAVE 1.01–1.12x, 100% SLO)

Cost / optimum over the seeds: mean / max (mean SLO attainment). WEAVE places the batch online
in job order; the optimum may partition it freely.

{static}

### Max group residency 2–5 (paper Fig. 15c)

{residency}

Over all batches WEAVE averages {batch_mean:.2f}x of optimal, worst {batch_max:.2f}x:
{batch_verdict}. With 6–9 jobs one extra group (a training node is $42/h, a rollout node $15/h)
moves the ratio by 0.1–0.3x, so single batches are coarse. The worst batches are an online
effect: Algorithm 1 places in arrival order and never scales a group's training pool (§4.2
footnote 2), so a large job (2 training nodes) arriving after small ones gets a group of its
own, where the offline optimum groups the large jobs together.

## Online trace at the paper's density vs. the regrouping optimum (§6.5)

Poisson arrivals at the Philly segment's rate (300 jobs in 580 h), exponential durations with
mean 14.4 h, mixed workload. The optimum re-places every set of concurrently alive jobs (WEAVE's
run) from scratch at each arrival and departure, migrations free. "Alg. 1 afresh" places the same
alive jobs with Algorithm 1 from an empty cluster: the rest of WEAVE's gap is what never
regrouping after departures leaves behind (groups keep their training nodes until the last
member leaves, §4.2 footnote 2). Worst instant: the largest WEAVE / optimum $/h at any moment.
Others: total $ / optimum's total $ (SLO attainment).

{trace}

WEAVE's time-integrated cost is {trace_min:.2f}–{trace_max:.2f}x of the regrouping optimum:
{trace_verdict}.

## Heavy load: Poisson arrivals every 600 s, mixed workload, residency 5 (paper: 1.84x lower cost than Solo-D)

{dynamic}

### The same jobs at their actual durations

Each job runs at a share ~ U(0.5, 1) of the worst-case durations it was placed with (responses
end before the token limit; `SimJob.actual`); periods, SLOs (against the actual solo time) and
finish times follow the actual durations, placement the estimates. Long-tail migration is not
modelled.

{actual}
"""


if __name__ == "__main__":
    main()
