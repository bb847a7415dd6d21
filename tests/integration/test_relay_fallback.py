"""A relaying agent whose copy of the base version differs from the source's (the deltas it is
sent do not verify against it) pulls the version dense instead of asking for the same deltas
again after every backoff."""

from __future__ import annotations

import pytest
import torch

from rlharvest.services.transfer_agent.client import publish, pull

from .test_agent_idle_jobs import held_by, nudged, weights
from .test_transfer_agent import scrape, start_agent, wait_for

pytestmark = pytest.mark.integration


async def test_a_relay_whose_deltas_do_not_apply_to_its_base_pulls_the_version_dense(
        stack, etcd_client):
    job = "relay-mismatched-base"
    _, source, _ = start_agent(stack, "base-source")
    relay_proc, relay, relay_metrics = start_agent(stack, "base-relay", "--relay", "--relay-jobs",
                                                   job)
    theirs, ours = weights(1), weights(2)
    await publish(relay, job, 1, ours)  # the relay holds a version 1 of its own
    await publish(source, job, 1, theirs)  # not newer: the relay keeps its own
    v2 = nudged(theirs, 3)  # sparse against the source's version 1, not the relay's
    await publish(source, job, 2, v2)

    async def relayed() -> bool:
        return 2 in await held_by(etcd_client, job, "base-relay")

    await wait_for(relayed, timeout=20, what="version 2 relayed")
    got = (await pull(relay, job, version=2)).tensors
    assert torch.equal(got["w"], v2["w"])
    assert scrape(relay_metrics)["rlh_agent_relays_total{link=local}"] == 1
    log = relay_proc.log_path.read_text(errors="replace")  # one try, then dense at once
    assert "do not apply to the held version 1" in log and "pulling it dense" in log, log
    assert "trying again" not in log, log
