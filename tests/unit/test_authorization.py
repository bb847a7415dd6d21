"""Who may call what (``rlharvest/common/authorization.py``): the role a method needs, the refusal that
names it, and the roles a certificate carries."""

from __future__ import annotations

from rlharvest.common import authorization, tls


def test_only_a_trainer_submits_steps_and_publishes_and_only_a_manager_opens_sessions():
    rules = {"/rlharvest.v1.RolloutManager/SubmitStep": "trainer",
             "/rlharvest.v1.TransferAgent/Publish": "trainer",
             "/rlharvest.v1.RolloutWorker/Session": "manager"}
    for method, role in rules.items():
        assert authorization.refusal(method, [role]) is None
        assert authorization.refusal(method, [role, "worker"]) is None
        refused = authorization.refusal(method, ["worker"])
        assert refused is not None and f"role {role!r};" in refused and "'worker'" in refused
        assert "no role" in (authorization.refusal(method, []) or "")
        assert authorization.refusal(method, ["operator"]) is not None


def test_weight_loads_single_generations_and_scheduling_take_a_trainer_or_an_operator():
    for method in ("/rlharvest.v1.RolloutWorker/LoadWeights",
                   "/rlharvest.v1.RolloutManager/Generate",
                   "/rlharvest.v1.PlacementScheduler/SubmitJob",
                   "/rlharvest.v1.PlacementScheduler/CancelJob",
                   "/rlharvest.v1.PlacementScheduler/AcquirePermit",
                   "/rlharvest.v1.PlacementScheduler/ReleasePermit",
                   "/rlharvest.v1.PlacementScheduler/ReportProgress"):
        assert authorization.refusal(method, ["trainer"]) is None
        assert authorization.refusal(method, ["operator"]) is None
        assert "'trainer' or 'operator'" in (authorization.refusal(method, ["worker"]) or "")


def test_every_other_method_is_open_to_any_peer_of_the_ca():
    for method in ("/rlharvest.v1.RolloutManager/GetStatus", "/rlharvest.v1.Trainer/GetStatus",
                   "/rlharvest.v1.TransferAgent/PullBuckets", "/grpc.health.v1.Health/Check",
                   "/rlharvest.v1.PlacementScheduler/ListState",
                   "/rlharvest.v1.RolloutWorker/GetInfo"):
        assert authorization.refusal(method, []) is None


def test_a_certificate_names_its_holders_role(tmp_path):
    issued = tls.issue_certificates(tmp_path, ["manager-0", "trainer"],
                                    roles={"manager-0": "manager"})
    assert authorization.peer_roles(issued["manager-0"][0].read_bytes()) == ["manager"]
    assert authorization.peer_roles(issued["trainer"][0].read_bytes()) == ["trainer"]
    assert authorization.peer_roles((tmp_path / "ca.pem").read_bytes()) == []  # no SAN at all


def test_every_guarded_method_exists():
    import importlib

    methods = set()
    for proto in ("rollout_worker", "rollout_manager", "transfer_agent", "placement_scheduler"):
        pb2 = importlib.import_module(f"rlharvest.common.pb.{proto}_pb2")
        for service in pb2.DESCRIPTOR.services_by_name.values():
            methods.update(f"/{service.full_name}/{m.name}" for m in service.methods)
    assert set(authorization.REQUIRED_ROLE) <= methods, set(authorization.REQUIRED_ROLE) - methods


def test_steps_and_weights_of_a_job_take_a_certificate_naming_it_or_an_operators():
    Identity = authorization.Identity
    assert authorization.job_refusal("a", Identity(("trainer",), ("a",))) is None
    assert authorization.job_refusal("a", Identity(("trainer",), ("b", "a"))) is None
    assert authorization.job_refusal("a", Identity(("trainer",), ("*",))) is None
    assert authorization.job_refusal("a", Identity(("operator",), ())) is None
    refused = authorization.job_refusal("a", Identity(("trainer",), ("b",)))
    assert refused is not None and "urn:rlharvest:job:a" in refused and "'b'" in refused
    assert "names no job" in (authorization.job_refusal("a", Identity(("trainer",))) or "")


def test_a_certificate_names_the_jobs_its_holder_acts_for(tmp_path):
    ca = tls.LocalCA(tmp_path)
    cert, _ = ca.issue("trainer-a", "trainer", ["a", "b"])
    assert authorization.peer_identity(cert.read_bytes()) == authorization.Identity(
        ("trainer",), ("a", "b"))
    cert, _ = ca.issue("manager", "manager")
    assert authorization.peer_identity(cert.read_bytes()).jobs == ()
