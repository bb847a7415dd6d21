"""The one lifecycle every service runs. A service is a declaration — ``ServiceSpec``: its name,
config model and a build step that returns its ``Parts`` — and the host does the rest:

startup
    logging -> etcd -> gRPC port bound (so ``host.endpoint`` is known to the build step) ->
    ``spec.build(host)`` -> gRPC served with health and reflection -> HTTP ``/metrics`` and
    ``/healthz`` -> membership registered under a lease -> background loops started -> gRPC
    health SERVING (a client that sees it finds the member in etcd).
teardown, once, in this order, whatever stopped the service (SIGTERM or SIGINT, ``host.stop``,
a loop that crashed under the "stop" policy, a failed startup)
    stop accepting (gRPC health NOT_SERVING, ``parts.stop_accepting``) -> ``parts.drain`` ->
    gRPC stop within ``shutdown_grace`` -> loops cancelled -> deregistered -> HTTP closed ->
    etcd closed -> ``parts.close`` hooks, in order.

A stop during startup ends it: a build still running is cancelled (a build that awaits its slow
part, e.g. a model loaded in a daemon thread, ``rlharvest/common/daemon_thread.py``, ends at once; one that
holds the event loop is seen to be stopped when it returns), and a service stopped before it
registers never serves or registers, nor starts its loops (a standby's start before it
registers); the teardown then undoes what startup
did, with the stop's exit code (0 on SIGTERM).

A loop that raises is logged with its traceback and, by its ``on_crash`` policy, restarted after
a backoff or made to stop the service with exit code 1: a loop never dies silently. A step of
the teardown that fails is logged and the next one runs.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Literal, Protocol, TypeVar, cast

import aetcd
import grpc
from aiohttp import web
from pydantic import SecretStr

from rlharvest.common import registry, rpc, tls
from rlharvest.common.config import ServiceConfig
from rlharvest.common.etcd_outage import with_etcd
from rlharvest.common.observability import HealthCheck, setup_logging, start_http
from rlharvest.common.retry import Backoff

log = logging.getLogger(__name__)
# This process in the member record: a restart under the same id and address is another
# incarnation (a client that lost its stream tells a dead peer's successor from the peer).
INCARNATION = secrets.token_hex(8)
C = TypeVar("C", bound=ServiceConfig)

# A loop that ran this long before it crashed starts its restart backoff over.
_HEALTHY_RUN_S = 30.0
_ETCD_START_WAIT_S = 60.0  # how long a starting service waits for etcd before it fails


class HostedConfig(Protocol):
    """The fields every hosted service's config has; the host reads them."""

    etcd: str
    host: str
    port: int
    advertise_host: str
    metrics_port: int
    max_message_bytes: int
    lease_ttl: int
    shutdown_grace: float
    log_level: str
    json_logs: bool
    tls_cert: str
    tls_key: str
    tls_ca: str
    etcd_username: str
    etcd_password: SecretStr
    etcd_token_renew_s: float


@dataclass(frozen=True)
class StopReason:
    """Why the service stops: handed to ``Parts.drain``. ``from_signal``: SIGTERM or SIGINT."""

    message: str
    exit_code: int = 0
    from_signal: bool = False


@dataclass(frozen=True)
class Loop:
    """A background loop: ``run()`` is called again for each restart. On a crash, "stop" stops
    the service with exit code 1; "restart" calls ``run()`` again after ``backoff``. A loop that
    returns is done (logged) and the service goes on; one that ends the service calls
    ``host.stop``."""

    name: str
    run: Callable[[], Awaitable[None]]
    on_crash: Literal["stop", "restart"] = "stop"
    backoff: Backoff = Backoff(first_s=0.5, max_s=30.0)


@dataclass(frozen=True)
class Servicer:
    """A gRPC servicer: the implementation, its generated ``add_..._to_server`` and its full
    service name (for health and reflection)."""

    impl: object
    add: Callable[[Any, grpc.aio.Server], None]
    name: str


@dataclass
class Parts:
    """What a service's build step returns. ``member_info`` is published in etcd next to the
    ``endpoint`` and ``metrics`` addresses the host adds. gRPC health turns SERVING once the
    member is registered and its loops run; ``serving`` False leaves it NOT_SERVING (a leader
    standby sets it with ``host.set_serving``; a warm standby serves once activated)."""

    member_id: str
    servicers: Sequence[Servicer]
    health: HealthCheck
    member_info: Mapping[str, Any] = field(default_factory=dict)
    on_scrape: Callable[[], None] | None = None
    loops: Sequence[Loop] = ()
    serving: bool = True
    stop_accepting: Callable[[], None] | None = None
    drain: Callable[[StopReason], Awaitable[None]] | None = None
    close: Sequence[Callable[[], Awaitable[None] | None]] = ()
    # A warm standby: its loops start at once (they must not need the membership) and the
    # service registers only when this returns (``member_info`` is read then, so it may be
    # brought up to date first); a stop meanwhile ends it unregistered.
    standby: Callable[[], Awaitable[None]] | None = None


@dataclass(frozen=True)
class ServiceSpec(Generic[C]):
    """A service, declared: ``name`` (logs, membership, the ``rlharvest-<name>`` command),
    its config model (which must have every ``HostedConfig`` field) and its build step."""

    name: str
    config: type[C]
    build: Callable[[Host[C]], Awaitable[Parts]]
    doc: str | None = None
    # A service launched as a multi-rank job (torchrun, the deepspeed launcher): rank 0 is the
    # service (this host); ranks 1..N-1 run ``follower(config)`` instead, which returns the exit
    # code. None: the service runs as one process and refuses a rank above 0.
    follower: Callable[[C], int] | None = None
    # Offline tools of the service, run as ``rlharvest-<name> <tool> ...`` instead of serving
    # (e.g. the co-executor's ``profile``): name -> a command taking the rest of the arguments
    # and returning an exit code.
    tools: Mapping[str, Callable[[list[str]], int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = sorted(set(HostedConfig.__annotations__) - set(self.config.model_fields))
        if missing:
            raise TypeError(f"{self.config.__name__} lacks the fields the service host reads: "
                            f"{', '.join(missing)}")

    @property
    def program(self) -> str:
        return "rlharvest-" + self.name.replace("_", "-")


class Host(Generic[C]):
    """One running service, as its build step and loops see it."""

    def __init__(self, spec: ServiceSpec[C], config: C) -> None:
        self.spec = spec
        self.config = config
        self.endpoint = ""  # host:port others dial; set before the build step runs
        self.membership: registry.Membership | None = None  # set once registered
        self.reason: StopReason | None = None
        self._etcd: aetcd.Client | None = None
        self._bound: grpc.aio.Server | None = None
        self._server: rpc.Server | None = None
        self._http: web.AppRunner | None = None
        self._parts: Parts | None = None
        self._loops: set[asyncio.Task] = set()
        self._loops_cancelled = False
        self._exit_code = 0
        self._stopping = asyncio.Event()
        self._signalled: asyncio.Event | None = None

    @property
    def etcd(self) -> aetcd.Client:
        assert self._etcd is not None, "etcd is connected before the build step runs"
        return self._etcd

    def stop(self, message: str, exit_code: int = 0) -> None:
        """Ask for the teardown. The first reason is the one drained with; the exit code is
        non-zero if any request's was."""
        self._request_stop(StopReason(message, exit_code))

    def start_loop(self, loop: Loop) -> None:
        """Supervise ``loop`` from now on (loops that begin later than startup, e.g. a
        leader's); it is cancelled with the others at teardown, and not started after it."""
        if self._loops_cancelled:
            log.info("not starting loop %r: the service has stopped", loop.name)
            return
        task = asyncio.get_running_loop().create_task(self._supervise(loop),
                                                      name=f"loop {loop.name}")
        self._loops.add(task)
        task.add_done_callback(self._loops.discard)

    async def set_serving(self, serving: bool) -> None:
        if self._server is not None:
            await self._server.set_serving(serving)

    async def run(self, signalled: asyncio.Event) -> int:
        """Start, serve until stopped, tear down; returns the process exit code."""
        cfg = cast(HostedConfig, self.config)
        self._signalled = signalled
        watcher = asyncio.create_task(self._on_signal(signalled), name="signals")
        try:
            await self._start(cfg)
        except Exception as exc:
            log.exception("%s failed to start", self.spec.name)
            self.stop(f"startup failed: {exc!r}", exit_code=1)
        await self._stopping.wait()
        watcher.cancel()
        await self._teardown(cfg)
        return self._exit_code

    # ---- startup -------------------------------------------------------------------------------

    async def _start(self, cfg: HostedConfig) -> None:
        _process_wide(cfg)  # every server, channel and etcd client after this
        # Started while etcd restarts (a supervisor's restart beside etcd's): wait for it as
        # every later etcd call does (etcd_outage.py), up to a minute, then fail with the
        # connection's error; a stop meanwhile ends the wait.
        connect = with_etcd(partial(registry.connect, cfg.etcd), "connecting to etcd",
                            deadline_s=_ETCD_START_WAIT_S)
        task = asyncio.ensure_future(connect)
        if not await self._until_stopped(task):
            return
        self._etcd = task.result()
        self._bound, port = rpc.bind_server(cfg.host, cfg.port, cfg.max_message_bytes)
        advertise = cfg.advertise_host or cfg.host
        self.endpoint = f"{advertise}:{port}"
        build = asyncio.ensure_future(self.spec.build(self))
        built = await self._until_stopped(build)
        if built:  # kept even when stopped now: the teardown runs its close hooks
            parts = self._parts = build.result()
        if not built or self._stop_requested():  # the latter seen only after a build that
            log.info("%s stopped while it was being built", self.spec.name)  # held the loop
            return
        self._server = server = await rpc.serve(
            self._bound, port, [partial(s.add, s.impl) for s in parts.servicers],
            [s.name for s in parts.servicers], serving=False)
        self._http, metrics_port = await start_http(
            cfg.host, cfg.metrics_port, parts.health, on_scrape=parts.on_scrape,
            ready=lambda: server.serving)
        if parts.standby is not None:
            for loop in parts.loops:
                self.start_loop(loop)
            log.info("%s %s standing by on %s", self.spec.name, parts.member_id, self.endpoint)
            if not await self._until_stopped(parts.standby()):
                return
        if self._stop_requested():  # never registered: no member record for clients to find
            return
        info = {**parts.member_info, "endpoint": self.endpoint,
                "metrics": f"{advertise}:{metrics_port}", "incarnation": INCARNATION}
        # etcd may go away between the connection and this (a restart): wait for it here too.
        register = asyncio.ensure_future(with_etcd(
            partial(registry.register, self.etcd, self.spec.name, parts.member_id, info,
                    ttl=cfg.lease_ttl), "registering", deadline_s=_ETCD_START_WAIT_S))
        if not await self._until_stopped(register):
            return
        self.membership = register.result()
        if parts.standby is None:
            for loop in parts.loops:
                self.start_loop(loop)
        if parts.serving:  # only now: a client that saw SERVING finds the member registered
            await self.set_serving(True)
        log.info("%s %s serving on %s (metrics on %d)", self.spec.name, parts.member_id,
                 self.endpoint, metrics_port)

    async def _until_stopped(self, work: Awaitable[Any]) -> bool:
        """Await ``work`` unless the service is told to stop first (then it is cancelled, and
        has ended when this returns); True when it finished (its exception raised here)."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return False
        task.result()
        return True

    def _stop_requested(self) -> bool:
        """A stop asked for, or a signal whose handler has run but not yet reached the host."""
        return self._stopping.is_set() or (self._signalled is not None
                                           and self._signalled.is_set())

    async def _on_signal(self, signalled: asyncio.Event) -> None:
        await signalled.wait()
        self._request_stop(StopReason("shutting down on a signal", 0, from_signal=True))

    def _request_stop(self, reason: StopReason) -> None:
        self._exit_code = self._exit_code or reason.exit_code
        if self.reason is None:
            self.reason = reason
            (log.error if reason.exit_code else log.info)("%s stopping: %s", self.spec.name,
                                                          reason.message)
        elif reason.exit_code:
            log.error("%s, while stopping: %s", self.spec.name, reason.message)
        self._stopping.set()

    # ---- loops -------------------------------------------------------------------------------

    async def _supervise(self, loop: Loop) -> None:
        failures = 0
        while True:
            started = time.monotonic()
            try:
                await loop.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if loop.on_crash == "stop":
                    log.error("loop %r crashed; stopping the service", loop.name, exc_info=True)
                    self.stop(f"loop {loop.name!r} crashed: {exc!r}", exit_code=1)
                    return
                failures = 1 if time.monotonic() - started >= _HEALTHY_RUN_S else failures + 1
                delay = loop.backoff.delay(failures)
                log.error("loop %r crashed (%d in a row); restarting it in %.1fs", loop.name,
                          failures, delay, exc_info=True)
                await asyncio.sleep(delay)
                continue
            log.info("loop %r finished", loop.name)
            return

    # ---- teardown ----------------------------------------------------------------------------

    async def _teardown(self, cfg: HostedConfig) -> None:
        parts, reason = self._parts, self.reason
        assert reason is not None
        if self.membership is not None and parts is not None:  # started: it served
            await _step("stop accepting", self._stop_accepting)
            if parts.drain is not None:
                await _step("drain", partial(parts.drain, reason))
        if self._server is not None:
            await _step("gRPC stop", partial(self._server.stop, cfg.shutdown_grace))
        elif self._bound is not None:  # bound, never served: a listener closes once started
            await _step("gRPC release", partial(_release, self._bound))
        await _step("loop cancel", self._cancel_loops)
        if self.membership is not None:
            await _step("deregister", self.membership.close)
        if self._http is not None:
            await _step("HTTP cleanup", self._http.cleanup)
        if self._etcd is not None:
            await _step("etcd close", self._etcd.close)
        for hook in parts.close if parts is not None else ():
            await _step("close hook", hook)
        log.info("%s %s stopped (%s; exit code %d)", self.spec.name,
                 parts.member_id if parts else "", reason.message, self._exit_code)

    async def _stop_accepting(self) -> None:
        await self.set_serving(False)
        if self._parts is not None and self._parts.stop_accepting is not None:
            self._parts.stop_accepting()

    async def _cancel_loops(self) -> None:
        self._loops_cancelled = True
        tasks = list(self._loops)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _release(server: grpc.aio.Server) -> None:
    await server.start()
    await server.stop(None)


async def _step(name: str, action: Callable[[], Awaitable[Any] | Any]) -> None:
    """Run one teardown step; a failure is logged and the teardown goes on."""
    try:
        result = action()
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("teardown step %s failed; going on", name)


def launch_rank() -> tuple[int, int]:
    """(rank, world size) as torchrun / the deepspeed launcher set them; (0, 1) when alone."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def follow(spec: ServiceSpec[C], config: C) -> int:
    """A rank above 0 of a multi-rank launch: no port, no etcd, no membership; it does what
    rank 0 tells it (``spec.follower``). Its logs carry the rank."""
    rank, world = launch_rank()
    if spec.follower is None:
        raise ValueError(f"{spec.program} runs as one process, but was launched as rank {rank} "
                         f"of {world}")
    cfg = cast(HostedConfig, config)
    setup_logging(f"{spec.name}-rank{rank}", cfg.log_level, cfg.json_logs)
    _process_wide(cfg)  # a rank publishes its shard itself: over TLS like rank 0
    return spec.follower(config)


def _process_wide(cfg: HostedConfig) -> None:
    """What every channel, server and etcd client of this process uses: TLS and credentials."""
    tls.configure(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
    registry.use_credentials(cfg.etcd_username, cfg.etcd_password.get_secret_value(),
                             cfg.etcd_token_renew_s)


async def serve(spec: ServiceSpec[C], config: C, signalled: asyncio.Event) -> int:
    """Run ``spec`` with ``config`` until it stops (``signalled`` set, ``host.stop``, a crash);
    returns the exit code: 0 after a clean stop, 1 after a crash or a failed startup. Logs go
    to stderr as the config says (structured JSON by default)."""
    cfg = cast(HostedConfig, config)
    setup_logging(spec.name, cfg.log_level, cfg.json_logs)
    return await Host(spec, config).run(signalled)
