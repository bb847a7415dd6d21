"""The trainer's training thread: every torch call of the run, one at a time, in order, off the
event loop (whose lease keepalives and streams would lapse meanwhile), with the threads of
lent workers added while the manager lends them (RollPacker §4.4, ``lent_capacity.py``)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from rlharvest.common import keys, registry
from rlharvest.services.rollout_manager.stream_accounting import parse_scale_record
from rlharvest.services.trainer import metrics
from rlharvest.services.trainer.lent_capacity import LentCapacity

log = logging.getLogger(__name__)


class ComputeThread:
    def __init__(self, job: str, torch_threads: int, borrow_lent_threads: int) -> None:
        self._job = job
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="train")
        self._lent = LentCapacity(torch_threads or torch.get_num_threads(),
                                  borrow_lent_threads, os.cpu_count() or 1) \
            if borrow_lent_threads else None
        self._lent_record: dict[str, object] | None = None
        # The SubmitStep in progress: a lent record of another step lends nothing to this one.
        self.step_id: str | None = None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the training thread."""
        if self._lent is not None:
            fn = partial(self._with_threads, self._lent, fn)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _with_threads(self, lent: LentCapacity, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn`` with the threads lent workers add now: decided and set here, on the training
        thread when the call runs (torch's thread count is per calling thread, and a call
        queued while workers were lent may run after they came back)."""
        threads = lent.threads(self._lent_record, self._job, self.step_id)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        metrics.THREADS.set(threads)
        if threads > lent.base_threads:
            metrics.LENT_THREAD_CALLS.inc()
        return fn(*args)

    async def watch_lent_workers(self, etcd: Any) -> None:
        """The job's stream-scale record (RollPacker §4.4), for ``--borrow-lent-threads``."""
        key = keys.stream_scale_key(self._job)
        async for event in registry.list_and_watch(etcd, key, prefix=False):
            raw = event.values.get(key) if isinstance(event, registry.Listing) else event.value
            try:
                self._lent_record = parse_scale_record(raw)
            except ValueError as exc:
                log.warning("ignoring the stream-scale record: %s", exc)
                self._lent_record = None

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
