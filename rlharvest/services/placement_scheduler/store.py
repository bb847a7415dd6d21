"""The placement scheduler's state in etcd: one record per group, per job, plus meta, written in
one transaction per change and fenced by the leader's election key.

Fencing: every write compares that this scheduler's election key still exists. A leader whose
lease ran out (a partition, a long pause) has lost that key before any standby can lead, so its
late writes fail instead of overwriting the new leader's state; the shell then stops.

Liveness of jobs: a job submitted with its client's etcd lease gets ``placement/alive/<job>``
attached to that lease in the same transaction that places it. The key disappears when the
client dies (or its lease is revoked), which the scheduler sees as the job failing — also while
no scheduler runs, because the key's absence is checked again on takeover.

etcd away: a transaction whose reply never came (the connection broke, the call timed out) may
or may not have been applied. Sent again as it was, it is harmless either way (it puts whole
records and deletes keys). Given up on instead, the store no longer knows what etcd holds, so the
next save reads it back first and writes its diff against that, not against what this store
last wrote: a change etcd took without saying so is then overwritten, never half kept.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aetcd

from rlharvest.common import keys
from rlharvest.common.etcd_outage import etcd_away

log = logging.getLogger(__name__)

# etcd refuses transactions over --max-txn-ops (128 by default); a change touches a few records.
MAX_TXN_OPS = 128


class DeposedError(RuntimeError):
    """This scheduler's election key is gone: another scheduler leads; stop at once."""


@dataclass(frozen=True)
class Snapshot:
    records: dict[str, dict[str, Any]]  # relative record name -> record
    alive: set[str]  # job ids whose liveness key exists
    revision: int  # etcd revision the snapshot was read at


class PlacementStore:
    def __init__(self, etcd: aetcd.Client, fence_key: str) -> None:
        self._etcd = etcd
        self._fence = fence_key.encode()
        self._persisted: dict[str, bytes] = {}  # relative record name -> stored JSON
        self._alive: dict[str, int] = {}  # job id -> lease id of its liveness key
        self._unsure = False  # a transaction's fate is unknown: read etcd before the next diff

    @property
    def persisted(self) -> dict[str, dict[str, Any]]:
        """What etcd holds now, as written by this store (to rebuild after a failed write)."""
        return {name: json.loads(value) for name, value in self._persisted.items()}

    async def load(self) -> Snapshot:
        """Read the whole state once (on takeover); later saves are diffs against it."""
        found = await self._etcd.get_prefix(keys.placement_prefix().encode())
        state, alive_prefix = keys.placement_state_prefix(), keys.placement_alive_prefix()
        records, alive = {}, set()
        self._persisted, self._alive = {}, {}
        for kv in found:
            key = kv.key.decode()
            if key.startswith(state):
                name = key.removeprefix(state)
                self._persisted[name] = kv.value
                records[name] = json.loads(kv.value)
            elif key.startswith(alive_prefix):
                job_id = key.removeprefix(alive_prefix)
                alive.add(job_id)
                self._alive[job_id] = kv.lease
        return Snapshot(records, alive, found.header.revision)

    async def lease_alive(self, lease_id: int) -> bool:
        info = await self._etcd.get_lease_info(lease_id, keys=False)
        return info.TTL > 0

    async def save(self, records: Mapping[str, Mapping[str, Any]],
                   leases: Mapping[str, int]) -> bool:
        """Make etcd hold exactly ``records`` and one liveness key per job in ``leases`` (job id
        -> its client's lease; 0 = untracked), in one fenced transaction; False when it held
        them already (nothing written). On DeposedError or an error etcd answered with nothing
        was written; after no answer (etcd away) the next save reads etcd first (module doc)."""
        reread = self._unsure
        if reread:
            await self.load()
            self._unsure = False
        tx = self._etcd.transactions
        encoded = {name: json.dumps(r, sort_keys=True).encode() for name, r in records.items()}
        ops: list[Any] = []
        for name, value in encoded.items():
            if self._persisted.get(name) != value:
                ops.append(tx.put(keys.placement_state_key(name).encode(), value))
        for name in self._persisted.keys() - encoded.keys():
            ops.append(tx.delete(keys.placement_state_key(name).encode()))
        wanted = {j: lease for j, lease in leases.items() if lease}
        for job_id, lease in wanted.items():
            if self._alive.get(job_id) != lease:
                ops.append(tx.put(keys.placement_alive_key(job_id).encode(), b"{}", lease=lease))
        for job_id in self._alive.keys() - wanted.keys():
            ops.append(tx.delete(keys.placement_alive_key(job_id).encode()))
        if not ops:  # after a reread: etcd took a transaction it never answered, this one's
            return reread  # records (the caller wakes long-polls for them)
        if len(ops) > MAX_TXN_OPS:
            raise RuntimeError(f"one change touches {len(ops)} etcd keys, more than etcd's "
                               f"{MAX_TXN_OPS} per transaction; raise --max-txn-ops")
        try:
            ok, _ = await self._etcd.transaction(compare=[tx.version(self._fence) > 0],
                                                 success=ops, failure=[])
        except Exception as exc:
            self._unsure = etcd_away(exc)  # no answer: applied or not (module doc)
            raise
        if not ok:
            raise DeposedError(f"election key {self._fence.decode()} is gone: this scheduler "
                               "no longer leads; its writes were refused")
        self._persisted = encoded
        self._alive = dict(wanted)
        return True
