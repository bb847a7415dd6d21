"""Configuration of a serving co-executor (file, RLH_ environment, flags; see rlharvest/common/config.py)."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, model_validator

from rlharvest.common.engine_device import EngineDeviceConfig
from rlharvest.common.rpc import DEFAULT_MAX_MESSAGE_BYTES


def _default_id() -> str:
    return f"coexec-{socket.gethostname()}-{os.getpid()}"


class CoexecutorConfig(EngineDeviceConfig):
    coexec_id: str = Field(default_factory=_default_id, pattern=r"^[A-Za-z0-9_.-]+$")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, lt=65536, description="gRPC port (the rollout Session "
                      "contract); 0 picks a free one")
    advertise_host: str = Field("", description="host others dial; defaults to host")
    http_port: int = Field(8000, ge=0, lt=65536, description="the OpenAI-compatible API; 0 "
                           "picks a free one (logged and in the etcd record)")
    metrics_port: int = Field(0, ge=0, lt=65536, description="/metrics and /healthz; 0 = free port")
    etcd: str = Field("127.0.0.1:2379", description="etcd host:port")
    lease_ttl: int = Field(5, ge=1, le=300)
    # ---- the two models
    serving_model: str = Field("small", description="the model serving answers with: a preset "
                               "or a local checkpoint directory")
    served_model_name: str = Field("", description="the name clients ask for; defaults to "
                                   "serving_model")
    model: str = Field("tiny", description="the RL job's model (the rollout side)")
    model_seed: int = 0
    job: str = Field("", pattern=r"^[A-Za-z0-9_.-]*$", description="pin the co-executor to "
                     "this RL job (static lending); empty: lent to the job whose manager claims "
                     "it in etcd (ROSE §5, the manager's max_serving_workers)")
    lending_lapse_s: float = Field(10.0, gt=0, description="etcd unreadable this long: the "
                                   "lending lapses (rollout requests go back; serving goes on)")
    lending_probe_s: float = Field(1.0, gt=0, description="how often the lending record is "
                                   "read besides on every change")
    agent_pull: bool = Field(False, description="pull the job's weights from a transfer agent "
                             "when it announces a version")
    weights_dir: str = Field("", description="LoadWeights reads only safetensors files named "
                             "relative to this directory; empty: LoadWeights is refused")
    max_running: int = Field(16, ge=1, le=4096, description="rollout requests executing at once")
    serving_max_running: int = Field(16, ge=1, le=4096, description="serving requests executing "
                                     "at once")
    max_len: int = Field(512, ge=8, le=131072, description="prompt + completion tokens, both models")
    max_pending: int = Field(256, ge=1, description="rollout requests queued beyond max_running")
    rollout_prefill_chunk: int = Field(512, ge=0, description="rollout prompt tokens one step "
                                       "prefills (ROSE §4.1: a rollout unit never holds serving "
                                       "longer than one chunk or one decode); 0 = whole prompts")
    max_waiting: int = Field(256, ge=1, description="serving requests in flight before 503")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest HTTP request body")
    http_body_timeout_s: float = Field(30.0, gt=0, description="a request body not wholly "
                                       "arrived this long after its headers is a 408 (a "
                                       "stalled client holds no connection longer)")
    http_idle_timeout_s: float = Field(75.0, gt=0, description="an idle keep-alive "
                                       "connection, or one whose request headers trickle "
                                       "in, is closed after this long")
    # ---- memory (ROSE §4.1, App. C)
    total_pages: int = Field(512, ge=1, description="pages in the KV pool both models share")
    page_tokens: int = Field(16, ge=1, description="tokens a page holds (both models here; a "
                             "page smaller than one token is refused)")
    kv_memory: Literal["pool", "slots"] = Field("pool", description="pool: both models' KV "
                                                 "lives in the pool's pages (one physical "
                                                 "pool); slots: each engine keeps a slot cache "
                                                 "and the pool only accounts")
    headroom: float = Field(0.2, gt=0, lt=1, description="H: share of the pool kept for serving")
    lease_s: float = Field(10.0, gt=0, description="lease of a rollout page, renewed on use")
    prefix_cache: bool = Field(False, description="keep a finished rollout request's pages in "
                               "the pool (under its lease, reclaimed first for serving) for its "
                               "trajectory's next turn, which takes them over and prefills only "
                               "the rest; needs kv_memory pool")
    static_partition: bool = Field(False, description="Table 2's baseline: half the pool each")
    # ---- admission (ROSE §4.1 Eq. 1-2)
    ttft_slo_ms: float = Field(500.0, gt=0, description="B_TTFT")
    tpot_slo_ms: float = Field(150.0, gt=0, description="B_TPOT")
    slo_margin: float = Field(0.3, ge=0, lt=1, description="share of each SLO budget a rollout "
                              "step leaves unused (bench/coexec_admission.py: 0 misses SLOs)")
    policy: Literal["dual", "ttft_only", "tpot_only", "always", "static_partition"] = "dual"
    slack_mode: Literal["queue_aware", "paper"] = "queue_aware"
    profile: str = Field("", description="latency profiles JSON (serving and rollout); empty: "
                         "measured at start")
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 keeps the default")
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    keep_requests_s: float = Field(30.0, ge=0, description="a manager session that breaks (the "
                                   "manager died) leaves its requests running this long for a "
                                   "successor manager to adopt with every token; 0 takes them "
                                   "out at once")
    session_queue: int = Field(256, ge=1)
    drain_timeout: float = Field(15.0, ge=0, description="seconds for rollout to migrate away")
    shutdown_grace: float = Field(5.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    json_logs: bool = True

    @model_validator(mode="after")
    def _pool_holds_a_request(self) -> CoexecutorConfig:
        if self.total_pages * self.page_tokens < self.max_len:
            raise ValueError(f"total_pages ({self.total_pages}) x page_tokens ({self.page_tokens})"
                             f" must hold one request of max_len ({self.max_len}) tokens")
        return self

    @model_validator(mode="after")
    def _prefix_cache_in_the_pool(self) -> CoexecutorConfig:
        if self.prefix_cache and self.kv_memory != "pool":
            raise ValueError("prefix_cache keeps the KV pages of finished rollout requests: it "
                             "needs kv_memory pool (slot caches have no pages to keep)")
        return self

    @model_validator(mode="after")
    def _served_name(self) -> CoexecutorConfig:
        if not self.served_model_name:
            self.served_model_name = self.serving_model
        return self
