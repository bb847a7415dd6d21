"""The baselines the benchmarks compare against (RLBoost §6.4.3, Fig. 14; §4.2.1): they exist only
as switches on the same control loop, and the default stays RLBoost's migrate + Algorithm 2."""

from __future__ import annotations

from rlharvest.services.rollout_manager.balancer import RoundRobinSelect, select_instance
from rlharvest.services.rollout_manager.commands import Dispatch, Release
from rlharvest.services.rollout_manager.config import ManagerConfig
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.services.rollout_manager.main import build_control
from rlharvest.services.rollout_manager.tracker import TokenDelta
from tests.builders import Clock, step


def run_until_loss(recompute_on_loss: bool) -> RolloutControl:
    """Two requests on worker a produce 5 tokens each; a is lost; b joins and takes them."""
    control = RolloutControl(ControlConfig(theta=2, recompute_on_loss=recompute_on_loss), Clock())
    control.worker_joined("a", 0, capacity=4, kind="k")
    control.add_step("s", step(2, max_tokens=8), 0)
    control.tick()
    for rid in ("r0", "r1"):
        control.step_deltas("a", [TokenDelta(rid, 0, (3,) * 5, (0.0,) * 5, 0)])
    released = control.worker_lost("a", "SIGKILL")
    assert {c.request_id for c in released if isinstance(c, Release)} == {"r0", "r1"}
    control.worker_joined("b", 0, capacity=4, kind="k")
    assert {c.worker_id for c in control.tick() if isinstance(c, Dispatch)} == {"b"}
    return control


def test_by_default_a_lost_workers_requests_resume_from_their_last_token():
    control = run_until_loss(recompute_on_loss=False)
    payload = control.tracker.resume_payload("r0")
    assert payload.generated_token_ids == (3,) * 5 and payload.remaining_tokens == 3
    control.step_deltas("b", [TokenDelta("r0", 5, (4,) * 3, (0.0,) * 3, 0)])
    assert control.tracker.counters.tokens_regenerated == 0


def test_recompute_on_loss_restarts_from_the_prompt_and_counts_regenerated_tokens():
    control = run_until_loss(recompute_on_loss=True)
    payload = control.tracker.resume_payload("r0")
    assert payload.generated_token_ids == () and payload.remaining_tokens == 8
    report = control.step_deltas("b", [TokenDelta("r0", 0, (4,) * 8, (0.0,) * 8, 0)])
    assert report.finished == ["r0"]
    assert control.tracker.counters.tokens_regenerated == 5  # positions 0..4 came twice


def test_recompute_on_loss_leaves_graceful_drain_as_a_migration():
    control = RolloutControl(ControlConfig(theta=2, recompute_on_loss=True), Clock())
    for w in ("a", "b"):
        control.worker_joined(w, 0, capacity=4, kind="k")
    control.add_step("s", step(1, max_tokens=8), 0)
    (dispatch,) = control.tick()
    control.step_deltas(dispatch.worker_id, [TokenDelta("r0", 0, (3, 3), (0.0, 0.0), 0)])
    control.worker_draining(dispatch.worker_id, deadline=100.0)
    assert control.tracker.resume_payload("r0").generated_token_ids == (3, 3)


def test_the_balancer_flag_selects_algorithm2_or_a_no_migration_baseline():
    default = build_control(ManagerConfig())
    assert default.config.continuous_lb and default.config.theta == ManagerConfig().theta
    assert default._select is select_instance and not default.config.recompute_on_loss
    for name in ("jsq", "round_robin"):
        control = build_control(ManagerConfig(balancer=name, recompute_on_loss=True))
        assert not control.config.continuous_lb and control.config.recompute_on_loss
        assert isinstance(control._select, RoundRobinSelect) == (name == "round_robin")


def test_round_robin_dispatches_in_turn_and_never_holds():
    control = build_control(ManagerConfig(balancer="round_robin"))
    for w in ("a", "b", "c"):
        control.worker_joined(w, 0, capacity=1, kind="k")
    control.add_step("s", step(7, max_tokens=4), 0)
    order = [c.worker_id for c in control.tick() if isinstance(c, Dispatch)]
    assert order == ["a", "b", "c", "a", "b", "c", "a"]
