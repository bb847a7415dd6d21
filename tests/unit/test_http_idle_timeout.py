"""Every HTTP endpoint a service serves through ``observability.serve_app`` (metrics, health,
the transfer agent's data path) closes a connection whose request headers trickle in, once its
idle timeout passes: slowloris holds no descriptor for aiohttp's default hour."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from rlharvest.common import observability


async def _trickle_until_closed(port: int, seconds: float) -> float:
    """Send a header line every 0.2 s; how long until the server closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    started = time.monotonic()
    try:
        while time.monotonic() - started < seconds:
            writer.write(b"X-Trickle: 1\r\n")
            try:
                await writer.drain()
                if await asyncio.wait_for(reader.read(4096), timeout=0.2) == b"":
                    break
            except asyncio.TimeoutError:
                continue
            except ConnectionError:
                break
        return time.monotonic() - started
    finally:
        writer.close()


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_trickled_headers_are_closed_after_the_idle_timeout(monkeypatch) -> None:
    monkeypatch.setattr(observability, "IDLE_TIMEOUT_S", 1.0)
    app = web.Application()
    app.router.add_get("/healthz", _ok)
    runner, port = await observability.serve_app(app, "127.0.0.1", 0)
    try:
        assert await _trickle_until_closed(port, seconds=8.0) < 4.0
    finally:
        await runner.cleanup()
