"""Who may call what (``common/authorization.py``): the role a method needs, the refusal that
names it, and the roles a certificate carries."""

from __future__ import annotations

from rlharvest.common import authorization, tls


def test_only_a_trainer_submits_steps_and_publishes_and_only_a_manager_opens_sessions():
    rules = {"/rlharvest.v1.RolloutManager/SubmitStep": "trainer",
             "/rlharvest.v1.TransferAgent/Publish": "trainer",
             "/rlharvest.v1.RolloutWorker/Session": "manager"}
    for method, role in rules.items():
        assert authorization.refusal(method, [role]) is None
        assert authorization.refusal(method, [role, "operator"]) is None
        refused = authorization.refusal(method, ["worker"])
        assert refused is not None and f"role {role!r}" in refused and "'worker'" in refused
        assert "no role" in (authorization.refusal(method, []) or "")


def test_every_other_method_is_open_to_any_peer_of_the_ca():
    for method in ("/rlharvest.v1.RolloutManager/GetStatus", "/rlharvest.v1.Trainer/GetStatus",
                   "/rlharvest.v1.TransferAgent/PullBuckets", "/grpc.health.v1.Health/Check"):
        assert authorization.refusal(method, []) is None


def test_a_certificate_names_its_holders_role(tmp_path):
    issued = tls.issue_certificates(tmp_path, ["manager-0", "trainer"],
                                    roles={"manager-0": "manager"})
    assert authorization.peer_roles(issued["manager-0"][0].read_bytes()) == ["manager"]
    assert authorization.peer_roles(issued["trainer"][0].read_bytes()) == ["trainer"]
    assert authorization.peer_roles((tmp_path / "ca.pem").read_bytes()) == []  # no SAN at all
