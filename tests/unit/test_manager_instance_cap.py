"""RLBoost's instance cap N_prem (Algorithm 1, §4.1) in the manager: spot workers beyond it, the
latest joined first, stand by and take no work; a lost active one is replaced by a standby at
once; dedicated workers are not capped."""

from __future__ import annotations

import pytest

from rlharvest.services.rollout_manager.commands import Dispatch
from rlharvest.services.rollout_manager.control_loop import ControlConfig, RolloutControl
from rlharvest.common.registry import parse_instance_cap
from tests.builders import Clock, step


def spot_job(count: int, cap: int | None) -> RolloutControl:
    clock = Clock()
    control = RolloutControl(ControlConfig(theta=1), clock)
    for i in range(count):
        control.worker_joined(f"spot-{i}", 1, capacity=2, kind="spot")
        clock.advance(1.0)  # join order is what the cap keeps
    control.pool.set_instance_cap(cap)
    return control


def dispatched(control: RolloutControl) -> set[str]:
    return {c.worker_id for c in control.tick() if isinstance(c, Dispatch)}


def submit(control: RolloutControl, n: int, name: str = "s") -> None:
    control.add_step(name, step(n, version=1, prefix=name), 1, announced_version=1)


def test_only_the_first_joined_spot_workers_up_to_the_cap_take_work():
    control = spot_job(4, cap=2)
    submit(control, 8)
    assert dispatched(control) == {"spot-0", "spot-1"}
    assert control.pool.standby() == {"spot-2", "spot-3"}


def test_a_lost_active_worker_is_replaced_by_the_first_standby_at_once():
    control = spot_job(4, cap=2)
    submit(control, 4)
    dispatched(control)
    control.worker_lost("spot-0", "SIGKILL")
    assert control.pool.standby() == {"spot-3"}
    assert "spot-2" in dispatched(control)  # spot-0's requests go on where there is room


def test_no_cap_uses_every_worker_and_dedicated_workers_are_never_capped():
    control = spot_job(3, cap=None)
    submit(control, 6)
    assert dispatched(control) == {"spot-0", "spot-1", "spot-2"}
    capped = spot_job(2, cap=0)
    capped.worker_joined("dedicated-0", 1, capacity=2, kind="dedicated")
    submit(capped, 2)
    assert dispatched(capped) == {"dedicated-0"}


def test_lowering_the_cap_leaves_running_requests_where_they_are():
    control = spot_job(2, cap=None)
    submit(control, 4)
    dispatched(control)
    held = control.tracker.assigned_count("spot-1")
    control.pool.set_instance_cap(1)
    control.tick()
    assert held and control.tracker.assigned_count("spot-1") == held
    submit(control, 2, "t")
    assert dispatched(control) <= {"spot-0"}


@pytest.mark.parametrize("raw, cap", [
    (None, None), (b'{"n_prem": 3}', 3), (b'{"n_prem": 0}', 0),
    (b'{"n_prem": -1}', None), (b'{"n_prem": true}', None), (b"garbage", None), (b"{}", None),
])
def test_the_etcd_record_is_read_and_a_malformed_one_means_no_cap(raw, cap):
    assert parse_instance_cap(raw) == cap


def test_a_negative_cap_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        spot_job(1, cap=None).pool.set_instance_cap(-1)
