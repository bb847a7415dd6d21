"""The chaos soak's etcd figures (``rlharvest/cli/chaos.py``): sizes and revisions per minute,
and writes attributed by key."""

from __future__ import annotations

from collections import Counter

from rlharvest.cli.chaos import by_minute, etcd_growth, key_class, mix_report

# when, raft index, bytes in use, file bytes, revision
SAMPLES = [(0.0, 1, 1024, 2048, 10), (30.0, 50, 2048, 4096, 40), (70.0, 100, 1024, 4096, 100),
           (130.0, 200, 3072, 4096, 150)]


def test_each_minute_reports_its_last_sample() -> None:
    assert by_minute(SAMPLES) == [2.0, 1.0, 3.0]
    assert by_minute(SAMPLES, 3) == [4.0, 4.0, 4.0]
    assert by_minute(SAMPLES, 4, unit=1) == [40, 100, 150]


def test_the_growth_line_gives_revisions_written_and_both_sizes_per_minute() -> None:
    line = etcd_growth(SAMPLES)
    assert "revisions written each minute 30, 60, 50" in line
    assert "database in use 2, 1, 3 KiB, file 4, 4, 4 KiB" in line


def test_a_key_is_attributed_to_its_writer() -> None:
    assert key_class("/rlharvest/v1/members/rollout_worker/w-1") == "members/rollout_worker"
    assert key_class("/rlharvest/v1/jobs/default/start_weights") == "jobs"
    assert key_class("/rlharvest/v1/pairing/w-1") == "pairing"


def test_the_mix_is_per_minute_per_worker_and_per_step() -> None:
    mix = Counter({"jobs": 40, "members/rollout_worker": 6, "pairing": 6})
    line = mix_report(mix, 2.0, 3, 13)
    assert "jobs 20, members/rollout_worker 3, pairing 3; 26 in all" in line
    assert "2.0 per worker" in line and "4.0 per step trained (13 steps)" in line
    assert mix_report(mix, 2.0, 3, 0).endswith("no step trained")
