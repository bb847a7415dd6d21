"""The manager's workers as etcd and their Session streams show them: the shell's worker side.

Membership (joins, record changes, leaves), the job's instance cap and start weights come from
etcd and go to the core (``RolloutControl``); each worker the core took in gets one link
(``rollout_worker/client.py``), whose events go to the shell's handler and which carries the
shell's adds and aborts down. Also the etcd reads a step's admission needs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

from rlharvest.common import keys, registry, start_weights
from rlharvest.common.etcd_outage import etcd_away, with_etcd
from rlharvest.common.errors import Unavailable
from rlharvest.common.pb import rollout_worker_pb2 as wpb
from rlharvest.services.rollout_manager import metrics
from rlharvest.services.rollout_manager.commands import (
    Abort,
    Command,
    Dispatch,
    Fail,
    Forget,
    Migrate,
    Release,
)
from rlharvest.services.rollout_manager.control_loop import RolloutControl
from rlharvest.services.rollout_manager.observer import ManagerObserver
from rlharvest.services.rollout_manager.sharding import shard_of
from rlharvest.services.rollout_manager.tracker import ResumePayload
from rlharvest.services.rollout_worker.client import WorkerLink, session_role

log = logging.getLogger(__name__)

# A worker lost while its record stays in etcd (its stream broke, or the first connection timed
# out while hundreds joined at once) is tried again, at first after REJOIN_FIRST_S and, while the
# tries fail, at doubling intervals up to REJOIN_MAX_S: without this it stayed out until its
# record changed, a capacity loss nothing would ever undo.
REJOIN_FIRST_S = 1.0
REJOIN_MAX_S = 30.0
PROBE_TIMEOUT_S = 2.0


class Workers:
    def __init__(self, control: RolloutControl, etcd, *, job: str, max_message_bytes: int,
                 on_event: Callable[[str, wpb.WorkerEvent], Awaitable[None]],
                 execute: Callable[[Sequence[Command]], None], wake: Callable[[], None],
                 observers: Sequence[ManagerObserver], shard: tuple[int, int] = (0, 1)) -> None:
        self._control = control
        self._etcd = etcd
        self._job = job
        self._announced_key = keys.weights_announced_key(job)
        self._cap_key = keys.instance_cap_key(job)
        self._max_message_bytes = max_message_bytes
        self._on_event = on_event
        self._execute = execute
        self._wake = wake
        self._observers = observers
        self._shard, self._shards = shard  # this manager's shard of the job (sharding.py)
        self.links: dict[str, WorkerLink] = {}
        self.endpoints: dict[str, dict] = {}  # worker id -> its member record
        self._records: dict[str, dict] = {}  # members serving here, as etcd shows them now
        self._rejoins: dict[str, asyncio.Task] = {}
        self._rejoin_delay: dict[str, float] = {}

    # ---- etcd ------------------------------------------------------------------------------------

    async def watch_workers(self) -> None:
        await self._watch("rollout_worker")

    async def watch_coexecutors(self) -> None:
        """Serving co-executors lent to this job (``job`` in their record) join as workers of
        kind ``serving``: the same Session contract, their own admission (ROSE's proxy)."""
        await self._watch("coexecutor")

    async def _watch(self, service: str) -> None:
        """Join only the members whose record names this job (a version is a job's;
        another job's worker at the same version number holds another policy): a dedicated,
        spot or seed worker's ``--job``, a co-executor lent to this job, a worker placed on a
        node whose turn is this job's (WEAVE, placement_follower.py) once it holds its weights."""
        async for event in registry.watch_members(self._etcd, service):
            self._note_record(event.member_id, None if event.kind == "leave" or
                              not self._serves_here(event.info, event.member_id) else event.info)
            if event.kind != "leave" and not self._serves_here(event.info, event.member_id):
                if event.member_id in self.links:  # lent to (or its node's turn is) another job
                    self.lose(event.member_id,
                              f"serves job {event.info.get('job') or 'none'!r} now")
                continue
            if event.kind == "leave":
                self.lose(event.member_id, "etcd lease expired or worker deregistered")
            elif event.kind == "join" or event.member_id not in self.links:
                await self._join(event.member_id, event.info)
            else:
                self._update(event.member_id, event.info)
            self._wake()

    def _serves_here(self, info: dict, member_id: str) -> bool:
        """This job's member, of this manager's shard (every manager of a shard, its standby
        too, computes the same set from etcd alone: sharding.py)."""
        return info.get("job") == self._job and (
            self._shards == 1 or shard_of(member_id, self._shards) == self._shard)

    def _note_record(self, worker_id: str, info: dict | None) -> None:
        """The member's record now (None: gone, or serving elsewhere). A pending rejoin ends
        with it: the watch's own join (or leave) supersedes it."""
        if info is None:
            self._records.pop(worker_id, None)
            self._rejoin_delay.pop(worker_id, None)
        else:
            self._records[worker_id] = info
        task = self._rejoins.pop(worker_id, None)
        if task is not None:
            task.cancel()

    def _rejoin_later(self, worker_id: str, greeted: bool) -> None:
        if worker_id not in self._records or worker_id in self._rejoins:
            return
        delay = REJOIN_FIRST_S if greeted else min(
            2 * self._rejoin_delay.get(worker_id, REJOIN_FIRST_S / 2), REJOIN_MAX_S)
        self._rejoin_delay[worker_id] = delay
        self._rejoins[worker_id] = asyncio.get_running_loop().create_task(
            self._rejoin(worker_id, delay), name=f"rejoin {worker_id}")

    async def _rejoin(self, worker_id: str, delay: float) -> None:
        """Join the worker again once its endpoint takes a connection (a dead one is not put
        back in the core, where dispatches would go to it and move again)."""
        try:
            while True:
                await asyncio.sleep(delay)
                info = self._records.get(worker_id)
                if info is None or worker_id in self.links:
                    return
                if await _answers(str(info["endpoint"])):
                    break
                delay = min(2 * delay, REJOIN_MAX_S)
                self._rejoin_delay[worker_id] = delay
        finally:
            if self._rejoins.get(worker_id) is asyncio.current_task():
                del self._rejoins[worker_id]
        log.info("worker %s: its record stands and it answers again; joining it", worker_id)
        await self._join(worker_id, info)
        self._wake()

    async def greet(self, timeout: float) -> list[str]:
        """Leadership begins (the watch loops run): wait up to ``timeout`` until every worker
        registered now has a session whose first event came, so the requests they keep for a
        successor are known before a client's step is taken. Returns those not greeted."""
        expected = set()
        for service in ("rollout_worker", "coexecutor"):
            for key, info in (await registry.list_members(self._etcd, service)).items():
                member_id = keys.parse_member_key(key)[1]
                if self._serves_here(info, member_id) and not info.get("draining"):
                    expected.add(member_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            missing = sorted(w for w in expected
                             if w not in self.links or not self.links[w].greeted)
            if not missing or loop.time() >= deadline:
                return missing
            await asyncio.sleep(0.02)

    async def watch_instance_cap(self) -> None:
        """The job's N_prem in etcd (RLBoost Algorithm 1): workers beyond it stand by."""
        async for event in registry.list_and_watch(self._etcd, self._cap_key, prefix=False):
            raw = (event.values.get(self._cap_key) if isinstance(event, registry.Listing)
                   else event.value)
            cap = registry.parse_instance_cap(raw)
            if cap != self._control.pool.instance_cap:
                self._control.pool.set_instance_cap(cap)
                log.info("instance cap for spot workers: %s", "none" if cap is None else cap)
            metrics.INSTANCE_CAP.set(-1 if cap is None else cap)
            self._wake()

    async def watch_start_weights(self) -> None:
        """The job's start weights by fingerprint (its trainer writes them): version-0
        requests go only to workers whose own are these."""
        key = keys.start_weights_key(self._job)
        async for event in registry.list_and_watch(self._etcd, key, prefix=False):
            raw = (event.values.get(key) if isinstance(event, registry.Listing)
                   else event.value)
            self._start_weights_seen(start_weights.parse_record(raw))

    def _start_weights_seen(self, fingerprint: str) -> None:
        if fingerprint != self._control.pool.start_weights:
            self._execute(self._control.job_start_weights(fingerprint))
            log.info("job %s starts from weights %s", self._job, fingerprint or "undeclared")
            self._wake()

    async def announced_for(self, version: int) -> int | None:
        """What admitting a step of ``version`` needs from etcd: the job's announced version,
        read only for a version no worker holds yet (None: not read, or none)."""
        if version == 0:  # fenced by the job's start weights: the latest record first
            await self._read_start_weights()
        return None if self._control.version_held(version) else await self.announced()

    async def _read_start_weights(self) -> None:
        """Before a version-0 step: the record as etcd has it now. The trainer writes it just
        before its first step, and the watch may not have brought it yet; unreadable, the
        watched value stands (the watch catches up when etcd is back)."""
        key = keys.start_weights_key(self._job).encode()
        try:
            found = await with_etcd(partial(self._etcd.get, key),
                                    "reading the job's start weights", deadline_s=2.0)
        except Exception as exc:
            if not etcd_away(exc):
                raise
            return
        self._start_weights_seen(start_weights.parse_record(found.value if found else None))

    async def announced(self) -> int | None:
        """The job's announced version, read while a client's SubmitStep waits: etcd away is
        waited out for up to 30 s, then the step is refused UNAVAILABLE, which the
        trainer retries, rather than held for as long as the outage lasts."""
        try:
            announced = await with_etcd(
                partial(registry.get_versioned, self._etcd, self._announced_key),
                "reading the job's announced version", deadline_s=30.0)
        except Exception as exc:
            if not etcd_away(exc):
                raise
            raise Unavailable(f"etcd unreachable for 30 s ({type(exc).__name__}) while reading "
                              "the job's announced version; retry the step") from None
        return None if announced is None else int(announced["version"])

    # ---- joins and losses ------------------------------------------------------------------------

    async def _join(self, worker_id: str, info: dict) -> None:
        old = self.links.pop(worker_id, None)
        if old is not None:  # the same id came back: a new process
            self.lose(worker_id, "re-registered")
            await old.close()
        if info.get("draining"):
            return
        kind = str(info.get("kind", "dedicated"))
        try:
            self._control.worker_joined(
                worker_id, int(info["weight_version"]), int(info["capacity"]), kind,
                str(info.get("admission", "slots")), int(info.get("vocab_size", 0)),
                str(info.get("start_weights", "")))
        except ValueError as exc:
            log.error("worker %s left out: %s", worker_id, exc)
            return
        self.links[worker_id] = WorkerLink(
            worker_id, info["endpoint"], self._on_event, self._on_broken,
            self._max_message_bytes, session_role(kind), job=self._job,
            start_weights=lambda: self._control.pool.start_weights)
        self.endpoints[worker_id] = info
        log.info("worker %s joined at %s with version %s", worker_id, info["endpoint"],
                 info["weight_version"])
        for observer in self._observers:
            observer.worker_joined(worker_id, kind)

    def _update(self, worker_id: str, info: dict) -> None:
        self.endpoints[worker_id] = info
        view = self._control.pool.get(worker_id) if worker_id in self._control.pool else None
        if view is None:
            return
        start = str(info.get("start_weights", ""))
        if int(info["weight_version"]) != view.weight_version or start != view.start_weights:
            self._execute(self._control.worker_version_changed(
                worker_id, int(info["weight_version"]), start))
        # Draining arrives over the worker's stream with its deadline (a worker event).

    def _on_broken(self, worker_id: str, reason: str) -> None:
        if worker_id in self.links and not self.links[worker_id].alive:
            self.lose(worker_id, reason)
            self._wake()

    def lose(self, worker_id: str, reason: str) -> None:
        if worker_id not in self._control.pool:
            return
        commands = self._control.worker_lost(worker_id, reason)
        self._execute(commands)
        self.gone(worker_id, reason, len(commands))

    def gone(self, worker_id: str, reason: str, moved: int) -> None:
        """The core lost the worker (``moved``: its requests that go elsewhere, carried out
        already): its link goes."""
        if moved:
            log.warning("worker %s lost (%s): %d requests go elsewhere, tokens kept", worker_id,
                        reason, moved)
        for observer in self._observers:
            observer.worker_lost(worker_id)
        link = self.links.pop(worker_id, None)
        if link is not None:
            asyncio.get_running_loop().create_task(link.close())
            self._rejoin_later(worker_id, link.greeted)

    def forget(self, worker_id: str) -> None:
        """Drop what the shell keeps about a worker the core forgot (its link went at the
        loss)."""
        self.endpoints.pop(worker_id, None)
        # Else the last values of its series stay exported for as long as the manager runs.
        metrics.ASSIGNED.remove(worker_id)
        metrics.PENDING.remove(worker_id)

    # ---- commands down -----------------------------------------------------------------------

    def command(self, c: Command, payloads: dict[str, ResumePayload]) -> None:
        """Carry out one command of the core (applied already; ``payloads``: what each send
        carries). A Fail's completion is the shell's to deliver."""
        if isinstance(c, Dispatch):
            self.send(c.worker_id, payloads[c.request_id])
        elif isinstance(c, Migrate):
            metrics.MIGRATIONS.labels(c.cause).inc()
            self.abort(c.src, c.request_id)
            self.send(c.dst, payloads[c.request_id])
        elif isinstance(c, Release):
            metrics.MIGRATIONS.labels(c.cause).inc()
            if c.abort:
                self.abort(c.worker_id, c.request_id)
        elif isinstance(c, (Fail, Abort)):
            if c.worker_id is not None:
                self.abort(c.worker_id, c.request_id)
        elif isinstance(c, Forget):
            self.forget(c.worker_id)

    def send(self, worker_id: str, payload: ResumePayload) -> None:
        link = self.links.get(worker_id)
        if link is None or not link.alive:
            self.lose(worker_id, "no live stream")
            return
        link.add(payload)

    def abort(self, worker_id: str, request_id: str) -> None:
        link = self.links.get(worker_id)
        if link is not None:
            link.abort([request_id])


async def _answers(endpoint: str) -> bool:
    """Whether ``host:port`` takes a TCP connection within PROBE_TIMEOUT_S."""
    host, _, port = endpoint.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), PROBE_TIMEOUT_S)
    except (OSError, ValueError, asyncio.TimeoutError):
        return False
    writer.close()
    return True
