"""Structured logs, Prometheus metrics and /healthz over aiohttp, uvloop and graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from rlharvest.common import tls


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self._service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(service: str, level: str = "info", json_logs: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(service) if json_logs else
                         logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


HealthCheck = Callable[[], dict[str, Any]]
T = TypeVar("T")


async def start_http(host: str, port: int, health: HealthCheck,
                     registry: CollectorRegistry = REGISTRY,
                     on_scrape: Callable[[], None] | None = None,
                     ready: Callable[[], bool] | None = None) -> tuple[web.AppRunner, int]:
    """Serve /metrics (Prometheus text), /healthz (JSON from ``health``; 503 unless "ok": is
    the process alive and well) and, given ``ready``, /readyz (503 unless it says so: the
    gRPC health's SERVING, for a probe that cannot speak gRPC health, as kubelet's under TLS:
    a standby or a draining member is healthy but not ready). ``on_scrape`` refreshes gauges
    that cost a walk over state: paid per scrape, not per event."""

    async def metrics(_: web.Request) -> web.Response:
        if on_scrape is not None:
            on_scrape()
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        report = health()
        return web.json_response(report, status=200 if report.get("status") == "ok" else 503)

    async def readyz(_: web.Request) -> web.Response:
        assert ready is not None  # routed only when given
        serving = ready()
        return web.json_response({"ready": serving}, status=200 if serving else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    if ready is not None:
        app.router.add_get("/readyz", readyz)
    return await serve_app(app, host, port)


_PROBE_PATHS = frozenset({"/healthz", "/readyz"})


@web.middleware
async def _client_certificate_required(request: web.Request, handler):
    """Under mutual TLS every path but the probes' (a kubelet probe presents no certificate)
    needs a client certificate, which the TLS handshake already checked against the CA."""
    if request.path not in _PROBE_PATHS and request.transport is not None and \
            not request.transport.get_extra_info("peercert"):
        raise web.HTTPForbidden(text="a client certificate of the stack's CA is required")
    return await handler(request)


# An idle keep-alive connection, or one whose request headers trickle in, closes after this
# (aiohttp's own default is an hour: open descriptors would be the only bound on slowloris).
IDLE_TIMEOUT_S = 75.0


async def serve_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start ``app`` on host:port; returns the runner (to clean up) and the bound port."""
    if tls.active() is not None:
        app.middlewares.append(_client_certificate_required)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=IDLE_TIMEOUT_S)
    await runner.setup()
    # Bind the socket ourselves so port 0 can pick a free port and we can report which.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # HTTPS with a client certificate required when the process runs mutual TLS.
    await web.SockSite(runner, sock, ssl_context=tls.server_ssl_context()).start()
    return runner, sock.getsockname()[1]


def scrape(address: str, timeout: float = 5.0) -> str:
    """A member's Prometheus text page (``host:port`` of its metrics), for the local tools."""
    with urllib.request.urlopen(f"{tls.http_scheme()}://{address}/metrics", timeout=timeout,
                                context=tls.client_ssl_context()) as reply:
        return reply.read().decode()


def sample(text: str, series: str) -> float:
    """One series' value in a Prometheus text page (``name`` or ``name{labels}``); 0 when
    absent (a counter nothing has incremented yet)."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def run_service(main: Callable[[asyncio.Event], Awaitable[T]], use_uvloop: bool = True) -> T:
    """Run ``main(stop_event)`` on uvloop and return its result; SIGTERM and SIGINT set the
    event so ``main`` can shut down gracefully, a second signal exits at once."""

    async def runner() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        started = time.monotonic()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                logging.getLogger(__name__).warning("second %s: exiting now", sig.name)
                sys.exit(128 + sig.value)
            logging.getLogger(__name__).info("%s after %.1fs: shutting down", sig.name,
                                             time.monotonic() - started)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        return await main(stop)

    if use_uvloop:
        import uvloop

        return uvloop.run(runner())
    return asyncio.run(runner())
