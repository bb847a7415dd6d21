"""Configuration of a rollout worker (file, RLH_ environment, flags; see rlharvest/common/config.py)."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, model_validator

from rlharvest.common.engine_device import EngineDeviceConfig
from rlharvest.common.rpc import DEFAULT_MAX_MESSAGE_BYTES
from rlharvest.services.rollout_worker.prefix_cache import check_prefix_cache


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerConfig(EngineDeviceConfig):
    worker_id: str = Field(default_factory=_default_worker_id, pattern=r"^[A-Za-z0-9_.-]+$")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, lt=65536, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="host others dial; defaults to host")
    metrics_port: int = Field(0, ge=0, lt=65536, description="/metrics and /healthz; 0 = free port")
    etcd: str = Field("127.0.0.1:2379", description="etcd host:port")
    lease_ttl: int = Field(5, ge=1, le=300, description="seconds until a dead worker's key expires")
    kind: Literal["dedicated", "spot", "seed"] = "dedicated"
    model: str = Field("tiny", description="a model preset name or a local checkpoint directory")
    engine: Literal["torch", "vllm"] = Field("torch", description="the inference engine: "
                                             "rlharvest's own torch engine, or vLLM v1 (needs "
                                             "--model to be a checkpoint directory; the CPU "
                                             "build here, the CUDA build on GPU nodes)")
    kv_cache_gib: float = Field(1.0, gt=0, description="with --engine vllm: GiB of memory for "
                                "vLLM's KV cache (its --kv-cache-memory-bytes)")
    model_seed: int = 0
    weights: str = Field("", description="optional safetensors file loaded at start")
    weights_dir: str = Field("", description="LoadWeights reads only safetensors files named "
                             "relative to this directory (absolute paths, '..' and symlinks "
                             "out are refused); empty: LoadWeights is refused")
    weight_version: int = Field(0, ge=0, description="version of the initial weights")
    max_running: int = Field(64, ge=1, le=4096, description="concurrently executing requests")
    max_len: int = Field(512, ge=8, le=131072, description="prompt + completion tokens per request")
    max_pending: int = Field(4096, ge=1, description="queued requests beyond max_running")
    prefill_chunk: int = Field(0, ge=0, description="prefill at most this many tokens per engine "
                               "step (chunked prefill, e.g. 512), so a long prompt never stalls "
                               "the running requests' decode for longer than one chunk; 0 "
                               "prefills whole prompts")
    kv_pages: int = Field(0, ge=0, description="paged KV cache of this many pages (page_tokens "
                          "each): memory held only for tokens a request can use; at least "
                          "max_len tokens in all; 0 = one max_len row per running request")
    page_tokens: int = Field(16, ge=1, description="tokens per KV page (with kv_pages)")
    prefix_cache: bool = Field(False, description="keep finished requests' full KV pages and "
                               "start a request after its longest cached prefix (a multi-turn "
                               "trajectory's next turn, a resume); needs kv_pages; with "
                               "prefill_chunk the chunks start after the cached prefix; a weight "
                               "load empties it")
    prefix_cache_lease_s: float = Field(60.0, gt=0, description="cached pages unused this long "
                                        "are evicted first when pages run short")
    kv_budget_tokens: int = Field(0, ge=0, description="KV tokens the executing requests may hold "
                                  "(RollPacker §4.2 memory pressure): past it the newest request "
                                  "is preempted and recomputed later, and the load reports the "
                                  "count; >= max_len, not with kv_pages; 0 = no budget")
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 keeps torch's default")
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    keep_requests_s: float = Field(30.0, ge=0, description="a manager session that breaks (the "
                                   "manager died) leaves its requests running this long for a "
                                   "successor manager to adopt with every token; 0 takes them "
                                   "out at once")
    session_queue: int = Field(256, ge=1, description="step messages buffered per session; a slow "
                                                       "reader beyond this slows the engine")
    step_delay_s: float = Field(0.0, ge=0, description="benchmark harness: emulate slower hardware "
                                                        "by sleeping this long after each engine step")
    preemption_notice_url: str = Field("", description="cloud metadata URL announcing a spot "
                                       "reclaim (AWS spot/instance-action, GCP instance/"
                                       "preempted); polled, and a notice drains the worker")
    preemption_poll_s: float = Field(2.0, gt=0, description="seconds between notice polls")
    drain_timeout: float = Field(15.0, ge=0, description="seconds to wait for requests to migrate")
    shutdown_grace: float = Field(5.0, ge=0, description="seconds in-flight RPCs get at shutdown")
    job: str = Field("", pattern=r"^[A-Za-z0-9_.-]*$", description="the RL job this worker "
                     "serves (its manager takes only its job's workers) and whose announced "
                     "weight versions it pulls; empty: 'default' (a placed worker: its node's)")
    agent_pull: bool = Field(False, description="pull weights from a transfer agent when the job "
                                                "announces a version (needs job)")
    placement_node: str = Field("", pattern=r"^[A-Za-z0-9_.-]*$", description="WEAVE: the "
                                "placement scheduler's rollout node this worker runs on; it "
                                "serves whichever job's turn the node is (not --job)")
    placement_resident_jobs: int = Field(2, ge=1, description="with --placement-node: jobs "
                                         "whose weights stay in host memory besides the one "
                                         "served, so switching back is a warm load")
    standby: bool = Field(False, description="a warm standby: start, build the "
                          "engine and keep pulling the job's versions, but join the managers "
                          "only on SIGUSR1 — a replacement for a preempted spot worker then "
                          "costs no process start, import or dense pull (needs --agent-pull)")
    engine_process: bool = Field(False, description="run the engine in its own process (vLLM "
                                 "v1's engine-core split): the model's Python and the gRPC "
                                 "send path stop sharing one GIL (not with "
                                 "--placement-node, which reads the engine's weights)")
    tp_rank: int = Field(0, ge=0, description="this worker's tensor-parallel rank")
    tp_size: int = Field(1, ge=1, description="tensor-parallel size of this worker's engine "
                         "(torch: this worker is rank --tp-rank and pulls its shard; vLLM: "
                         "vLLM's --tensor-parallel-size, one worker spanning the devices)")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    json_logs: bool = True

    @model_validator(mode="after")
    def _prefix_cache_usable(self) -> WorkerConfig:
        check_prefix_cache(self.prefix_cache, self.kv_pages)
        return self

    @model_validator(mode="after")
    def _vllm_usable(self) -> WorkerConfig:
        if self.engine != "vllm":
            return self
        torch_only = {"--placement-node": bool(self.placement_node),
                      "--kv-pages": bool(self.kv_pages), "--prefix-cache": self.prefix_cache,
                      "--kv-budget-tokens": bool(self.kv_budget_tokens),
                      "--prefill-chunk": bool(self.prefill_chunk),
                      "--tp-rank": bool(self.tp_rank), "--kind seed": self.kind == "seed",
                      # vLLM's executor runs the model in a process of its own already (on its
                      # CPU build; on GPUs for TP > 1); a proxy in front of it is untried
                      "--engine-process": self.engine_process}
        used = [flag for flag, on in torch_only.items() if on]
        if used:
            raise ValueError(f"--engine vllm: {', '.join(used)} belong to the torch engine "
                             "(vLLM pages its KV cache, caches prefixes and chunks prefills "
                             "itself; a placed or seed worker keeps torch weights); drop them")
        return self

    @model_validator(mode="after")
    def _engine_process_usable(self) -> WorkerConfig:
        if self.engine_process and self.placement_node:
            raise ValueError("--engine-process keeps the weights in the engine's process, and "
                             "--placement-node keeps each job's weights beside the engine's: "
                             "use one of them")
        return self

    @model_validator(mode="after")
    def _standby_pulls(self) -> WorkerConfig:
        if self.standby and (not self.agent_pull or self.placement_node):
            raise ValueError("--standby keeps a job's weights warm by pulling them: it needs "
                             "--job and --agent-pull, and no --placement-node")
        return self

    @model_validator(mode="after")
    def _placed_weights_on_host(self) -> WorkerConfig:
        # A placed worker keeps each resident job's pulled weights (placement_follower.py):
        # on the device that would be a model per job, not the one copy --held-weights buys.
        if self.placement_node and self.held_weights == "device":
            raise ValueError("--held-weights device keeps one more copy of the model on the "
                             "engine's device; a placed worker keeps one per resident job, so "
                             "it holds them in host memory: drop --held-weights device or "
                             "--placement-node")
        return self

    @model_validator(mode="after")
    def _seed_kind_without_tls(self) -> WorkerConfig:
        # Under TLS a manager dials a seed worker as the trainer (client.session_role): the
        # seed engine is the trainer's own (its --seed-role), under its certificate. A
        # standalone worker of kind seed holds a worker's certificate and would be refused at
        # every session, so it is refused here, saying why.
        if self.kind == "seed" and self.tls_cert:
            raise ValueError("--kind seed under TLS: a manager checks a seed worker's "
                             "certificate for the trainer's role (the seed engine runs in the "
                             "trainer, rlharvest-trainer --seed-role); run this worker as "
                             "dedicated or spot, or without TLS")
        return self

    @model_validator(mode="after")
    def _placed_or_one_job(self) -> WorkerConfig:
        if self.placement_node and self.job:
            raise ValueError(f"--placement-node {self.placement_node} and --job {self.job} both "
                             "name the job: a placed worker serves the job whose turn its node "
                             "is; drop --job")
        return self

    @property
    def served_job(self) -> str:
        """The job whose weights the worker starts with and whose manager takes it: --job, else
        'default' (the managers' and trainers' default); a placed worker's is its node's turn,
        none at first."""
        return "" if self.placement_node else (self.job or "default")
