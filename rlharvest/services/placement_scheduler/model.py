"""What the placement scheduler reasons about: jobs, nodes, placements and co-execution groups.

WEAVE §4.1–§4.2 (``weave.txt``): a co-execution group G = (J_G, R_G, T_G, Φ_G) is a set of RL jobs
that time-multiplex one rollout node set and one training node set; Φ_G pins every job to the exact
nodes whose host memory caches its working set (warm starts, §3 C3). Durations are the worst-case
estimates of the §5 profiler, in seconds; costs are $/hour (Table 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any


class PlacementError(ValueError):
    """A submission, placement or permit request the scheduler refuses; the message says what is
    wrong and what to do. Services answer it as INVALID_ARGUMENT / FAILED_PRECONDITION."""


class Pool(str, Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise PlacementError(message)


def fits_in_memory(used_gb: float, need_gb: float, capacity_gb: float) -> bool:
    """Memory residency (§4.2, constraint 1): may a working set of ``need_gb`` join ``used_gb``
    already cached on a node of ``capacity_gb`` host memory? An exact fit is accepted.

    Algorithm 1 line 8 rejects when ``mem_req >= mem_avail``, i.e. it demands strict slack, but
    the constraint it implements says the pinned working sets "must not exceed" the node's
    capacity, and we follow the constraint: a node sized for k working sets (§3 C3 and §6.5's
    "max group residency" k) must hold k of them, not k - 1, and a job whose working set fills a
    whole node (which ``validate`` admits) must fit an empty one. The 1e-9 absorbs the rounding
    of summed loads so that an exact fit is not refused by float noise.
    """
    return used_gb + need_gb <= capacity_gb + 1e-9


def _finite_nonneg(value: float, what: str, hint: str) -> None:
    _require(math.isfinite(value) and value >= 0, f"{what} must be a finite number >= 0, got "
             f"{value!r}; {hint}")


@dataclass(frozen=True)
class JobProfile:
    """One-shot profiler output for a job run at its maximum token limit (WEAVE §5 workflow ①②).

    §4.2 plans against the worst case: every response reaches ``max_response_tokens`` in every
    turn, so the estimates below are upper bounds that hold under any response-length draw.
    """

    batch_size: int  # responses generated per step (prompts × samples per prompt)
    prompt_tokens: int  # longest prompt
    max_response_tokens: int  # per turn, the job's configured limit
    decode_s_per_token: float  # one decode step of the full batch on the job's rollout GPUs
    prefill_s: float  # prefill of the full batch, per turn
    train_tokens_per_s: float  # forward+backward throughput on the job's training GPUs
    turns: int = 1
    env_s_per_turn: float = 0.0  # tool / environment latency between turns (agentic rollouts)
    sync_s: float = 0.0  # weight sync train -> rollout; counted in training: it holds train GPUs

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_response_tokens", "turns"):
            _require(getattr(self, name) >= 1, f"profile {name} must be >= 1, got "
                     f"{getattr(self, name)!r}; re-run the profiler with the job's real config")
        _require(self.prompt_tokens >= 0, f"profile prompt_tokens must be >= 0, got "
                 f"{self.prompt_tokens!r}")
        for name in ("decode_s_per_token", "prefill_s", "env_s_per_turn", "sync_s"):
            _finite_nonneg(getattr(self, name), f"profile {name}",
                           "durations come from the profiler's timing pass")
        _require(math.isfinite(self.train_tokens_per_s) and self.train_tokens_per_s > 0,
                 f"profile train_tokens_per_s must be > 0, got {self.train_tokens_per_s!r}")

    def worst_case_rollout_s(self) -> float:
        per_turn = self.prefill_s + self.max_response_tokens * self.decode_s_per_token
        return self.turns * (per_turn + self.env_s_per_turn)

    def worst_case_train_s(self) -> float:
        tokens = self.batch_size * (self.prompt_tokens + self.turns * self.max_response_tokens)
        return tokens / self.train_tokens_per_s + self.sync_s


@dataclass(frozen=True)
class Job:
    """An RL job as admission sees it: worst-case phase durations, SLO and per-node needs."""

    job_id: str
    t_roll: float  # worst-case rollout phase, seconds
    t_train: float  # worst-case training phase (incl. weight sync), seconds
    slo: float = 1.0  # tolerated slowdown of co-execution over solo execution, >= 1
    rollout_nodes: int = 1  # nodes the rollout phase needs (gang)
    train_nodes: int = 1  # minimum; its DP degree grows to the group's pool (§4.2 fn 2)
    rollout_mem_gb: float = 0.0  # host-memory working set cached on each of its rollout nodes
    train_mem_gb: float = 0.0  # ... on each training node, at ``train_nodes``
    # Training state sharded over the data-parallel ranks (ZeRO / FSDP, as the trainer's
    # DeepSpeed runs it): per-node memory falls as the DP degree grows. False: DDP replicas,
    # each node holds the whole state whatever the degree (§3 C3's "replicate state per node").
    train_state_sharded: bool = True

    def __post_init__(self) -> None:
        _require(bool(self.job_id), "job_id must be a non-empty string")
        hint = f"job {self.job_id!r}: submit the profiler's worst-case estimate"
        _finite_nonneg(self.t_roll, f"job {self.job_id!r} t_roll", hint)
        _finite_nonneg(self.t_train, f"job {self.job_id!r} t_train", hint)
        _require(self.t_roll + self.t_train > 0, f"job {self.job_id!r} has zero-length phases; "
                 "a job must do some rollout or training work")
        _require(math.isfinite(self.slo) and self.slo >= 1.0, f"job {self.job_id!r} slo must be "
                 f">= 1 (a tolerated slowdown over solo execution), got {self.slo!r}")
        for name in ("rollout_nodes", "train_nodes"):
            _require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                     f"job {self.job_id!r} {name} must be an integer >= 1, got "
                     f"{getattr(self, name)!r}")
        _finite_nonneg(self.rollout_mem_gb, f"job {self.job_id!r} rollout_mem_gb", "per node")
        _finite_nonneg(self.train_mem_gb, f"job {self.job_id!r} train_mem_gb", "per node")

    @classmethod
    def from_profile(cls, job_id: str, profile: JobProfile, **needs: Any) -> Job:
        return cls(job_id, profile.worst_case_rollout_s(), profile.worst_case_train_s(), **needs)

    @property
    def t_solo(self) -> float:
        """Solo iteration time: rollout then training on dedicated pools (§4.2)."""
        return self.t_roll + self.t_train

    @property
    def slo_budget(self) -> float:
        """The longest co-execution iteration time the job accepts: SLO × T_solo."""
        return self.slo * self.t_solo

    def at_dp(self, train_nodes: int) -> Job:
        """The job as it runs on a training pool of ``train_nodes`` (>= its minimum): §4.2 fn 3
        matches every member's DP degree to the pool, so its training phase divides over the
        larger degree and, with sharded state, so does its per-node training memory.

        Linear scaling is an upper bound on the speed-up (the weight sync in ``t_train`` does not
        shrink, and gradient all-reduce grows); we take it because the profiler measures one
        degree only, and a drift report at the group's degree corrects an optimistic estimate."""
        if train_nodes == self.train_nodes:
            return self
        t_train, mem = self.train_at(train_nodes)
        return replace(self, t_train=t_train, train_mem_gb=mem)

    def train_at(self, train_nodes: int) -> tuple[float, float]:
        """(training seconds, per-node training GB) at a pool of ``train_nodes``: ``at_dp``'s
        numbers without building a Job (Algorithm 1 asks for every group)."""
        _require(train_nodes >= self.train_nodes, f"job {self.job_id!r} needs {self.train_nodes} "
                 f"training nodes; a pool of {train_nodes} cannot run it")
        share = self.train_nodes / train_nodes
        return (self.t_train * share,
                self.train_mem_gb * share if self.train_state_sharded else self.train_mem_gb)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Job:
        return cls(**data)


@dataclass(frozen=True)
class PoolSpec:
    """One homogeneous GPU pool (Table 1): what a node costs and caches, and how many exist."""

    pool: Pool
    gpu: str
    gpus_per_node: int
    cost_per_gpu_hour: float
    host_mem_gb: float
    max_nodes: int | None = None  # None: provision on demand without a cap (simulation)

    @property
    def node_cost_per_hour(self) -> float:
        return self.gpus_per_node * self.cost_per_gpu_hour


# Table 1 (WEAVE §2): H20 for rollout, H800 for training; 8-GPU nodes with 2 TB host DRAM (§3 C3:
# "even high-memory nodes (1–2 TB) admit only two to five resident jobs").
H20 = PoolSpec(Pool.ROLLOUT, "H20", 8, 1.85, 2048.0)
H800 = PoolSpec(Pool.TRAIN, "H800", 8, 5.28, 2048.0)


@dataclass(frozen=True)
class Node:
    node_id: str
    pool: Pool
    cost_per_hour: float
    host_mem_gb: float


@dataclass(frozen=True)
class Placement:
    """P_j: the exact nodes job j is pinned to; its state stays cached on them."""

    job_id: str
    rollout_node_ids: tuple[str, ...]
    train_node_ids: tuple[str, ...]


@dataclass
class Group:
    """A co-execution group with its aggregates kept up to date on every add/remove.

    Members are kept in admission order, which is the round-robin order (§4.3). Every member
    trains on *all* training nodes (§4.2 footnote 3: DP degrees are matched to the group's
    training pool), so training nodes carry identical loads and memory. ``jobs`` keeps each
    member's estimates as submitted (at its own minimum ``train_nodes``); the aggregates and
    ``running`` are at the pool's DP degree (``Job.at_dp``).
    """

    group_id: str
    rollout_nodes: dict[str, Node] = field(default_factory=dict)
    train_nodes: dict[str, Node] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)
    version: int = 0  # bumped on every change: decisions computed on an older version are stale
    # Derived aggregates (never set directly).
    roll_load_s: dict[str, float] = field(default_factory=dict)  # Σ T_roll pinned per node
    roll_mem_gb: dict[str, float] = field(default_factory=dict)
    train_load_s: float = 0.0
    train_mem_gb: float = 0.0
    # (version, training nodes, members) -> t_cycle, min_slo_budget, min_train_mem_gb: Algorithm
    # 1 reads them for every open group on every arrival (most of its time at 2,000 jobs).
    _derived: tuple[tuple[int, int, int], float, float, float] | None = field(
        default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for node_id, node in {**self.rollout_nodes, **self.train_nodes}.items():
            _require(node_id == node.node_id, f"group {self.group_id}: node key {node_id!r} "
                     f"does not match node id {node.node_id!r}")
        jobs, placements = self.jobs, self.placements
        self.jobs, self.placements = {}, {}
        for node_id in self.rollout_nodes:
            self.roll_load_s[node_id] = self.roll_mem_gb[node_id] = 0.0
        for job_id, job in jobs.items():
            self.add(job, placements[job_id])

    # --- derived views -------------------------------------------------------------------------
    @property
    def cost_per_hour(self) -> float:
        nodes = (*self.rollout_nodes.values(), *self.train_nodes.values())
        return sum(node.cost_per_hour for node in nodes)

    def running(self, job: Job) -> Job:
        """``job`` at this group's DP degree (itself while the group has no training pool)."""
        return job.at_dp(len(self.train_nodes)) if self.train_nodes else job

    def train_s(self, job: Job) -> float:
        """``running(job).t_train`` without building a Job (hot in Algorithm 1)."""
        return job.train_at(len(self.train_nodes))[0] if self.train_nodes else job.t_train

    @property
    def t_cycle(self) -> float:
        """T_G^cycle = max_j T_j^solo: the longest member's iteration on its own (§4.2), at the
        group's DP degree, the time that phase takes here."""
        return self._aggregates()[0]

    def _aggregates(self) -> tuple[float, float, float]:
        key = (self.version, len(self.train_nodes), len(self.jobs))
        if self._derived is None or self._derived[0] != key:
            jobs = self.jobs.values()
            self._derived = (
                key, max((job.t_roll + self.train_s(job) for job in jobs), default=0.0),
                min((job.slo_budget for job in jobs), default=math.inf),
                min((n.host_mem_gb for n in self.train_nodes.values()), default=0.0))
        return self._derived[1:]

    @property
    def t_load(self) -> float:
        """T_G^load: total work on the bottleneck node, training pool or any rollout node (§4.2)."""
        return max(self.train_load_s, max(self.roll_load_s.values(), default=0.0))

    @property
    def saturated(self) -> bool:
        """Algorithm 1 line 4: no slack left for another job's phases."""
        return bool(self.jobs) and self.t_load >= self.t_cycle

    @property
    def min_slo_budget(self) -> float:
        """The tightest member's SLO × T_solo: every member's iteration must fit in it."""
        return self._aggregates()[1]

    @property
    def min_train_mem_gb(self) -> float:
        return self._aggregates()[2]

    # --- mutation ------------------------------------------------------------------------------
    def add(self, job: Job, placement: Placement) -> None:
        """Pin ``job`` to ``placement``; raises PlacementError if it names nodes the group lacks
        or breaks per-node memory residency."""
        self.check_placement(job, placement)
        self.jobs[job.job_id] = job
        self.placements[job.job_id] = placement
        self._account(job, placement, +1)

    def remove(self, job_id: str) -> Job:
        job = self.jobs.pop(job_id, None)
        if job is None:
            raise PlacementError(f"job {job_id!r} is not in group {self.group_id}; "
                                 f"members are {sorted(self.jobs)}")
        self._account(job, self.placements.pop(job_id), -1)
        return job

    def update_job(self, job: Job) -> Job:
        """Replace a member's estimates (profile drift), keeping its placement and its round-robin
        position. Returns the previous estimates."""
        old = self.jobs.get(job.job_id)
        if old is None:
            raise PlacementError(f"job {job.job_id!r} is not in group {self.group_id}")
        placement = self.placements[job.job_id]
        self._account(old, placement, -1)
        self.jobs[job.job_id] = job
        self._account(job, placement, +1)
        return old

    def check_placement(self, job: Job, placement: Placement) -> None:
        gid = self.group_id
        _require(job.job_id == placement.job_id, f"placement is for job {placement.job_id!r}, "
                 f"not {job.job_id!r}")
        _require(job.job_id not in self.jobs, f"job {job.job_id!r} is already in group {gid}; "
                 "remove it (leave) before re-placing it")
        unknown = [n for n in placement.rollout_node_ids if n not in self.rollout_nodes]
        unknown += [n for n in placement.train_node_ids if n not in self.train_nodes]
        _require(not unknown, f"job {job.job_id!r}: nodes {unknown} are not in group {gid} "
                 f"(rollout {sorted(self.rollout_nodes)}, train {sorted(self.train_nodes)})")
        _require(len(set(placement.rollout_node_ids)) == job.rollout_nodes,
                 f"job {job.job_id!r} needs {job.rollout_nodes} distinct rollout nodes, placement "
                 f"gives {placement.rollout_node_ids}")
        _require(set(placement.train_node_ids) == set(self.train_nodes),
                 f"job {job.job_id!r} must train on all of group {gid}'s training nodes "
                 f"{sorted(self.train_nodes)} (DP matched to the pool), got "
                 f"{placement.train_node_ids}")
        _require(len(self.train_nodes) >= job.train_nodes, f"job {job.job_id!r} needs "
                 f"{job.train_nodes} training nodes; group {gid} has {len(self.train_nodes)}")
        for node_id in placement.rollout_node_ids:
            capacity, used = self.rollout_nodes[node_id].host_mem_gb, self.roll_mem_gb[node_id]
            _require(fits_in_memory(used, job.rollout_mem_gb, capacity), f"job {job.job_id!r} "
                     f"needs {job.rollout_mem_gb} GB host memory on rollout node {node_id}, which "
                     f"has {capacity - used:.1f} GB free; choose another node or provision one")
        capacity, used = self.min_train_mem_gb, self.train_mem_gb
        need = self.running(job).train_mem_gb
        _require(fits_in_memory(used, need, capacity), f"job {job.job_id!r} needs {need:g} GB "
                 f"host memory on group {gid}'s training nodes, which have "
                 f"{capacity - used:.1f} GB free")

    def _account(self, job: Job, placement: Placement, sign: int) -> None:
        for node_id in placement.rollout_node_ids:
            self.roll_load_s[node_id] += sign * job.t_roll
            self.roll_mem_gb[node_id] += sign * job.rollout_mem_gb
        running = self.running(job)
        self.train_load_s += sign * running.t_train
        self.train_mem_gb += sign * running.train_mem_gb
        self.version += 1

    def train_state_fits(self, keep: int) -> bool:
        """Whether the first ``keep`` training nodes hold every member's training state at DP
        degree ``keep`` (memory residency, §4.2 constraint 1)."""
        capacity = min(n.host_mem_gb for n in list(self.train_nodes.values())[:keep])
        need = sum(job.train_at(keep)[1] for job in self.jobs.values())
        return fits_in_memory(0.0, need, capacity)

    def shrink_train_pool(self, keep: int) -> list[str]:
        """Drop training nodes down to ``keep`` (the last added go first): every member's DP
        degree falls to ``keep``, so its training phase and sharded memory grow. Returns the
        dropped node ids. The caller checks SLOs first (``InterGroupScheduler``)."""
        _require(keep >= max((j.train_nodes for j in self.jobs.values()), default=1),
                 f"group {self.group_id}: a member needs more than {keep} training nodes")
        _require(self.train_state_fits(keep), f"group {self.group_id}: {keep} training nodes "
                 "cannot hold the members' training state")
        dropped = list(self.train_nodes)[keep:]
        jobs = list(self.jobs.values())
        for job in jobs:
            self._account(job, self.placements[job.job_id], -1)
        for node_id in dropped:
            del self.train_nodes[node_id]
        kept = tuple(self.train_nodes)
        for job in jobs:
            self.placements[job.job_id] = replace(self.placements[job.job_id],
                                                  train_node_ids=kept)
            self._account(job, self.placements[job.job_id], +1)
        return dropped

    def add_rollout_node(self, node: Node) -> None:
        _require(node.node_id not in self.rollout_nodes, f"rollout node {node.node_id} already in "
                 f"group {self.group_id}")
        self.rollout_nodes[node.node_id] = node
        self.roll_load_s[node.node_id] = self.roll_mem_gb[node.node_id] = 0.0
        self.version += 1

    def drop_idle_rollout_nodes(self) -> list[str]:
        """Release rollout nodes no member is pinned to any more (after a job leaves)."""
        used = {n for p in self.placements.values() for n in p.rollout_node_ids}
        idle = [n for n in self.rollout_nodes if n not in used]
        for node_id in idle:
            del self.rollout_nodes[node_id], self.roll_load_s[node_id]
            del self.roll_mem_gb[node_id]
        self.version += 1 if idle else 0
        return idle

    # --- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def nodes(ns: Iterable[Node]) -> list[dict[str, Any]]:
            return [{"node_id": n.node_id, "pool": n.pool.value, "cost_per_hour": n.cost_per_hour,
                     "host_mem_gb": n.host_mem_gb} for n in ns]

        return {
            "group_id": self.group_id,
            "rollout_nodes": nodes(self.rollout_nodes.values()),
            "train_nodes": nodes(self.train_nodes.values()),
            "jobs": [self.jobs[j].to_dict() for j in self.jobs],
            "placements": [{"job_id": p.job_id, "rollout_node_ids": list(p.rollout_node_ids),
                            "train_node_ids": list(p.train_node_ids)}
                           for p in self.placements.values()],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Group:
        def nodes(rows: Iterable[Mapping[str, Any]]) -> dict[str, Node]:
            return {r["node_id"]: Node(r["node_id"], Pool(r["pool"]), float(r["cost_per_hour"]),
                                       float(r["host_mem_gb"])) for r in rows}

        jobs = {row["job_id"]: Job.from_dict(row) for row in data["jobs"]}
        placements = {p["job_id"]: Placement(p["job_id"], tuple(p["rollout_node_ids"]),
                                             tuple(p["train_node_ids"]))
                      for p in data["placements"]}
        return cls(data["group_id"], nodes(data["rollout_nodes"]), nodes(data["train_nodes"]),
                   jobs, placements)
