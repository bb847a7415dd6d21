"""In the services' loops and request paths: an etcd that answers its first calls with
aetcd.ConnectionFailedError (a restart) is waited out — the loop goes on, the call's value
arrives, the outage is logged once — and a transaction etcd may have applied without answering
is never half kept by the placement scheduler."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any

import aetcd
import pytest

from rlharvest.common import etcd_outage, keys
from rlharvest.common.retry import Backoff
from rlharvest.services.placement_scheduler.config import PlacementConfig
from rlharvest.services.placement_scheduler.service import PlacementService, new_control
from rlharvest.services.placement_scheduler.store import PlacementStore
from rlharvest.services.rollout_manager.lender import Lender
from rlharvest.services.rollout_manager.workers import Workers
from rlharvest.services.rollout_worker.placement_follower import NodeFollower
from rlharvest.services.transfer_agent.announce import Announcer
from rlharvest.services.transfer_agent.config import AgentConfig
from rlharvest.services.transfer_agent.service import AgentService


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries at once, and no outage left over from another test."""
    monkeypatch.setattr(etcd_outage, "BACKOFF", Backoff(first_s=0.001, max_s=0.001))
    etcd_outage.etcd_answered()


class _Cmp:
    """One side of a transaction compare (``tx.version(key) == 0``), evaluated by FlakyEtcd."""

    def __init__(self, field: str, key: bytes) -> None:
        self.field, self.key = field, key

    def __eq__(self, other: object) -> Any:  # type: ignore[override]
        return (self.field, self.key, "==", other)

    def __gt__(self, other: object) -> Any:
        return (self.field, self.key, ">", other)


class _Tx:
    def version(self, key: bytes) -> _Cmp:
        return _Cmp("version", key)

    def mod(self, key: bytes) -> _Cmp:
        return _Cmp("mod", key)

    def value(self, key: bytes) -> _Cmp:
        return _Cmp("value", key)

    def put(self, key: bytes, value: bytes, lease: Any = None) -> tuple:
        return ("put", key, value, lease)

    def delete(self, key: bytes) -> tuple:
        return ("delete", key)


class FlakyEtcd:
    """aetcd's client over a dict, answering its first ``failures`` calls with
    ConnectionFailedError (etcd restarting); ``down`` fails every call until cleared. The
    watches behind ``wake_on_change`` never fire (each loop also runs on its own period)."""

    def __init__(self, failures: int = 3) -> None:
        self.failures, self.down, self.calls = failures, False, 0
        self.data: dict[bytes, SimpleNamespace] = {}
        self.revision = 1
        self.transactions = _Tx()
        self.applied_unanswered = False  # the next transaction lands, then times out

    def _gate(self) -> None:
        self.calls += 1
        if self.down or self.failures:
            self.failures = max(self.failures - 1, 0)
            raise aetcd.ConnectionFailedError("etcd restarting")

    def _put(self, key: bytes, value: bytes, lease: Any = None) -> None:
        self.revision += 1
        self.data[key] = SimpleNamespace(key=key, value=value, mod_revision=self.revision,
                                         lease=getattr(lease, "id", lease or 0))

    async def get(self, key: bytes) -> SimpleNamespace | None:
        self._gate()
        return self.data.get(key)

    async def get_prefix(self, prefix: bytes, **_: Any) -> list[SimpleNamespace]:
        self._gate()
        found = [kv for key, kv in sorted(self.data.items()) if key.startswith(prefix)]
        return _Found(found, self.revision)

    async def put(self, key: bytes, value: bytes, lease: Any = None) -> None:
        self._gate()
        self._put(key, value, lease)

    async def delete(self, key: bytes) -> None:
        self._gate()
        self.data.pop(key, None)

    async def transaction(self, compare: list[tuple], success: list[tuple],
                          failure: list[tuple]) -> tuple[bool, list]:
        self._gate()
        ok = all(self._holds(*c) for c in compare)
        for op in success if ok else failure:
            if op[0] == "put":
                self._put(op[1], op[2], op[3])
            else:
                self.data.pop(op[1], None)
        if self.applied_unanswered:
            self.applied_unanswered = False
            raise aetcd.ConnectionTimeoutError("deadline exceeded")  # applied all the same
        return ok, []

    def _holds(self, field: str, key: bytes, op: str, other: Any) -> bool:
        kv = self.data.get(key)
        mine = {"version": int(kv is not None), "mod": kv.mod_revision if kv else 0,
                "value": kv.value if kv else None}[field]
        return mine == other if op == "==" else mine > other

    async def get_range(self, *_: Any, **__: Any) -> None:
        await asyncio.Event().wait()  # a watch that never lists: the loops poll on their own


class _Found(list):
    def __init__(self, items: list, revision: int) -> None:
        super().__init__(items)
        self.header = SimpleNamespace(revision=revision)


async def _until(check, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def test_an_announcement_waits_out_an_etcd_restart() -> None:
    etcd = FlakyEtcd(failures=3)
    announce = Announcer(AgentConfig(agent_id="a1", node="n1"), etcd,  # type: ignore[arg-type]
                         "127.0.0.1:1", held=lambda job: (5,), membership=lambda: None)
    await announce("j", 5, [])
    holder = json.loads(etcd.data[keys.weights_holder_key("j", "a1").encode()].value)
    announced = json.loads(etcd.data[keys.weights_announced_key("j").encode()].value)
    assert holder["latest"] == 5 and announced["version"] == 5
    assert etcd_outage.ETCD_UP._value.get() == 1


async def test_a_dropped_jobs_record_is_deleted_at_a_later_round_when_etcd_was_away() -> None:
    etcd = FlakyEtcd(failures=0)
    announce = Announcer(AgentConfig(agent_id="a1", node="n1"), etcd,  # type: ignore[arg-type]
                         "127.0.0.1:1", held=lambda job: (), membership=lambda: None)
    agent = AgentService(AgentConfig(agent_id="a1"), on_dropped=announce.forget)
    try:
        key = keys.weights_holder_key("j", "a1").encode()
        etcd._put(key, b"{}")
        agent.core.job("j")
        agent.drop_idle(agent.core.clock() + AgentConfig().job_idle_s)
        etcd.down = True
        await agent.forget_dropped()  # no crash (the idle loop would restart for each check)
        assert agent.core.unannounced() == ["j"] and key in etcd.data
        etcd.down = False
        await agent.forget_dropped()
        assert agent.core.unannounced() == [] and key not in etcd.data
    finally:
        agent.close()


async def test_the_lender_rides_out_etcd_and_claims(caplog: pytest.LogCaptureFixture) -> None:
    etcd = FlakyEtcd(failures=4)
    etcd._put(keys.member_key("coexecutor", "c1").encode(),
              json.dumps({"lendable": True, "serving_kv_recent": 0.1}).encode())
    lender = Lender(etcd, lambda: SimpleNamespace(id=7), job="j",  # type: ignore[arg-type]
                    manager_id="m1", limit=1, interval_s=0.01)
    with caplog.at_level(logging.WARNING, logger="rlharvest.common.etcd_outage"):
        task = asyncio.get_running_loop().create_task(lender.run())
        try:
            await _until(lambda: lender.held == ["c1"])
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    claim = etcd.data[keys.lending_key("c1").encode()]
    assert json.loads(claim.value)["job"] == "j" and claim.lease == 7
    said = [r.getMessage() for r in caplog.records]
    assert sum("etcd unreachable" in m for m in said) == 1  # four failures, one outage
    assert sum("etcd answers again" in m for m in said) == 1


async def test_the_managers_announced_version_waits_out_an_etcd_restart() -> None:
    etcd = FlakyEtcd(failures=3)
    etcd._put(keys.weights_announced_key("j").encode(), json.dumps({"version": 4}).encode())
    shell = SimpleNamespace(_etcd=etcd, _announced_key=keys.weights_announced_key("j"))
    assert await Workers.announced(shell) == 4  # type: ignore[arg-type]


async def test_a_placed_worker_names_its_job_once_etcd_is_back() -> None:
    failures, named = [3], []

    async def register(job: str) -> None:
        if failures[0]:
            failures[0] -= 1
            raise aetcd.ConnectionFailedError("etcd restarting")
        named.append(job)

    async def read(fn):
        return fn()

    async def load(*_: Any) -> None:
        return None

    follower = NodeFollower(None, "n1", read=read, weights=dict, version=lambda: 0, load=load,
                            register=register)
    follower._start = {}
    await follower.switch("B")
    assert named == ["B"] and follower.job == "B"


def _placement() -> tuple[PlacementService, FlakyEtcd]:
    cfg = PlacementConfig(rollout_nodes=2, train_nodes=1)
    etcd = FlakyEtcd(failures=0)
    fence = keys.election_prefix(keys.PLACEMENT_ELECTION) + "1"
    etcd._put(fence.encode(), b"scheduler")
    service = PlacementService(cfg, etcd=etcd, endpoint="127.0.0.1:1")
    service.control, service._store = new_control(cfg), PlacementStore(etcd, fence)  # type: ignore[arg-type]
    return service, etcd


async def test_a_transaction_etcd_applied_without_answering_is_not_half_kept() -> None:
    service, etcd = _placement()
    submit = dict(job_id="A", t_roll=10.0, t_train=10.0, slo=2.0, rollout_nodes=1)
    await service._mutate(None, lambda c: c.submit(submit))  # type: ignore[arg-type]
    # The cancel lands in etcd but its answer is lost, and the call gives up (UNAVAILABLE
    # outside a call: the error raised): memory goes back to the state with A ...
    etcd.applied_unanswered, etcd.down = True, False
    store = service._store
    assert store is not None
    with pytest.raises(aetcd.ConnectionTimeoutError):
        await store.save({}, {})
    service._restore_persisted()
    assert "A" in service.control.jobs
    # ... and the next change writes that whole state again, not a diff against what the
    # store last wrote: A's records come back instead of staying half deleted.
    await service._mutate(None, lambda c: c.submit(dict(submit, job_id="B")))  # type: ignore[arg-type]
    held = {kv.key.decode().removeprefix(keys.placement_state_prefix())
            for kv in etcd.data.values()
            if kv.key.decode().startswith(keys.placement_state_prefix())}
    assert held == set(store.persisted) and {"jobs/A", "jobs/B"} <= held


async def test_a_lost_job_is_failed_once_etcd_answers_again() -> None:
    service, etcd = _placement()
    submit = dict(job_id="A", t_roll=10.0, t_train=10.0, slo=2.0, rollout_nodes=1)
    await service._mutate(None, lambda c: c.submit(submit, 9))  # type: ignore[arg-type]
    job_key = keys.placement_state_key("jobs/A").encode()
    assert job_key in etcd.data
    del etcd.data[keys.placement_alive_key("A").encode()]  # its client's lease expired
    etcd.failures = 3
    await service._job_lost("A")  # the liveness watch's call: no crash, the job leaves
    assert "A" not in service.control.jobs and job_key not in etcd.data


async def test_the_fence_check_rides_out_etcd_and_still_sees_its_key_go() -> None:
    service, etcd = _placement()
    fence = keys.election_prefix(keys.PLACEMENT_ELECTION) + "1"
    service._cfg = service._cfg.model_copy(update={"lease_ttl": 0})  # checks every 0.5 s
    etcd.failures = 2
    task = asyncio.get_running_loop().create_task(service.check_fence(fence))
    try:
        await _until(lambda: etcd.calls >= 3, timeout_s=5.0)
        assert not task.done() and not service.deposed.is_set()
        del etcd.data[fence.encode()]
        await _until(service.deposed.is_set, timeout_s=5.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
