"""RollPacker's stream-trainer scaling on the trainer's side (§4.4, Algorithm 1 lines 13-21):
while the manager has lent rollout workers to training for the step in progress, the training
thread also runs on their share of this machine's cores.

The manager decides and drains (``rollout_manager/stream_scaling.py``) and records the decision
in etcd (``keys.stream_scale_key``: state "lent", the drained workers, the step). The paper's
trainer then grows onto the freed GPUs; a GPU on another node needs a new data-parallel rank,
which rlharvest does not start mid-step. What a trainer can take at once is compute on its own
machine: with ``--borrow-lent-threads N`` each lent worker adds N intra-op threads to the
training thread until the record says "returned" or another step begins. This is the handoff
for workers that share the trainer's node (CPU runs, or a GPU node whose rollout workers' host
cores go idle when drained); elastic ranks across nodes are not built.

Pure: a record and the step in progress in, a thread count out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LentCapacity:
    base_threads: int  # what the training thread uses on its own
    threads_per_worker: int  # added per lent worker
    max_threads: int  # the machine's cores: borrowing never oversubscribes past them

    def __post_init__(self) -> None:
        if self.base_threads < 1 or self.threads_per_worker < 1 or self.max_threads < 1:
            raise ValueError(f"thread counts must be >= 1, got base {self.base_threads}, per "
                             f"worker {self.threads_per_worker}, max {self.max_threads}")

    def threads(self, record: Mapping[str, object] | None, job: str,
                step_id: str | None) -> int:
        """Threads for the training thread now. Only a "lent" record of this job's step in
        progress counts: a stale one (a manager that died before "returned", a previous step or
        run) never keeps borrowed threads."""
        if (record is None or step_id is None or record.get("state") != "lent"
                or record.get("job") != job or record.get("step_id") != step_id):
            return min(self.base_threads, self.max_threads)
        drained = record.get("drained")
        lent = len(drained) if isinstance(drained, list) else 0
        return min(self.max_threads, self.base_threads + lent * self.threads_per_worker)
