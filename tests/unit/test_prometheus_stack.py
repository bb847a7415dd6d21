"""`rlharvest up --prometheus`, the pure parts: etcd members become file_sd target groups (one
per member with a metrics address, labelled), the config points at that file, and the file is
replaced atomically and only when it changes."""

from __future__ import annotations

import json

from rlharvest.cli.prometheus_stack import ALERT_RULES, config_text, target_groups, write_if_changed


def test_every_member_with_a_metrics_address_becomes_one_labelled_target_group():
    members = {
        "/rlharvest/v1/members/trainer/trainer-0": {"metrics": "127.0.0.1:9101"},
        "/rlharvest/v1/members/rollout_worker/w1": {"metrics": "127.0.0.1:9102", "kind": "spot"},
        "/rlharvest/v1/members/rollout_worker/w0": {"endpoint": "127.0.0.1:5000"},  # none
    }
    assert target_groups(members) == [
        {"targets": ["127.0.0.1:9102"], "labels": {"service": "rollout_worker", "member": "w1"}},
        {"targets": ["127.0.0.1:9101"], "labels": {"service": "trainer", "member": "trainer-0"}},
    ]


def test_the_config_scrapes_the_targets_file_at_the_given_interval(tmp_path):
    config = json.loads(config_text(tmp_path / "targets.json", 0.5))
    job = config["scrape_configs"][0]
    assert job["file_sd_configs"][0]["files"] == [str(tmp_path / "targets.json")]
    assert config["global"]["scrape_interval"] == "500ms"  # Prometheus takes no "0.5s"
    assert config["rule_files"] == []


def test_the_local_prometheus_evaluates_the_deployed_alert_rules(tmp_path):
    assert ALERT_RULES.is_file()  # a source checkout: the same file the compose stack loads
    config = json.loads(config_text(tmp_path / "targets.json", 1.0, (ALERT_RULES,)))
    assert config["rule_files"] == [str(ALERT_RULES)]


def test_the_targets_file_is_rewritten_only_when_it_changes(tmp_path):
    path = tmp_path / "targets.json"
    assert write_if_changed(path, "[]") and path.read_text() == "[]"
    assert not write_if_changed(path, "[]")
    assert write_if_changed(path, "[1]") and not (tmp_path / "targets.tmp").exists()
