"""A hosted service whose build step is slow, run as a real process through the service CLI
(uvloop, SIGTERM handling): the service-host tests signal it while it builds. ``--build
async`` awaits (a model loaded off the event loop); ``--build blocking`` holds the event loop
(a model loaded on it). It writes ``building`` to ``--marker`` once the build has begun."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from pydantic import Field

from rlharvest.common.cli import service_app
from rlharvest.common.config import ServiceConfig
from rlharvest.common.service_host import Host, Parts, ServiceSpec


class HostedConfig(ServiceConfig):
    """What the service host reads of any service's config (the service-host tests' too)."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    metrics_port: int = 0
    etcd: str = "127.0.0.1:2379"
    lease_ttl: int = 5
    max_message_bytes: int = Field(4 << 20)
    shutdown_grace: float = 1.0
    log_level: str = "info"
    json_logs: bool = False


class SlowConfig(HostedConfig):
    build: str = "async"  # async | blocking
    build_s: float = 60.0
    marker: str = ""


async def build(host: Host[SlowConfig]) -> Parts:
    cfg = host.config
    Path(cfg.marker).write_text("building")
    if cfg.build == "blocking":
        time.sleep(cfg.build_s)
    else:
        await asyncio.sleep(cfg.build_s)
    return Parts(member_id="slow-0", servicers=[], health=lambda: {"status": "ok"})


SPEC = ServiceSpec("slow_build", SlowConfig, build)

if __name__ == "__main__":
    service_app(SPEC)()
