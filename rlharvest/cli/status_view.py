"""`rlharvest status --watch`: a live view of a running stack.

Gathering a :class:`Snapshot` (etcd's member records, then every worker's, manager's and
trainer's status RPC, concurrently) is the only I/O; :func:`render` turns a snapshot into a rich
renderable and is pure, so tests render hand-built snapshots to text. :func:`watch` repeats the
two every interval: a ``rich.live.Live`` view on a terminal, one printed frame per refresh
otherwise (a pipe, a log file, a script).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from rlharvest.common import keys, registry, rpc
from rlharvest.common.aio import wait_event
from rlharvest.common.config import ConfigError
from rlharvest.common.pb import rollout_manager_pb2, rollout_manager_pb2_grpc
from rlharvest.common.pb import rollout_worker_pb2, rollout_worker_pb2_grpc
from rlharvest.common.pb import trainer_pb2, trainer_pb2_grpc

WORKER_LIKE = ("rollout_worker", "coexecutor")  # the same RolloutWorker contract (GetInfo)
GONE = "gone"  # the state of a member seen by an earlier refresh whose etcd record is gone


@dataclass(frozen=True)
class WorkerLoad:
    pending: int = 0
    executing: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    preemptions: int = 0
    tokens_per_second: float = 0.0


@dataclass(frozen=True)
class Member:
    """One member record in etcd, with what its own status RPC said (when it has one)."""

    service: str
    member_id: str
    endpoint: str = ""
    kind: str = ""
    job: str = ""
    weight_version: int | None = None
    state: str = "up"  # up | draining | lent to <job> | not lent | unreachable | gone | ...
    load: WorkerLoad | None = None  # workers and co-executors that answered GetInfo


@dataclass(frozen=True)
class ManagedWorker:
    """A worker as a rollout manager sees it."""

    worker_id: str
    state: str  # healthy | standby | draining | lost
    weight_version: int = 0


@dataclass(frozen=True)
class ManagerView:
    member_id: str
    job: str = ""
    reachable: bool = True
    workers: tuple[ManagedWorker, ...] = ()
    in_flight: int = 0
    waiting: int = 0
    completions: int = 0
    failures: int = 0
    migrations: int = 0


@dataclass(frozen=True)
class StepInProgress:
    step: int = 0
    weight_version: int = 0
    phase: str = ""
    samples: int = 0
    completions: int = 0
    groups_trained: int = 0
    tokens_generated: int = 0


@dataclass(frozen=True)
class StepDone:
    step: int
    mean_reward: float = 0.0
    step_time_s: float = 0.0
    tokens: int = 0
    tokens_per_second: float = 0.0
    weight_version: int = 0
    round: str = ""  # tail batching's round kind ("short" | "long"); "" when off


@dataclass(frozen=True)
class TrainerView:
    member_id: str
    job: str = ""
    reachable: bool = True
    state: str = ""  # starting | training | done | failed
    weight_version: int = 0
    steps_done: int = 0
    target_steps: int = 0
    current: StepInProgress | None = None
    recent: tuple[StepDone, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class Snapshot:
    etcd: str
    taken_at: float = 0.0  # time.time()
    refresh: int = 0  # 1 for the first
    etcd_error: str = ""  # why etcd did not answer; "" when it did
    last_ok_at: float = 0.0  # time.time() of the last refresh etcd answered; 0: never
    members: tuple[Member, ...] = ()
    managers: tuple[ManagerView, ...] = ()
    trainers: tuple[TrainerView, ...] = ()


# -- rendering (pure) ------------------------------------------------------------------------


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "never"


def _version(v: int | None) -> str:
    return "" if v is None else str(v)


def _kv(load: WorkerLoad) -> str:
    if not load.kv_capacity_tokens:
        return str(load.kv_used_tokens)
    pct = 100.0 * load.kv_used_tokens / load.kv_capacity_tokens
    return f"{load.kv_used_tokens}/{load.kv_capacity_tokens} ({pct:.0f}%)"


_STATE_STYLE = {"unreachable": "bold red", GONE: "bold red", "lost": "bold red",
                "failed": "bold red", "draining": "yellow", "standby": "yellow"}


def _state(state: str) -> Text:
    return Text(state, style=_STATE_STYLE.get(state, ""))


def _header(snap: Snapshot) -> RenderableType:
    head = Text(f"rlharvest status --watch · etcd {snap.etcd} · {_clock(snap.taken_at)} · "
                f"refresh {snap.refresh}", style="bold")
    if not snap.etcd_error:
        return head
    since = (f"the view below is from {_clock(snap.last_ok_at)}, when it last answered"
             if snap.last_ok_at else "is the stack up (`rlharvest up`)?")
    return Group(head, Text(f"etcd at {snap.etcd} is unreachable ({snap.etcd_error}); retrying "
                            f"every refresh; {since}", style="bold red"))


def _members_table(snap: Snapshot) -> RenderableType:
    if not snap.members:
        return Text("no members registered")
    table = Table(title="members", title_justify="left")
    for column in ("service", "member", "endpoint", "kind", "job", "version", "state"):
        table.add_column(column)
    for m in snap.members:
        table.add_row(m.service, m.member_id, m.endpoint, m.kind, m.job,
                      _version(m.weight_version), _state(m.state))
    return table


def _trainer_version(snap: Snapshot) -> int | None:
    versions = [t.weight_version for t in snap.trainers if t.reachable]
    return max(versions) if versions else None


def _workers_table(snap: Snapshot) -> RenderableType | None:
    workers = [m for m in snap.members if m.service in WORKER_LIKE]
    if not workers:
        return None
    trainer_v = _trainer_version(snap)
    title = "rollout workers" + ("" if trainer_v is None else f" (trainer at version {trainer_v})")
    table = Table(title=title, title_justify="left")
    for column in ("worker", "kind", "version", "behind", "pending", "executing", "KV used",
                   "preemptions", "tokens/s", "state"):
        table.add_column(column)
    for w in workers:
        behind = ("" if trainer_v is None or w.weight_version is None
                  else str(max(trainer_v - w.weight_version, 0)))
        load = w.load
        cells = (["", "", "", "", ""] if load is None else
                 [str(load.pending), str(load.executing), _kv(load), str(load.preemptions),
                  f"{load.tokens_per_second:.0f}"])
        table.add_row(w.member_id, w.kind, _version(w.weight_version), behind, *cells,
                      _state(w.state))
    return table


def _managers_table(snap: Snapshot) -> RenderableType | None:
    if not snap.managers:
        return None
    table = Table(title="rollout managers", title_justify="left")
    for column in ("manager", "job", "workers", "in flight", "waiting", "completions",
                   "failures", "migrations", "not healthy"):
        table.add_column(column)
    for m in snap.managers:
        if not m.reachable:
            table.add_row(m.member_id, m.job, _state("unreachable"), *[""] * 6)
            continue
        healthy = sum(w.state == "healthy" for w in m.workers)
        others = ", ".join(f"{w.worker_id} {w.state}" for w in m.workers if w.state != "healthy")
        table.add_row(m.member_id, m.job, f"{healthy}/{len(m.workers)} healthy",
                      str(m.in_flight), str(m.waiting), str(m.completions), str(m.failures),
                      str(m.migrations), Text(others, style="bold red" if others else ""))
    return table


def _trainer_part(t: TrainerView, last_steps: int) -> list[RenderableType]:
    if not t.reachable:
        return [Text(f"trainer {t.member_id} (job {t.job}): unreachable", style="bold red")]
    target = f"/{t.target_steps}" if t.target_steps else ""
    line = Text(f"trainer {t.member_id} (job {t.job}): {t.state}, {t.steps_done}{target} steps "
                f"done, weights at version {t.weight_version}",
                style="bold red" if t.state == "failed" else "bold")
    parts: list[RenderableType] = [line]
    if t.error:
        parts.append(Text(f"  error: {t.error}", style="red"))
    cur = t.current
    if cur is not None and t.state not in ("done", "failed"):
        parts.append(Text(
            f"  step in progress: step {cur.step} · phase {cur.phase or '?'} · completions "
            f"{cur.completions}/{cur.samples} samples · groups trained {cur.groups_trained} · "
            f"tokens {cur.tokens_generated} · on version {cur.weight_version}"))
    recent = t.recent[-last_steps:] if last_steps > 0 else t.recent
    if recent:
        tail = any(s.round for s in recent)
        table = Table(title=f"recent steps of {t.member_id}", title_justify="left")
        for column in ("step", "version", "reward", "time (s)", "tokens", "tokens/s",
                       *(["round"] if tail else [])):
            table.add_column(column, justify="right")
        for s in recent:
            table.add_row(str(s.step), str(s.weight_version), f"{s.mean_reward:.3f}",
                          f"{s.step_time_s:.2f}", str(s.tokens), f"{s.tokens_per_second:.0f}",
                          *([s.round] if tail else []))
        parts.append(table)
    return parts


def render(snap: Snapshot, last_steps: int = 5) -> RenderableType:
    """The whole view of one snapshot; ``last_steps`` finished steps per trainer."""
    parts: list[RenderableType] = [_header(snap)]
    if not snap.etcd_error or snap.members:  # etcd never answered: nothing to list
        parts.append(_members_table(snap))
    for table in (_workers_table(snap), _managers_table(snap)):
        if table is not None:
            parts.append(table)
    for trainer in snap.trainers:
        parts.extend(_trainer_part(trainer, last_steps))
    return Group(*parts)


# -- gathering (the I/O) ---------------------------------------------------------------------

_Reply = TypeVar("_Reply")


async def _ask(endpoint: str, call: Callable[[grpc.aio.Channel], Awaitable[_Reply]],
               timeout: float, peer_role: str | None = None) -> _Reply | None:
    """One status RPC; None when the member does not answer (whatever the reason).
    ``peer_role``: the role the member's certificate must name under TLS (rpc.channel)."""
    if not endpoint:
        return None
    try:
        async with rpc.channel(endpoint, peer_role=peer_role) as chan:
            return await asyncio.wait_for(call(chan), timeout + 1.0)
    except (grpc.aio.AioRpcError, asyncio.TimeoutError, OSError, ValueError):
        return None


def _worker(info: dict[str, Any], member_id: str, service: str,
            reply: rollout_worker_pb2.WorkerInfo | None) -> Member:
    job = str(info.get("job") or "")
    state = "draining" if info.get("draining") else "up"
    if service == "coexecutor" and state == "up":
        state = f"lent to {job}" if job else "not lent"
    load = None
    version = info.get("weight_version")
    if reply is None:
        state = "unreachable"
    else:
        w = reply.load
        load = WorkerLoad(w.pending, w.executing, w.kv_used_tokens, w.kv_capacity_tokens,
                          w.preemptions, w.tokens_per_second)
        version = reply.weight_version
        if reply.draining:
            state = "draining"
    return Member(service, member_id, str(info.get("endpoint", "")), str(info.get("kind", "")),
                  job, None if version is None else int(version), state, load)


def _manager(member_id: str, job: str,
             reply: rollout_manager_pb2.ManagerStatus | None) -> ManagerView:
    if reply is None:
        return ManagerView(member_id, job, reachable=False)
    return ManagerView(member_id, job, True,
                       tuple(ManagedWorker(w.worker_id, w.state, w.weight_version)
                             for w in reply.workers),
                       reply.in_flight, reply.waiting, reply.completions, reply.failures,
                       reply.migrations)


def _trainer(member_id: str, job: str, reply: trainer_pb2.TrainerStatus | None) -> TrainerView:
    if reply is None:
        return TrainerView(member_id, job, reachable=False)
    c = reply.current
    return TrainerView(
        member_id, reply.job or job, True, reply.state, reply.weight_version, reply.steps_done,
        reply.target_steps,
        StepInProgress(c.step, c.weight_version, c.phase, c.samples, c.completions,
                       c.groups_trained, c.tokens_generated),
        tuple(StepDone(s.step, s.mean_reward, s.step_time_s, s.tokens, s.tokens_per_second,
                       s.weight_version, s.round) for s in reply.steps),
        reply.error)


async def gather(members: dict[str, dict], timeout: float, last_steps: int
                 ) -> tuple[list[Member], list[ManagerView], list[TrainerView]]:
    """Ask every worker, co-executor, manager and trainer in ``members`` (etcd's records) for its
    status, concurrently; a member that does not answer within ``timeout`` is unreachable."""
    found: list[tuple[str, str, dict[str, Any]]] = []
    for key, info in sorted(members.items()):
        try:
            service, member_id = keys.parse_member_key(key)
        except ValueError:
            continue
        found.append((service, member_id, info))

    async def one(service: str, member_id: str, info: dict[str, Any]) -> Any:
        endpoint = str(info.get("endpoint", ""))
        job = str(info.get("job") or "")
        if service in WORKER_LIKE:
            reply = await _ask(endpoint, lambda ch: rollout_worker_pb2_grpc.RolloutWorkerStub(
                ch).GetInfo(rollout_worker_pb2.GetInfoRequest(), timeout=timeout), timeout)
            return _worker(info, member_id, service, reply)
        if service == "rollout_manager":
            reply_m = await _ask(endpoint, lambda ch: rollout_manager_pb2_grpc.RolloutManagerStub(
                ch).GetStatus(rollout_manager_pb2.GetStatusRequest(), timeout=timeout), timeout,
                peer_role="manager")
            return _manager(member_id, job, reply_m)
        if service == "trainer":
            reply_t = await _ask(endpoint, lambda ch: trainer_pb2_grpc.TrainerStub(ch).GetStatus(
                trainer_pb2.TrainerStatusRequest(last_steps=max(last_steps, 0)),
                timeout=timeout), timeout)
            return _trainer(member_id, job, reply_t)
        return None

    answers = await asyncio.gather(*(one(*f) for f in found))
    rows: list[Member] = []
    managers: list[ManagerView] = []
    trainers: list[TrainerView] = []
    for (service, member_id, info), answer in zip(found, answers):
        if isinstance(answer, Member):
            rows.append(answer)
            continue
        version = info.get("weight_version")
        state = "draining" if info.get("draining") else str(info.get("state") or info.get(
            "role") or "up")
        if isinstance(answer, ManagerView):
            managers.append(answer)
            state = state if answer.reachable else "unreachable"
        elif isinstance(answer, TrainerView):
            trainers.append(answer)
            if answer.reachable:
                state, version = answer.state or state, answer.weight_version
            else:
                state = "unreachable"
        rows.append(Member(service, member_id, str(info.get("endpoint", "")),
                           str(info.get("kind", "")), str(info.get("job") or ""),
                           None if version is None else int(version), state))
    return rows, managers, trainers


@dataclass
class Watcher:
    """Takes one snapshot per :meth:`refresh`: keeps its etcd client between refreshes (and
    reconnects when etcd went away), remembers the members it saw so one whose record left etcd
    shows as gone, and the last good snapshot for while etcd is unreachable."""

    etcd: str
    timeout: float = 2.0
    last_steps: int = 5
    _client: Any = None
    _seen: dict[tuple[str, str], Member] = field(default_factory=dict)
    _last: Snapshot | None = None
    _refreshes: int = 0

    async def refresh(self) -> Snapshot:
        self._refreshes += 1
        now = time.time()
        try:
            if self._client is None:
                self._client = await registry.connect(self.etcd, timeout=self.timeout)
            records = await asyncio.wait_for(registry.list_members(self._client), self.timeout)
        except Exception as exc:  # etcd down or gone: say so, keep the last view, retry
            await self.close()
            reason = str(exc) if isinstance(exc, (ConnectionError, ConfigError)) else repr(exc)
            reason = reason.removeprefix(f"etcd at {self.etcd} did not answer: ")
            base = self._last or Snapshot(self.etcd)
            return replace(base, taken_at=now, refresh=self._refreshes,
                           etcd_error=reason or type(exc).__name__)
        rows, managers, trainers = await gather(records, self.timeout, self.last_steps)
        current = {(m.service, m.member_id): m for m in rows}
        for key, member in self._seen.items():
            if key not in current:
                current[key] = replace(member, state=GONE, load=None)
        self._seen = current
        self._last = Snapshot(self.etcd, now, self._refreshes, "", now,
                              tuple(current[k] for k in sorted(current)),
                              tuple(managers), tuple(trainers))
        return self._last

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()


async def watch(etcd: str, console: Console, *, interval: float = 1.0, timeout: float = 2.0,
                last_steps: int = 5, max_refreshes: int = 0) -> Snapshot | None:
    """Refresh every ``interval`` seconds until SIGINT/SIGTERM (or ``max_refreshes``, when > 0);
    returns the last snapshot. A terminal gets a live view; anything else one frame a refresh."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    watcher = Watcher(etcd, timeout, last_steps)
    snap: Snapshot | None = None
    live = Live(console=console, auto_refresh=False, transient=False,
                vertical_overflow="visible") if console.is_terminal else None
    try:
        with live if live is not None else contextlib.nullcontext():
            while not stop.is_set():
                started = loop.time()
                snap = await watcher.refresh()
                frame = render(snap, last_steps)
                if live is not None:
                    live.update(frame, refresh=True)
                else:
                    console.rule(f"refresh {snap.refresh}")
                    console.print(frame)
                    console.file.flush()
                if max_refreshes and snap.refresh >= max_refreshes:
                    break
                wait = max(interval - (loop.time() - started), 0.0)
                await wait_event(stop, wait)
    finally:
        await watcher.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
    return snap
