"""Configuration of the placement scheduler (file, RLH_ environment, flags; see rlharvest/common/config.py).

The node inventory comes from here: per pool a GPU type from Table 1 (H20, H800) and either a
node count (nodes are then named ``rollout-1``, ``train-1``, ...) or an explicit list of node
names (the hosts an operator actually has). Bad inventories stop the scheduler at start-up.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlharvest.common.config import ServiceConfig
from rlharvest.common.rpc import DEFAULT_MAX_MESSAGE_BYTES
from rlharvest.services.placement_scheduler.inter_group import Objective
from rlharvest.services.placement_scheduler.model import H20, H800, Pool, PoolSpec

# Table 1 node types; a pool may use either for either role (the role decides what it runs).
GPU_TYPES: dict[str, PoolSpec] = {"H20": H20, "H800": H800}
_NODE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class PlacementConfig(ServiceConfig):
    scheduler_id: str = Field("scheduler-0", pattern=r"^[A-Za-z0-9_.-]+$",
                              description="this instance's name (leader election candidate)")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, lt=65536, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="host clients dial; defaults to host")
    metrics_port: int = Field(0, ge=0, lt=65536)
    etcd: str = Field("127.0.0.1:2379", description="etcd host:port")
    lease_ttl: int = Field(5, ge=1, le=300, description="membership and election lease: a dead "
                                                        "leader is replaced within this")
    rollout_gpu: str = Field("H20", description="rollout pool node type (H20 or H800)")
    train_gpu: str = Field("H800", description="training pool node type (H20 or H800)")
    rollout_nodes: int = Field(4, ge=0, description="rollout pool size when names are not listed")
    train_nodes: int = Field(2, ge=0, description="training pool size when names are not listed")
    rollout_node_names: list[str] = Field(default_factory=list,
                                          description="rollout pool hosts (instead of a count)")
    train_node_names: list[str] = Field(default_factory=list,
                                        description="training pool hosts (instead of a count)")
    iterations: int = Field(8, ge=2, description="round-robin iterations Algorithm 1 simulates")
    objective: Objective = Field(Objective.MARGINAL_COST, description="what admission minimises: "
                                 "marginal_cost (Algorithm 1's Δ) or cost_per_work (cluster $/h "
                                 "per solo-speed work rate; slower decisions)")
    admission_window_s: float = Field(0.0, ge=0, le=60, description="jobs submitted within "
                                      "this many seconds of each other are admitted together, "
                                      "largest first (the order batch_order finds cheapest; "
                                      "beyond the paper); 0 = each at once, in arrival order")
    admission_window_jobs: int = Field(0, ge=0, description="close the admission window early "
                                       "once this many jobs wait in it (a batch of known size "
                                       "need not wait out the window); 0 = wait it out")
    consolidate: bool = Field(False, description="after a departure, repack the thinned group's "
                              "members (largest first) when that lowers $/h, once none holds a "
                              "permit; a moved job's next phase runs on its new group's nodes "
                              "(beyond the paper)")
    max_wait_s: float = Field(30.0, gt=0, le=600, description="longest AcquirePermit long-poll")
    tail_threshold: float = Field(0.8, gt=0, le=1, description="share of finished responses "
                                                               "that makes a rollout tail-bound")
    requests_per_node: int = Field(64, ge=1, description="default open requests one rollout node "
                                                         "holds after consolidation")
    min_keep_nodes: int = Field(1, ge=1, description="nodes (slots) a migrated tail keeps at "
                                "least")
    rollout_slots: int = Field(1, ge=1, le=64, description="GPUs per rollout node that permits "
                               "and long-tail migration work at, a placed worker each (named "
                               "--placement-node <node>.gpu<k>); 1 = whole nodes")
    drift_tolerance: float = Field(1.25, ge=1, description="a phase measured this much longer "
                                                           "than its estimate counts as drift")
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    shutdown_grace: float = Field(5.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    json_logs: bool = True

    @field_validator("rollout_node_names", "train_node_names", mode="before")
    @classmethod
    def _names_from_flag(cls, value: object) -> object:
        """A flag or env value is a string: accept "a,b,c" as well as a JSON list."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [name.strip() for name in text.split(",") if name.strip()]
        return value

    @model_validator(mode="after")
    def _check_inventory(self) -> PlacementConfig:
        problems = []
        for role in ("rollout", "train"):
            gpu = getattr(self, f"{role}_gpu")
            if gpu not in GPU_TYPES:
                problems.append(f"{role}_gpu {gpu!r} is not a known node type; use one of "
                                f"{sorted(GPU_TYPES)}")
            count, names = getattr(self, f"{role}_nodes"), getattr(self, f"{role}_node_names")
            if f"{role}_nodes" in self.model_fields_set and names and count != len(names):
                problems.append(f"{role}_nodes = {count} but {role}_node_names lists "
                                f"{len(names)} nodes; give one of the two")
            bad = [n for n in names if not _NODE_NAME.match(n)]
            if bad:
                problems.append(f"{role}_node_names {bad} must match [A-Za-z0-9_.-]+")
        names = self.node_names(Pool.ROLLOUT) + self.node_names(Pool.TRAIN)
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            problems.append(f"node names {duplicates} appear more than once across the pools")
        for role in ("rollout", "train"):
            if not getattr(self, f"{role}_nodes") and not getattr(self, f"{role}_node_names"):
                problems.append(f"the {role} pool is empty: set {role}_nodes (a count) or "
                                f"{role}_node_names (a list)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def node_names(self, pool: Pool) -> list[str]:
        """The pool's nodes in configuration order (the order free nodes are handed out)."""
        names = getattr(self, f"{pool.value}_node_names")
        count = getattr(self, f"{pool.value}_nodes")
        return list(names) if names else [f"{pool.value}-{i}" for i in range(1, count + 1)]

    def pool_spec(self, pool: Pool) -> PoolSpec:
        base = GPU_TYPES[getattr(self, f"{pool.value}_gpu")]
        return PoolSpec(pool, base.gpu, base.gpus_per_node, base.cost_per_gpu_hour,
                        base.host_mem_gb, max_nodes=len(self.node_names(pool)))
