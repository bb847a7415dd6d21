"""The etcd maintenance policy (``etcd_maintenance.MaintenancePolicy``): when it compacts, to
which revision, and when it defragments, on an injected clock."""

from __future__ import annotations

import random

import pytest

from rlharvest.common.etcd_maintenance import (
    Compact, Defragment, EtcdStatus, MaintenanceConfig, MaintenancePolicy, MiB)

CONFIG = MaintenanceConfig(retention_s=300, compact_every_s=60, defrag_free_share=0.5,
                           defrag_min_free_bytes=64 * MiB, defrag_every_s=3600)


def status(at: float, revision: int, db: int = 10 * MiB, in_use: int = 10 * MiB) -> EtcdStatus:
    return EtcdStatus(at, revision, db, in_use)


def compactions(policy: MaintenancePolicy, sample: EtcdStatus) -> list[int]:
    return [a.revision for a in policy.observe(sample) if isinstance(a, Compact)]


def test_nothing_is_compacted_before_the_retention_has_passed() -> None:
    policy = MaintenancePolicy(CONFIG)
    assert [compactions(policy, status(t, 100 + t)) for t in range(0, 300, 10)] == [[]] * 30


def test_it_compacts_to_the_newest_revision_sampled_at_least_the_retention_ago() -> None:
    policy = MaintenancePolicy(CONFIG)
    for t in range(0, 300, 10):
        policy.observe(status(t, 1000 + 5 * t))
    assert compactions(policy, status(305, 9999)) == [1000]  # sampled at 0, 305 s before
    assert policy.compacted == 1000


def test_it_compacts_at_most_once_per_compact_every_s() -> None:
    policy = MaintenancePolicy(CONFIG)
    done = {t: compactions(policy, status(t, 1000 + t)) for t in range(0, 1000, 10)}
    assert {t: revs for t, revs in done.items() if revs} == {
        300: [1000], 360: [1060], 420: [1120], 480: [1180], 540: [1240], 600: [1300],
        660: [1360], 720: [1420], 780: [1480], 840: [1540], 900: [1600], 960: [1660]}


def test_without_writes_it_does_not_compact_the_same_revision_again() -> None:
    policy = MaintenancePolicy(CONFIG)
    assert [r for t in range(0, 2000, 10) for r in compactions(policy, status(t, 42))] == [42]


def test_compaction_follows_the_maintainers_clock_not_etcds_uptime() -> None:
    """etcd SIGKILLed every half minute: samples only between restarts, revisions going on
    from its data. etcd's own periodic compactor never fires; this one does."""
    policy = MaintenancePolicy(CONFIG)
    revisions = []
    for t in range(0, 900, 5):
        if t % 30 < 8:  # etcd away: no sample
            continue
        revisions += compactions(policy, status(t, 10 * t))
    assert len(revisions) >= 9 and revisions == sorted(set(revisions))


def test_a_new_etcd_whose_revisions_went_back_is_not_compacted_to_the_old_ones() -> None:
    policy = MaintenancePolicy(CONFIG)
    for t in range(0, 400, 10):
        policy.observe(status(t, 50_000 + t))
    assert policy.compacted > 50_000
    # Wiped and started anew at revision 1: the old history means nothing there.
    assert [r for t in range(400, 700, 10) for r in compactions(policy, status(t, t - 399))] == []
    assert compactions(policy, status(700, 302)) == [1]


def test_it_defragments_a_file_more_than_half_free_by_at_least_the_minimum() -> None:
    policy = MaintenancePolicy(CONFIG)
    assert policy.observe(status(0, 1, db=200 * MiB, in_use=90 * MiB)) == [
        Defragment(110 * MiB)]


@pytest.mark.parametrize("db_mib, in_use_mib", [
    (200, 110),  # 90 MiB free, but under half of the file
    (100, 40),  # 60% free, but under the 64 MiB minimum
    (1, 0),  # a nearly empty file: all free, a few bytes' worth
])
def test_it_leaves_a_file_alone_unless_both_share_and_amount_are_free(
        db_mib: int, in_use_mib: int) -> None:
    assert MaintenancePolicy(CONFIG).observe(
        status(0, 1, db=db_mib * MiB, in_use=in_use_mib * MiB)) == []


def test_it_defragments_at_most_once_per_interval() -> None:
    policy = MaintenancePolicy(CONFIG)
    times = [t for t in range(0, 8000, 100)
             if any(isinstance(a, Defragment)
                    for a in policy.observe(status(t, 1, db=300 * MiB, in_use=10 * MiB)))]
    assert times == [0, 3600, 7200]


@pytest.mark.parametrize("changes", [
    {"retention_s": 0}, {"compact_every_s": -1}, {"defrag_every_s": -1},
    {"defrag_free_share": 1.0}, {"defrag_min_free_bytes": -1}])
def test_a_config_that_cannot_work_is_refused(changes: dict) -> None:
    with pytest.raises(ValueError, match="must be"):
        MaintenanceConfig(**changes)


@pytest.mark.parametrize("seed", range(40))
def test_every_compaction_keeps_the_retention_and_follows_the_last(seed: int) -> None:
    """Random sampling (gaps, bursts of writes, idle stretches): each compaction goes to the
    newest revision sampled at least the retention ago, later than the last one, and no sooner
    than compact_every_s after it."""
    rng = random.Random(seed)
    config = MaintenanceConfig(retention_s=rng.choice([30, 60, 300]),
                               compact_every_s=rng.choice([5, 15, 60]))
    policy = MaintenancePolicy(config)
    seen: list[tuple[float, int]] = []
    last: tuple[float, int] | None = None
    now, revision = 0.0, 1
    for _ in range(400):
        now += rng.choice([0.5, 5, 10, 45])
        revision += rng.choice([0, 0, 1, 7, 300])
        seen.append((now, revision))
        for rev in compactions(policy, status(now, revision)):
            old_enough = [r for t, r in seen if t <= now - config.retention_s]
            assert rev == max(old_enough)
            if last is not None:
                assert rev > last[1] and now - last[0] >= config.compact_every_s
            last = (now, rev)
    assert last is not None
