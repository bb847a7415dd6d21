"""Start rlharvest services as local processes: `rlharvest up`, the demo and the integration
tests all use this, so what the tests exercise is what an operator runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import aetcd

import rlharvest
from rlharvest.common import etcd_roles, registry
from rlharvest.common.etcd_maintenance import EtcdMaintainer, MaintenanceConfig
from rlharvest.common.authorization import SERVICE_ROLES
from rlharvest.common.fork_server import ForkedProcess, ForkServer
from rlharvest.common.local_etcd import LocalEtcd
from rlharvest.common.tls import LocalCA

# The checkout (or install) this launcher runs from: its children import the same code.
_IMPORT_ROOT = str(Path(rlharvest.__file__).resolve().parent.parent)

# service -> module with a typer `app` and a __main__ guard
MODULES = {
    "rollout_worker": "rlharvest.services.rollout_worker.main",
    "rollout_manager": "rlharvest.services.rollout_manager.main",
    "trainer": "rlharvest.services.trainer.main",
    "transfer_agent": "rlharvest.services.transfer_agent.main",
    "placement_scheduler": "rlharvest.services.placement_scheduler.main",
    "coexecutor": "rlharvest.services.coexecutor.main",
}


_DIST_ENV = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a service process: this one's, with this launcher's checkout first on
    PYTHONPATH (the child runs the same code) and without a torch.distributed rendezvous (each
    service is its own process group: an inherited one, from a test that ran DeepSpeed
    in-process, would collide on its port)."""
    inherited = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    path = os.pathsep.join(filter(None, [_IMPORT_ROOT, inherited.get("PYTHONPATH", "")]))
    return {**inherited, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(extra or {})}


@dataclass
class ServiceProcess:
    service: str
    name: str
    process: subprocess.Popen | ForkedProcess
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL of the process and everything it started (a launcher's ranks): the crash a
        spot preemption, an OOM or a lost node looks like."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def activate(self) -> None:
        """SIGUSR1: a worker started with --standby joins the managers."""
        self.process.send_signal(signal.SIGUSR1)

    def rank_pids(self) -> list[int]:
        """The pids of a multi-rank job's ranks, by rank (from their RANK variable)."""
        import psutil  # DeepSpeed's dependency; only multi-rank jobs need it

        found = {}
        for child in psutil.Process(self.process.pid).children():
            with contextlib.suppress(psutil.Error, KeyError, ValueError):
                found[int(child.environ()["RANK"])] = child.pid
        return [found[r] for r in sorted(found)]

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful: drain, deregister), then SIGKILL if it overstays."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()  # its whole group: a launcher's ranks must not outlive it
        return self.process.wait()  # at once: it has exited

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalStack:
    log_dir: Path
    etcd: LocalEtcd | None = None
    processes: list[ServiceProcess] = field(default_factory=list)
    # Mutual TLS: every service started gets a certificate of this CA for its role, and an
    # etcd started here serves them over TLS (an https:// endpoint) with one of its own.
    ca: LocalCA | None = None
    # Single-rank services are forked from this server (imports done once) when the
    # environment allows it; see fork_server.py. Without one, each is a fresh interpreter.
    fork_server: ForkServer | None = None
    # With ``ca``: etcd's users and roles (etcd_roles.py), so each service's certificate writes
    # only its role's keys. This process acts on etcd as ``etcd_admin`` (the common name of the
    # certificate it configured, tls.configure), which gets etcd's root role.
    etcd_roles: bool = False
    etcd_admin: str = "operator"
    # Compaction and defragmentation of the stack's etcd, from this process (it holds the
    # admin's certificate a defrag needs): start_etcd_maintenance.
    maintenance: MaintenanceThread | None = None

    @contextlib.contextmanager
    def stopped_on_error(self) -> Iterator[LocalStack]:
        """Stop everything started so far when the block raises (a service that never became
        healthy, Ctrl-C): a stack half started is not left running behind the caller."""
        try:
            yield self
        except BaseException:
            self.stop()
            raise

    def start_etcd(self) -> str:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.etcd = LocalEtcd(log_path=self.log_dir / "etcd.log", ca=self.ca).start()
        if self.etcd_roles:
            if self.ca is None:
                raise ValueError("etcd's roles need TLS: its users are certificates' names")
            self.as_etcd_admin(partial(etcd_roles.install, admins=(self.etcd_admin,)))
        return self.etcd.endpoint

    def start_etcd_maintenance(self, config: MaintenanceConfig = MaintenanceConfig(),
                               period_s: float = 10.0) -> EtcdMaintainer:
        """Keep this stack's etcd small (etcd_maintenance.py) until ``stop``: from this
        process, which outlives etcd's restarts and holds the root role under auth."""
        assert self.etcd is not None, "start etcd first"
        endpoint = self.etcd.endpoint
        maintainer = EtcdMaintainer(partial(registry.connect, endpoint), config, period_s)
        self.maintenance = MaintenanceThread(maintainer)
        return maintainer

    def add_etcd_user(self, name: str, role: str) -> None:
        """A certificate named ``name`` acts in etcd as ``role`` (a service role)."""
        self.as_etcd_admin(partial(etcd_roles.add_user, name=name, role=role))

    def as_etcd_admin(self, action: Callable[[aetcd.Client], Awaitable[None]]) -> None:
        """Run ``action`` with an etcd client of this process, whether or not the caller runs
        an event loop (tests start services from async code): in a thread of its own."""
        assert self.etcd is not None
        endpoint = self.etcd.endpoint

        async def run() -> None:
            client = await registry.connect(endpoint)
            try:
                await action(client)
            finally:
                await client.close()

        with ThreadPoolExecutor(1) as pool:
            pool.submit(lambda: asyncio.run(run())).result()

    def start(self, service: str, name: str, flags: list[str] | None = None,
              env: dict[str, str] | None = None, ranks: int = 1,
              restarts: int = 0) -> ServiceProcess:
        """``ranks`` > 1: a multi-rank job under ``torchrun`` on this machine, which restarts
        the whole group up to ``restarts`` times when a rank dies (the trainer)."""
        if self.etcd is None:
            raise RuntimeError("start etcd first")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        launcher = [] if ranks == 1 else [
            "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            f"--max-restarts={restarts}", "--monitor-interval=0.5"]
        tls_flags = [] if self.ca is None else self.ca.flags(
            name, SERVICE_ROLES[service], _jobs_of(service, flags or []))
        if self.etcd_roles:  # the certificate's name becomes an etcd user of its role
            self.add_etcd_user(name, SERVICE_ROLES[service])
        args = ["--etcd", self.etcd.endpoint, *tls_flags, *(flags or [])]
        child_env = child_environment(env)
        proc: subprocess.Popen | ForkedProcess
        if ranks == 1 and self.fork_server is not None and self.fork_server.can_fork(child_env):
            proc = self.fork_server.spawn(MODULES[service], args, child_env, log_path)
        else:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen([sys.executable, *launcher, "-m", MODULES[service], *args],
                                        stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                        start_new_session=True)
        started = ServiceProcess(service, name, proc, log_path)
        self.processes.append(started)
        return started

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful stop of everything, services first (they drain and deregister), etcd last."""
        for proc in self.processes:
            if proc.alive():
                proc.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            try:
                proc.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.maintenance is not None:
            self.maintenance.stop()
            self.maintenance = None
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None


class MaintenanceThread:
    """``maintainer.run()`` on an event loop of its own in a daemon thread, so a synchronous
    launcher (or one whose loop is busy) keeps maintaining etcd; ``stop`` cancels it."""

    def __init__(self, maintainer: EtcdMaintainer):
        self.maintainer = maintainer
        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(maintainer.run())  # before the thread: stop sees it
        self._thread = threading.Thread(target=self._main, name="etcd-maintenance", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._task)
        self._loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(RuntimeError):  # its loop already closed: nothing to cancel
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout)


# What the fork server imports: the libraries that make a service's start slow (torch and
# transformers are ~4 s of the trainer's ~4.5 s). Not gRPC, nor anything that imports it (aetcd,
# rlharvest's own modules): a gRPC core imported before a fork does not notice a dead peer's
# closed socket in the child for a minute (a SIGKILLed manager's trainer hung until a keepalive).
FORK_PRELOAD = ("torch", "transformers", "transformers.models.auto.modeling_auto",
                "transformers.models.qwen3.modeling_qwen3", "numpy", "aiohttp", "pydantic_settings",
                "typer", "rich", "prometheus_client", "safetensors.torch", "uvloop")


def service_fork_server() -> ForkServer:
    """A started fork server that has imported the services' heavy libraries."""
    return ForkServer(FORK_PRELOAD, child_environment()).start()


def _jobs_of(service: str, flags: list[str]) -> tuple[str, ...]:
    """The jobs a service's certificate names: a trainer's own (``--job``, else the trainer
    config's default, "default"), which it alone may submit steps and publish weights for;
    none for the other services."""
    if service != "trainer":
        return ()
    for i, flag in enumerate(flags):
        if flag.startswith("--job="):
            return (flag.split("=", 1)[1],)
        if flag == "--job" and i + 1 < len(flags):
            return (flags[i + 1],)
    return ("default",)
