"""Which serving co-executors a manager borrows (ROSE §5): lowest recent serving KV use first,
one job per co-executor, at most max_serving_workers, and nothing its operator pinned."""

from __future__ import annotations

from rlharvest.common.lending_record import Claim, parse_claim
from rlharvest.services.rollout_manager.lending import Lendable, plan_claims

MINE = Claim("job-a", "manager-a")
THEIRS = Claim("job-b", "manager-b")


def members(**use: float) -> dict[str, Lendable]:
    return {cid: Lendable(cid, share, "tiny") for cid, share in use.items()}


def test_the_least_used_coexecutors_are_tried_first_ties_by_id():
    plan = plan_claims(members(c=0.5, a=0.1, b=0.1, d=0.0), {}, MINE, limit=2)
    assert plan.wanted == 2 and plan.candidates == ["d", "a", "b", "c"]
    assert plan.kept == [] and plan.release == []


def test_a_coexecutor_claimed_by_another_job_is_never_a_candidate():
    plan = plan_claims(members(a=0.0, b=0.9), {"a": THEIRS}, MINE, limit=2)
    assert plan.candidates == ["b"]


def test_claims_held_count_toward_the_limit_and_none_is_added_past_it():
    plan = plan_claims(members(a=0.9, b=0.0), {"a": MINE}, MINE, limit=1)
    assert plan.kept == ["a"] and plan.wanted == 0 and plan.candidates == []  # not moved to b


def test_a_claim_on_a_coexecutor_that_left_or_drains_is_released_and_replaced():
    found = members(a=0.1, b=0.2)
    found["a"] = Lendable("a", 0.1, "tiny", draining=True)
    plan = plan_claims(found, {"a": MINE, "gone": MINE}, MINE, limit=1)
    assert sorted(plan.release) == ["a", "gone"] and plan.kept == []
    assert plan.wanted == 1 and plan.candidates == ["b"]


def test_claims_beyond_a_lowered_limit_are_released():
    plan = plan_claims(members(a=0.1, b=0.2, c=0.3), {"a": MINE, "b": MINE, "c": MINE}, MINE,
                       limit=1)
    assert plan.kept == ["a"] and plan.release == ["b", "c"] and plan.wanted == 0


def test_pinned_draining_and_other_model_coexecutors_are_not_borrowed():
    found = {"pinned": Lendable("pinned", 0.0, "tiny", by_claim=False),
             "draining": Lendable("draining", 0.0, "tiny", draining=True),
             "other": Lendable("other", 0.0, "qwen3-8b"),
             "ok": Lendable("ok", 0.5, "tiny")}
    assert plan_claims(found, {}, MINE, limit=4, model="tiny").candidates == ["ok"]
    assert plan_claims(found, {}, MINE, limit=4).candidates == ["other", "ok"]


def test_limit_zero_claims_nothing_and_gives_back_what_it_held():
    plan = plan_claims(members(a=0.0), {"a": MINE}, MINE, limit=0)
    assert plan.release == ["a"] and plan.wanted == 0 and plan.candidates == []


def test_a_member_record_reads_as_lendable_only_when_it_says_so():
    info = {"model": "tiny", "serving_kv_recent": 0.25, "lendable": True}
    assert Lendable.from_member("c", info) == Lendable("c", 0.25, "tiny")
    assert not Lendable.from_member("c", {"model": "tiny"}).by_claim  # older records: pinned
    assert Lendable.from_member("c", {}).serving_kv_recent == 1.0  # unknown use: tried last


def test_a_claim_record_round_trips_and_a_malformed_one_lends_nothing():
    assert parse_claim(MINE.encode()) == MINE
    assert parse_claim(None) is None
    for raw in (b"not json", b"{}", b'{"job": "", "manager": "m"}', b'{"job": 1, "manager": "m"}',
                b"[]"):
        assert parse_claim(raw) is None, raw
