"""Spot/preemptible VM notices: the cloud announces a reclaim some seconds ahead (AWS: 2 minutes,
GCP: 30 s). A worker that hears it drains at once, so its requests migrate with every token
they have (RLBoost §4.2) instead of being found dead by a broken stream.

Both clouds expose the notice on the instance metadata server:
- AWS: ``http://169.254.169.254/latest/meta-data/spot/instance-action`` answers 404 until a
  reclaim is scheduled, then 200 with ``{"action": "terminate", "time": ...}``;
- GCP: ``http://metadata.google.internal/computeMetadata/v1/instance/preempted`` answers
  ``FALSE`` until the VM is preempted, then ``TRUE`` (it wants ``Metadata-Flavor: Google``).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

log = logging.getLogger(__name__)

_HEADERS = {"Metadata-Flavor": "Google"}  # GCP requires it; AWS ignores it


def is_notice(status: int, body: str) -> bool:
    """Whether one metadata answer announces a reclaim (see the module doc for the formats)."""
    return status == 200 and body.strip().upper() not in ("", "FALSE")


async def wait_for_notice(url: str, interval_s: float, timeout_s: float = 2.0) -> str:
    """Poll ``url`` until it announces a reclaim; return what it said. An unreachable metadata
    server is logged and polled again: it must not take a healthy worker down."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, headers=_HEADERS) as http:
        failures = 0
        while True:
            try:
                async with http.get(url) as reply:
                    body = await reply.text()
                    if is_notice(reply.status, body):
                        return body.strip()
                failures = 0
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("preemption notice poll of %s failed (%d in a row): %r",
                                url, failures, exc)
            await asyncio.sleep(interval_s)
