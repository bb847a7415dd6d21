"""The trainer's side of RollPacker's stream scaling: only a "lent" record of this job's step in
progress adds threads, per lent worker, never past the machine's cores."""

from __future__ import annotations

import pytest

from rlharvest.services.trainer.lent_capacity import LentCapacity

CAPACITY = LentCapacity(base_threads=2, threads_per_worker=3, max_threads=16)


def record(**changes: object) -> dict[str, object]:
    return {"job": "j", "step_id": "step-4", "state": "lent", "drained": ["w0", "w1"],
            **changes}


def test_each_lent_worker_adds_its_threads_for_the_step_in_progress():
    assert CAPACITY.threads(record(), "j", "step-4") == 2 + 2 * 3
    assert CAPACITY.threads(record(drained=["w0"]), "j", "step-4") == 5


@pytest.mark.parametrize("stale, job, step", [
    (record(state="returned"), "j", "step-4"),  # the step ended at the manager
    (record(), "j", "step-5"),  # a previous step's record: its manager died before "returned"
    (record(), "j", None),  # between steps
    (record(), "other", "step-4"),  # another job's
    (None, "j", "step-4"),  # nothing lent yet
    (record(drained="w0"), "j", "step-4"),  # not a list: lends nothing
])
def test_anything_but_a_lent_record_of_this_step_keeps_the_base(stale, job, step):
    assert CAPACITY.threads(stale, job, step) == 2


def test_borrowing_never_goes_past_the_machines_cores():
    small = LentCapacity(base_threads=1, threads_per_worker=4, max_threads=2)
    assert small.threads(record(), "j", "step-4") == 2
    assert LentCapacity(4, 1, 2).threads(None, "j", None) == 2  # nor does the base


def test_nonpositive_thread_counts_are_refused():
    with pytest.raises(ValueError, match="thread counts must be >= 1"):
        LentCapacity(0, 1, 4)
