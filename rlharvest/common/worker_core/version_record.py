"""Keeping an engine host's member record at the weight version its engine serves (and the
fingerprint of its start weights, what a manager checks at version 0).

Managers dispatch a version's requests to the workers whose record names it, so a record left
on an old version (its write lost to an etcd hiccup) would keep the version's requests away
from a worker that serves it. Each weight swap starts one reporting task, or lets the one under
way pick the new version up: it writes until the record says what the engine serves now,
waiting for the registration first (a standby registers after it pulled), and trying again
across etcd errors. Shared by the rollout worker and the co-executor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rlharvest.common.registry import Membership

log = logging.getLogger(__name__)


class VersionRecord:
    """``membership()``: the member record once registered (None before); ``version()``: the
    version the engine serves now; ``start_weights()``: its start weights' fingerprint.
    ``changed`` is the worker service's ``on_version_change`` (called on the event loop)."""

    def __init__(self, membership: Callable[[], Membership | None], version: Callable[[], int],
                 start_weights: Callable[[], str], retry_s: float = 0.5) -> None:
        self._membership, self._retry_s = membership, retry_s
        self._state = lambda: (version(), start_weights())
        self._task: asyncio.Task | None = None

    def changed(self, _version: int | None = None) -> None:
        if self._task is None or self._task.done():  # else the one under way reads it anew
            self._task = asyncio.get_running_loop().create_task(self._report(),
                                                                name="version record")

    async def _report(self) -> None:
        written: tuple[int, str] | None = None
        while (state := self._state()) != written:
            membership = self._membership()
            if membership is None:  # not registered yet: its registration comes first
                await asyncio.sleep(0.05)
                continue
            try:
                await membership.update(weight_version=state[0], start_weights=state[1])
            except Exception as exc:  # etcd unreachable: the record must still get there
                log.warning("could not write weight version %d to the member record (%r); "
                            "trying again in %.1fs", state[0], exc, self._retry_s)
                await asyncio.sleep(self._retry_s)
                continue
            written = state

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
