"""Slowloris on request headers, for the tests of every HTTP server's idle timeout: a header
line at a time, until the server closes the connection."""

from __future__ import annotations

import asyncio
import time


async def trickle_until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               seconds: float, every: float) -> float:
    """After a request line already written, a header line every ``every`` seconds for at most
    ``seconds``; returns how long until the server closed the connection (``seconds`` or more
    when it never did)."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        writer.write(b"X-Trickle: 1\r\n")
        try:
            await writer.drain()
            if await asyncio.wait_for(reader.read(4096), timeout=every) == b"":
                break
        except asyncio.TimeoutError:
            continue
        except ConnectionError:
            break
    return time.monotonic() - started
