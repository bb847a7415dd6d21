"""Configuration of a rollout manager (file, RLH_ environment, flags; see rlharvest/common/config.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from rlharvest.common.config import ServiceConfig
from rlharvest.common.rpc import DEFAULT_MAX_MESSAGE_BYTES
from rlharvest.services.rollout_manager.tp_planner import ProfiledStart, TpPlanner


class ManagerConfig(ServiceConfig):
    job: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="the RL job it serves")
    manager_id: str = Field("manager-0", pattern=r"^[A-Za-z0-9_.-]+$")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, lt=65536, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="host others dial; defaults to host")
    metrics_port: int = Field(0, ge=0, lt=65536)
    etcd: str = Field("127.0.0.1:2379", description="etcd host:port")
    shards: int = Field(1, ge=1, le=1024, description="manager processes that split the job's "
                        "workers between them (each a shard with its own leader and standby; "
                        "a worker belongs to shard crc32(worker id) mod shards); the trainer's "
                        "client fans each step out over them. 1: one manager, as before")
    shard_index: int = Field(0, ge=0, description="which shard this manager serves, below "
                             "--shards")
    lease_ttl: int = Field(5, ge=1, le=300, description="etcd lease of its record and its "
                           "election key: a SIGKILLed leader's standby takes over within it")
    reattach_grace_s: float = Field(60.0, ge=0, description="a step whose trainer went away "
                                    "runs on this long, its completions kept: the trainer, "
                                    "restarted from its checkpoint, submits it again and gets "
                                    "it whole (tail batching's short rounds excepted); 0 drops "
                                    "it at once")
    greeting_timeout_s: float = Field(3.0, ge=0, description="a new leader waits this long at "
                                      "most for every registered worker's session to say "
                                      "which requests it kept from the dead leader, before "
                                      "taking steps")
    theta: int = Field(4, ge=1, description="Θ of Algorithm 2: most pending requests per worker")
    balancer: Literal["algorithm2", "jsq", "round_robin"] = Field(
        "algorithm2", description="algorithm2: RLBoost's SELECTINSTANCE + CONTINUOUSLB; jsq and "
                                  "round_robin: baselines that dispatch at once and never migrate")
    # Cost-aware is the default: under `rlharvest up --trainer` the paper's rule moved about two
    # requests per completion (bench/up_migrations.py); the paper's stays as the baseline.
    migration_rule: Literal["cost-aware", "paper"] = Field(
        "cost-aware", description="which requests CONTINUOUSLB moves (algorithm2 only): "
        "cost-aware, only a request whose predicted time saved (its expected remaining tokens "
        "at the source's pace vs the destination's) beats its context's prefill on the "
        "destination, once a step, never back to a worker it left, and none of a seed "
        "worker's or a lent co-executor's before its hand-over; paper, Algorithm 2's executing "
        "case as written (a worker's excess over its batching plateau B to any idle worker), "
        "the baseline")
    prefill_tokens_per_s: float = Field(10_000.0, gt=0, description="cost-aware migration: a "
                                        "resume's prefill rate until the destination has "
                                        "measured its own from its engine steps")
    migration_min_gain: float = Field(0.1, ge=0, lt=1, description="cost-aware migration: a "
                                      "move must also save this share of the request's "
                                      "remaining time at its source (paces are noisy averages: "
                                      "on equal workers they differ by noise alone)")
    recompute_on_loss: bool = Field(
        False, description="baseline only: a lost worker's requests restart from the prompt "
                           "(the client sees their deltas start again at position 0) instead of "
                           "resuming from their last token")
    turn_routing: Literal["turnwise+affinity", "turnwise", "pinned", "pinned-static"] = Field(
        "turnwise+affinity", description="agentic trajectories (ROSE §4.3): a turn goes to the "
        "worker holding its history's KV while it is under its concurrency cap "
        "(turnwise+affinity), is placed like any request (turnwise), or stays on its first "
        "turn's worker (pinned; pinned-static binds the first turn at once to the least "
        "assigned worker, the paper's baseline)")
    trajectory_ttl_s: float = Field(120.0, gt=0, description="a trajectory's affinity entry "
                                    "is dropped after this long without a turn")
    rebalance_interval_s: float = Field(0.05, gt=0, description="period of CONTINUOUSLB")
    max_moves_per_round: int = Field(64, ge=1, description="migrations per CONTINUOUSLB round")
    stall_timeout_s: float = Field(30.0, gt=0, description="no token this long while busy = lost")
    forget_lost_after_s: float = Field(300.0, ge=0, description="a lost worker is forgotten "
                                       "this long after its loss (its status entry and "
                                       "per-worker metrics go); spot workers return under new "
                                       "ids, so lost ones would pile up")
    refusal_hold_s: float = Field(0.25, ge=0, description="a worker that refused a request "
                                  "(RESOURCE_EXHAUSTED, ALREADY_EXISTS) or a co-executor that "
                                  "gave one up for memory gets no new one for this long")
    no_worker_timeout_s: float = Field(300.0, ge=0, description="default wait for a worker "
                                                                "holding the step's version")
    max_step_requests: int = Field(65536, ge=1)
    max_prompt_tokens: int = Field(32768, ge=1)
    max_new_tokens: int = Field(32768, ge=1)
    vocab_size: int = Field(0, ge=0, description="token ids must be below this; 0 = the "
                            "vocabulary the job's workers publish (their model's)")
    max_serving_workers: int = Field(0, ge=0, description="serving co-executors this job may "
                                     "borrow (ROSE's N_serving): claimed in etcd, lowest recent "
                                     "serving KV use first; 0 = none claimed (co-executors pinned "
                                     "to the job with --job still join)")
    rollout_model: str = Field("", description="when set, only co-executors that deployed this "
                               "rollout model are borrowed")
    lending_interval_s: float = Field(1.0, gt=0, description="how often claims are checked "
                                      "besides on every etcd change")
    tp_planner: bool = Field(
        False, description="RollPacker's TP planner (advisory): after each step, double the TP "
                           "size of its round kind on a >1.05x rise in the workers' KV "
                           "preemptions, halve it after 4 steps without; the plan is written to "
                           "etcd (jobs/<job>/tp_plan) for an operator, autoscaler or vLLM "
                           "deployment: this manager's workers keep their TP size. Steps with an "
                           "acceptance rule are short rounds, all other steps long rounds")
    gpus_per_node: int = Field(8, ge=1, description="TP planner: GPUs per rollout node, the "
                               "largest TP size (a power of two: a TP group stays in one node)")
    initial_tp: int = Field(1, ge=1, description="TP planner: the TP size it starts from (a "
                            "power of two <= gpus_per_node; the offline profile's best); a plan "
                            "stored in etcd by a previous manager of the job takes precedence")
    tp_profile: str = Field("", description="TP planner: an offline profile (JSON: gpus, "
                            "prompt_tokens, decode_s/kv_tokens/prefill_s_per_token per TP size, "
                            "optionally the profiled workload's lengths). Its cost model vetoes "
                            "moves it predicts slower, and its lengths' best TP size is the "
                            "start unless --initial-tp is given")
    stream_scaling: bool = Field(
        False, description="RollPacker's stream-trainer scaling: at 20-50% of a SubmitStep's "
                           "requests done, if the remaining requests' projected peak KV fits the "
                           "kept half of the workers, lend the least-loaded half to training for "
                           "the rest of the step (their requests move with their tokens) and "
                           "write it to etcd (jobs/<job>/stream_scale); they return when the "
                           "step ends. A trainer with --borrow-lent-threads trains on their threads meanwhile")
    stream_scaling_quantile: float = Field(
        0.9, gt=0, le=1, description="stream scaling: each remaining request's final length is "
                                     "this quantile of the previous step's lengths beyond its "
                                     "current one")
    stream_scaling_headroom: float = Field(
        0.1, ge=0, lt=1, description="stream scaling: share of the kept workers' KV capacity the "
                                     "projected peak must leave free")
    client_queue: int = Field(64, ge=1, description="events buffered per client stream; a slower "
                                                     "client slows delivery beyond this")
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    shutdown_grace: float = Field(5.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    json_logs: bool = True

    # The profile, read and checked once by the validator (a planner changes as it observes,
    # so each tp_planner_of() builds a fresh one from it).
    _profiled: ProfiledStart | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _shard_fits(self) -> ManagerConfig:
        if self.shard_index >= self.shards:
            raise ValueError(f"shard_index {self.shard_index} must be below shards "
                             f"{self.shards}; the shards of a job are 0..{self.shards - 1}")
        # Both write one job-wide record in etcd (jobs/<job>/...): shards would overwrite
        # each other's plan or lent set.
        if self.shards > 1 and (self.tp_planner or self.stream_scaling):
            raise ValueError("tp_planner and stream_scaling write one record per job; run them "
                             "with shards 1")
        return self

    @model_validator(mode="after")
    def _tp_planner_fits(self) -> ManagerConfig:
        if self.tp_profile:
            try:
                self._profiled = ProfiledStart.from_json(
                    json.loads(Path(self.tp_profile).read_text()))
            except (OSError, ValueError) as exc:
                raise ValueError(f"tp_profile {self.tp_profile}: {exc}") from exc
        self.tp_planner_of()  # its own checks: powers of two, bounds, the profile's sizes
        return self

    def tp_planner_of(self) -> TpPlanner:
        """The planner this configuration asks for: from --initial-tp, or from the profile's
        best TP size for its workload when --initial-tp is not given."""
        start = self._profiled
        if start is None:
            return TpPlanner(self.gpus_per_node, self.initial_tp)
        initial = self.initial_tp if "initial_tp" in self.model_fields_set else \
            start.initial_tp(self.gpus_per_node) or self.initial_tp
        return TpPlanner(self.gpus_per_node, initial, model=start.model)
