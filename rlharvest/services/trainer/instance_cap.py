"""The trainer writes its job's remote-instance cap N_prem (RLBoost Algorithm 1, line 10).

After every step the trainer hands Algorithm 1 its own timings (t_train: training compute,
t_train_wait: training idle, waiting for groups) and the manager's (the step's last event:
``rlharvest/services/rollout_manager/remote_timing.py``), and writes the N_prem it returns to etcd
(``keys.instance_cap_key``): the manager then holds spot workers beyond it as standby, and an
autoscaler reads it to start no more spot instances than the step will use.

Without the trainer's seed role the seeding window is held at 0 (``t_seed_cap`` 0), and line 10
reduces to N_prem = t_remote * n_prem_mean / t_train, the remote instances that finish a step's
rollout work within the time the trainer computes. With it (``--seed-role``), T_seed adapts
(line 9) and the next step's window is ``window.schedule.t_seed``. The cap is advisory:
an etcd error is logged and the next step writes again.
"""

from __future__ import annotations

import logging

from rlharvest.common import keys, registry
from rlharvest.common.etcd_outage import etcd_answered, etcd_failed
from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.services.trainer.seeding_window import SeedingWindow, StepTimings

log = logging.getLogger(__name__)


def step_timings(t_train: float, t_train_wait: float, remote: mpb.RemoteTimings) -> StepTimings:
    """Algorithm 1's view of one step. Availability (the clamp and the memory's level) is what
    the next step could use: healthy spot workers, standby included."""
    return StepTimings(t_train=t_train, t_train_wait=t_train_wait, t_remote=remote.t_remote,
                       t_remote_wait=remote.t_remote_wait, n_prem_mean=remote.n_prem_mean,
                       n_prem_next=remote.n_available_next)


class InstanceCap:
    def __init__(self, etcd, job: str, *, seeding: bool = False, t_init: float = 0.0,
                 eta: float = 1.0) -> None:
        """``seeding``: the trainer has its seed role (``seed_role.py``): T_seed adapts from
        ``t_init``, capped by the longest rollout measured (``rollout_measured``); without
        it T_seed stays 0."""
        self._etcd = etcd
        self._key = keys.instance_cap_key(job)
        self.window = SeedingWindow(n_resv=1, eta=eta, t_init=t_init if seeding else 0.0,
                                    t_seed_cap=None if seeding else 0.0)
        self._seeding = seeding

    def rollout_measured(self, seconds: float) -> None:
        """A step's whole rollout took ``seconds``: a window that long covers all of it (the
        co-located fallback), so T_seed never needs to exceed the longest one seen."""
        if self._seeding and seconds > (self.window.t_seed_cap or 0.0):
            self.window.measured_full_rollout(seconds)

    async def after_step(self, t_train: float, t_train_wait: float,
                         remote: mpb.RemoteTimings | None) -> int | None:
        """Decide and write N_prem; None when the step carried no remote timings (a manager
        that does not measure them) or nothing was trained."""
        if remote is None or t_train <= 0:
            return None
        n_prem = self.window.observe(step_timings(t_train, t_train_wait, remote)).n_prem
        try:
            await self._etcd.put(self._key.encode(), registry.instance_cap_record(n_prem))
        except Exception as exc:  # advisory: the next step writes again
            etcd_failed(exc, f"writing the instance cap N_prem={n_prem}")  # an outage: once
            return None
        etcd_answered()
        log.info("instance cap N_prem=%d (t_remote %.2fs x %.2f instances / t_train %.2fs)",
                 n_prem, remote.t_remote, remote.n_prem_mean, t_train)
        return n_prem
