"""Shared fixtures: a real etcd for the session, and real service processes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlharvest.common.fork_server import ForkServer
from rlharvest.common.local_etcd import LocalEtcd
from rlharvest.cli.launcher import LocalStack, service_fork_server

ROOT = Path(__file__).resolve().parents[1]
# Every process a test starts (services, CLIs, helpers) imports this checkout, not whichever one
# was installed last (tests/unit/test_packaging.py checks both).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


@pytest.fixture
def etcd_endpoint(etcd_server: LocalEtcd) -> str:
    return etcd_server.endpoint


@pytest.fixture
async def etcd_client(etcd_endpoint: str):
    from rlharvest.common import registry

    client = await registry.connect(etcd_endpoint)
    await client.delete_prefix(b"/rlharvest/")  # every test starts from an empty keyspace
    yield client
    await client.close()


@pytest.fixture(scope="session")
def fork_server() -> Iterator[ForkServer | None]:
    """Services are forked from one process that imported them (torch, transformers) once: the
    suite starts hundreds. RLH_TEST_FRESH_INTERPRETERS=1 starts each as `python -m` instead."""
    if os.environ.get("RLH_TEST_FRESH_INTERPRETERS") == "1":
        yield None
        return
    server = service_fork_server()
    yield server
    server.close()


@pytest.fixture
def stack(etcd_server: LocalEtcd, fork_server: ForkServer | None,
          tmp_path: Path) -> Iterator[LocalStack]:
    """Service processes against the session's etcd; killed after the test, logs shown on failure."""
    yield from _processes(LocalStack(tmp_path / "logs", etcd=etcd_server, fork_server=fork_server))


@pytest.fixture(scope="module")
def module_stack(etcd_server: LocalEtcd, fork_server: ForkServer | None,
                 tmp_path_factory) -> Iterator[LocalStack]:
    """Like ``stack``, for services a whole test module shares."""
    yield from _processes(LocalStack(tmp_path_factory.mktemp("logs"), etcd=etcd_server,
                                     fork_server=fork_server))


def _processes(local: LocalStack) -> Iterator[LocalStack]:
    yield local
    for proc in local.processes:
        proc.kill()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    local = item.funcargs.get("stack") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(local, LocalStack):
        for proc in local.processes:
            report.sections.append((f"log of {proc.name}", proc.log_tail(60)))
