"""The placement scheduler's service shell keeps memory no further than etcd: a change that
fails halfway (a bug) leaves the state as etcd holds it, not half changed for the next change
to persist. etcd is stood in for by a store that keeps what was saved."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlharvest.services.placement_scheduler.config import PlacementConfig
from rlharvest.services.placement_scheduler.service import PlacementService, new_control


class SavedRecords:
    """The store's interface over a dict: what etcd would hold after each save."""

    def __init__(self) -> None:
        self._saved: dict[str, str] = {}

    async def save(self, records: dict[str, dict[str, Any]], leases: dict[str, int]) -> bool:
        encoded = {name: json.dumps(r, sort_keys=True) for name, r in records.items()}
        changed, self._saved = encoded != self._saved, encoded
        return changed

    @property
    def persisted(self) -> dict[str, dict[str, Any]]:
        return {name: json.loads(value) for name, value in self._saved.items()}


async def test_a_change_failing_halfway_leaves_the_state_as_etcd_holds_it() -> None:
    cfg = PlacementConfig(rollout_nodes=2, train_nodes=1)
    service = PlacementService(cfg, etcd=None, endpoint="127.0.0.1:1")
    store = SavedRecords()
    service.control, service._store = new_control(cfg), store  # type: ignore[assignment]
    submit = dict(job_id="A", t_roll=10.0, t_train=10.0, slo=2.0, rollout_nodes=1)
    await service._mutate(None, lambda c: c.submit(submit))  # type: ignore[arg-type]
    assert "A" in service.control.jobs

    def cancel_then_fail(control) -> None:
        control.cancel("A", "cancelled")
        raise RuntimeError("a bug after the first half of a change")

    with pytest.raises(RuntimeError, match="a bug"):
        await service._mutate(None, cancel_then_fail)  # type: ignore[arg-type]
    assert "A" in service.control.jobs  # put back as etcd holds it
    await service._mutate(None, lambda c: None)  # type: ignore[arg-type]  # any later change
    assert "jobs/A" in store.persisted  # which persisted no half of the failed one
