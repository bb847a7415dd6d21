"""The etcd permissions of each service role (``etcd_roles.py``), as key ranges: every role
reads all of rlharvest's keys and writes only its own prefixes."""

from __future__ import annotations

import pytest

from rlharvest.common import etcd_roles, keys
from rlharvest.common.authorization import SERVICE_ROLES


def writable(role: str, key: str) -> bool:
    return any(p.permType == p.READWRITE and p.key <= key.encode() < p.range_end
               for p in etcd_roles.grants(role))


def readable(role: str, key: str) -> bool:
    return any(p.key <= key.encode() < p.range_end for p in etcd_roles.grants(role))


def test_a_prefixs_range_ends_just_past_its_last_key() -> None:
    assert etcd_roles.prefix_end(b"/a/b/") == b"/a/b0"
    assert b"/a/b/" <= b"/a/b/zzz" < etcd_roles.prefix_end(b"/a/b/")
    assert not b"/a/b/" <= b"/a/c" < etcd_roles.prefix_end(b"/a/b/")


def test_every_service_role_has_grants_and_an_unknown_role_is_refused() -> None:
    assert set(SERVICE_ROLES.values()) == set(etcd_roles.WRITES)
    with pytest.raises(ValueError, match="operator"):
        etcd_roles.grants("operator")


@pytest.mark.parametrize("role", sorted(etcd_roles.WRITES))
def test_every_role_reads_every_key_and_writes_its_own_membership(role) -> None:
    service = next(s for s, r in SERVICE_ROLES.items() if r == role)
    assert readable(role, keys.lending_key("c")) and readable(role, keys.placement_state_key("meta"))
    assert writable(role, keys.member_key(service, "me"))
    assert not readable(role, "/other-app/key")


@pytest.mark.parametrize("key, writers", [
    (keys.election_prefix(keys.manager_election("job-7")) + "1", {"manager"}),
    (keys.election_prefix(keys.PLACEMENT_ELECTION) + "1", {"scheduler"}),
    (keys.lending_key("coexec-0"), {"manager"}),
    (keys.placement_state_key("meta"), {"scheduler"}),
    (keys.placement_alive_key("job-7"), {"scheduler"}),
    (keys.weights_announced_key("job-7"), {"agent"}),
    (keys.weights_holder_key("job-7", "agent-0"), {"agent"}),
    (keys.instance_cap_key("job-7"), {"trainer", "manager"}),
    (keys.tp_plan_key("job-7"), {"trainer", "manager"}),
    (keys.pairing_key("w-1"), {"worker", "coexecutor"}),
    (keys.member_key("rollout_worker", "w-1"), {"worker", "trainer"}),  # the seed role
    (keys.member_key("rollout_manager", "m-1"), {"manager"}),
])
def test_each_key_is_writable_by_its_writers_only(key, writers) -> None:
    assert {role for role in etcd_roles.WRITES if writable(role, key)} == writers
