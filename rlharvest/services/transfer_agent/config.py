"""Configuration of a transfer agent (file, RLH_ environment, flags; see rlharvest/common/config.py)."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, model_validator

from rlharvest.common.config import ServiceConfig
from rlharvest.common.rpc import DEFAULT_MAX_MESSAGE_BYTES


def _default_agent_id() -> str:
    return f"{socket.gethostname()}-agent-{os.getpid()}"


class AgentConfig(ServiceConfig):
    agent_id: str = Field(default_factory=_default_agent_id, pattern=r"^[A-Za-z0-9_.-]+$")
    node: str = Field(default_factory=socket.gethostname, description="node this agent serves; "
                      "trainers find their local agent by it")
    cluster: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$",
                         description="agents of one cluster share a fast fabric; pulls between "
                                     "clusters cross the slow link (relay topology)")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, lt=65536, description="gRPC port; 0 picks a free one")
    advertise_host: str = Field("", description="host others dial; defaults to host")
    metrics_port: int = Field(0, ge=0, lt=65536, description="/metrics and /healthz; 0 = free port")
    data_port: int = Field(0, ge=0, lt=65536, description="HTTP port bucket bytes are served on "
                           "(byte ranges, parallel streams); 0 = free port")
    http_data_path: bool = Field(True, description="serve bucket bytes over HTTP (measured "
                                 "fastest); off: only the gRPC PullBuckets stream")
    codec_threads: int = Field(2, ge=1, le=64, description="threads that encode deltas and "
                               "checksum buckets side by side")
    etcd: str = Field("127.0.0.1:2379", description="etcd host:port")
    lease_ttl: int = Field(5, ge=1, le=300, description="seconds until a dead agent's keys expire")
    max_versions: int = Field(2, ge=1, description="versions kept per job (K); 2 lets a worker "
                                                    "holding v-1 pull a sparse delta")
    memory_budget_bytes: int = Field(16 << 30, ge=1, description="host memory for held versions "
                                                                 "per job; eviction beyond it")
    job_idle_s: float = Field(3600.0, ge=0, description="drop a job (its versions, staged "
                              "shards and holder record) after this many seconds with no "
                              "publish, relay or pull of it; 0 = never. A relay skips jobs "
                              "announced longer ago than this")
    max_tp_size: int = Field(256, ge=2, le=4096, description="largest TP group a training side "
                             "may publish shards for; larger tp_size is refused")
    encode_cache_bytes: int = Field(1 << 30, ge=0, description="encoded slices cached for "
                                                                "repeated pulls")
    bucket_bytes: int = Field(64 << 20, ge=1024, description="bucket size of pulls (ROSE: 64 MB)")
    chunk_bytes: int = Field(16 << 20, ge=1024, description="bytes per streamed message; below "
                                                            "max_message_bytes")
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=4096)
    send_rate_bytes_per_s: float = Field(0, ge=0, description="token bucket on every pull this "
                                         "agent serves; 0 = unlimited (tests, link emulation)")
    cross_cluster_rate_bytes_per_s: float = Field(0, ge=0, description="token bucket shared by "
                                                  "pulls to other clusters (the slow link); 0 = "
                                                  "unlimited")
    relay: bool = Field(False, description="source every announced version this agent lacks "
                                           "from another agent")
    relay_mode: Literal["gateway", "flat"] = Field(
        "gateway", description="gateway: one agent per cluster pulls across the slow link, the "
                               "rest pull inside the cluster; flat: every agent pulls from the "
                               "source (the baseline)")
    relay_jobs: str = Field("", pattern=r"^[A-Za-z0-9_.,-]*$",
                            description="comma-separated jobs this agent relays; empty = every "
                                        "announced job")
    relay_streams: int = Field(4, ge=1, le=64, description="parallel streams per relay pull")
    relay_retry_s: float = Field(1.0, gt=0, description="wait before relaying a version again "
                                 "after a failed try; doubled per failure")
    relay_retry_max_s: float = Field(30.0, gt=0, description="longest wait between tries of "
                                     "one version's relay")
    data_read_timeout_s: float = Field(30.0, gt=0, description="seconds a relay pull waits for "
                                       "bytes from a sender before handing its ranges to the "
                                       "others; above chunk_bytes / the senders' rate limits")
    fault_corrupt_chunks: int = Field(0, ge=0, description="testing only: flip one byte in each "
                                                           "of the first N chunks served")
    shutdown_grace: float = Field(5.0, ge=0, description="seconds in-flight RPCs get at shutdown")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    json_logs: bool = True

    @model_validator(mode="after")
    def _chunks_fit_in_messages(self) -> "AgentConfig":
        if self.chunk_bytes > self.max_message_bytes - 1024:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} must stay below max_message_bytes "
                             f"{self.max_message_bytes} minus 1 KiB of framing")
        return self
