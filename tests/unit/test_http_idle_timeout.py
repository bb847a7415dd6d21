"""Every HTTP endpoint a service serves through ``observability.serve_app`` (metrics, health,
the transfer agent's data path) closes a connection whose request headers trickle in, once its
idle timeout passes: slowloris holds no descriptor for aiohttp's default hour."""

from __future__ import annotations

import asyncio

from aiohttp import web

from rlharvest.common import observability
from tests.slow_headers import trickle_until_closed


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_trickled_headers_are_closed_after_the_idle_timeout(monkeypatch) -> None:
    monkeypatch.setattr(observability, "IDLE_TIMEOUT_S", 1.0)
    app = web.Application()
    app.router.add_get("/healthz", _ok)
    runner, port = await observability.serve_app(app, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        try:
            assert await trickle_until_closed(reader, writer, seconds=8.0, every=0.2) < 4.0
        finally:
            writer.close()
    finally:
        await runner.cleanup()
