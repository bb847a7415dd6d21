"""Synthetic and trace workloads for the placement simulator (WEAVE §6.5, Table 6).

Jobs are described by phase durations drawn from Table 6 (balanced, rollout-heavy, train-heavy;
small, medium, large), SLOs ~ Unif(1, 2) (§6.4–6.5), and arrivals either Poisson or read from a
CSV trace. A node's host memory admits ``residency`` resident jobs (§6.5 "max group residency").
"""

from __future__ import annotations

import csv
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rlharvest.services.placement_scheduler.model import Job, PlacementError, Pool, PoolSpec

# Table 6: (T_roll range, T_train range) in seconds per (workload, size).
TABLE6: dict[tuple[str, str], tuple[tuple[float, float], tuple[float, float]]] = {
    ("balanced", "small"): ((50, 100), (50, 100)),
    ("balanced", "medium"): ((100, 200), (100, 200)),
    ("balanced", "large"): ((200, 300), (200, 300)),
    ("rollout_heavy", "small"): ((100, 200), (25, 50)),
    ("rollout_heavy", "medium"): ((200, 400), (50, 100)),
    ("rollout_heavy", "large"): ((400, 600), (100, 200)),
    ("train_heavy", "small"): ((25, 50), (100, 200)),
    ("train_heavy", "medium"): ((50, 100), (200, 400)),
    ("train_heavy", "large"): ((100, 200), (400, 600)),
}
WORKLOADS = ("balanced", "rollout_heavy", "train_heavy", "mixed")
# Nodes per phase by size, after Table 3: 7B/14B jobs use 8+8 GPUs, 32B jobs 16+16.
NODES_BY_SIZE = {"small": 1, "medium": 1, "large": 2}
WORKING_SET_GB = 400.0  # per node and phase, ~Table 2 (7B–32B: 240–520 GB)


def pools(residency: int, rollout: PoolSpec, train: PoolSpec) -> tuple[PoolSpec, PoolSpec]:
    """Pool specs whose nodes hold exactly ``residency`` working sets in host memory."""
    if residency < 1:
        raise PlacementError(f"residency must be >= 1 job per node, got {residency}")
    mem = residency * WORKING_SET_GB
    return (PoolSpec(Pool.ROLLOUT, rollout.gpu, rollout.gpus_per_node, rollout.cost_per_gpu_hour,
                     mem, rollout.max_nodes),
            PoolSpec(Pool.TRAIN, train.gpu, train.gpus_per_node, train.cost_per_gpu_hour, mem,
                     train.max_nodes))


@dataclass(frozen=True)
class SimJob:
    job: Job
    arrival_s: float
    iterations: float  # solo-equivalent work: the job finishes after this many iterations
    # Share of its worst-case phase durations the job actually takes: the scheduler plans with
    # every response at the token limit (t_roll, t_train); real responses end sooner.
    actual: float = 1.0
    # Share of its actual rollout after which the job is tail-bound (a threshold share of its
    # responses done) and long-tail migration (§4.3) keeps a quarter of its rollout's units
    # (``cluster.simulate``); None: the rollout holds every unit to its end.
    tail_share: float | None = None

    @property
    def running_job(self) -> Job:
        """The job as it actually runs (what the simulator's clock follows)."""
        if self.actual == 1.0:
            return self.job
        return replace(self.job, t_roll=self.job.t_roll * self.actual,
                       t_train=self.job.t_train * self.actual)


def sample_job(rng: random.Random, job_id: str, workload: str,
               slo_range: tuple[float, float] = (1.0, 2.0)) -> Job:
    """One job from Table 6; ``mixed`` draws uniformly over all nine configurations."""
    if workload not in WORKLOADS:
        raise PlacementError(f"unknown workload {workload!r}; choose one of {WORKLOADS}")
    kinds = [k for k in TABLE6 if workload in ("mixed", k[0])]
    kind = kinds[rng.randrange(len(kinds))]
    (roll_lo, roll_hi), (train_lo, train_hi) = TABLE6[kind]
    nodes = NODES_BY_SIZE[kind[1]]
    return Job(job_id, rng.uniform(roll_lo, roll_hi), rng.uniform(train_lo, train_hi),
               rng.uniform(*slo_range), nodes, nodes, WORKING_SET_GB, WORKING_SET_GB)


def poisson_jobs(n_jobs: int, workload: str, seed: int, mean_interarrival_s: float = 1800.0,
                 mean_duration_s: float = 14.4 * 3600,
                 slo_range: tuple[float, float] = (1.0, 2.0),
                 actual_range: tuple[float, float] | None = None,
                 tail_range: tuple[float, float] | None = None) -> list[SimJob]:
    """Poisson arrivals with exponential solo durations (Philly: mean 14.4 h, §6.5).
    ``actual_range``: each job runs at a share ~ U(lo, hi) of its worst-case durations
    (drawn from its own stream, so the jobs and arrivals stay those of the same seed).
    ``tail_range``: each job's rollout turns tail-bound at a share ~ U(lo, hi) of it (its own
    stream too)."""
    rng = random.Random(seed)
    shares = random.Random(seed + 1_000_003)
    tails = random.Random(seed + 2_000_003)
    now, jobs = 0.0, []
    for i in range(n_jobs):
        now += rng.expovariate(1.0 / mean_interarrival_s)
        job = sample_job(rng, f"job-{i}", workload, slo_range)
        duration = min(rng.expovariate(1.0 / mean_duration_s), 10 * mean_duration_s)
        actual = shares.uniform(*actual_range) if actual_range else 1.0
        tail = tails.uniform(*tail_range) if tail_range else None
        jobs.append(SimJob(job, now, max(duration / job.t_solo, 1.0), actual, tail))
    return jobs


_FIELDS = ("job_id", "arrival_s", "iterations", "t_roll", "t_train", "slo", "rollout_nodes",
           "train_nodes", "rollout_mem_gb", "train_mem_gb")


def save_trace(path: Path, jobs: Iterable[SimJob]) -> None:
    with Path(path).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_FIELDS)
        for s in jobs:
            j = s.job
            writer.writerow([j.job_id, s.arrival_s, s.iterations, j.t_roll, j.t_train, j.slo,
                             j.rollout_nodes, j.train_nodes, j.rollout_mem_gb, j.train_mem_gb])


def load_trace(path: Path) -> list[SimJob]:
    """Read a CSV trace with the columns of ``save_trace``; rows may come in any order."""
    jobs = []
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = set(_FIELDS) - set(reader.fieldnames or ())
        if missing:
            raise PlacementError(f"trace {path} lacks columns {sorted(missing)}; expected "
                                 f"{list(_FIELDS)}")
        for line, row in enumerate(reader, start=2):
            try:
                job = Job(row["job_id"], float(row["t_roll"]), float(row["t_train"]),
                          float(row["slo"]), int(row["rollout_nodes"]), int(row["train_nodes"]),
                          float(row["rollout_mem_gb"]), float(row["train_mem_gb"]))
                jobs.append(SimJob(job, float(row["arrival_s"]), float(row["iterations"])))
            except (ValueError, PlacementError) as exc:
                raise PlacementError(f"trace {path} line {line}: {exc}") from exc
    return sorted(jobs, key=lambda s: s.arrival_s)


def static_jobs(n_jobs: int, workload: str, seed: int) -> Sequence[Job]:
    """A batch of concurrent jobs (for comparison against the brute-force optimum)."""
    rng = random.Random(seed)
    return [sample_job(rng, f"job-{i}", workload) for i in range(n_jobs)]
