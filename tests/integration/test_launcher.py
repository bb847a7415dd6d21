"""The local stack the demo, `rlharvest train` and `rlharvest up` start: one that fails while
starting (a service never became healthy, Ctrl-C) stops what it had started, instead of leaving
etcd and services running behind the command."""

from __future__ import annotations

import pytest

from rlharvest.cli.launcher import LocalStack

pytestmark = pytest.mark.integration


def test_a_stack_failing_while_it_starts_stops_what_it_had_started(tmp_path):
    stack = LocalStack(tmp_path)
    with pytest.raises(TimeoutError), stack.stopped_on_error():
        stack.start_etcd()
        agent = stack.start("transfer_agent", "agent", ["--agent-id", "agent-0"])
        assert stack.etcd is not None and stack.etcd.process is not None
        etcd = stack.etcd.process
        raise TimeoutError("the manager never became healthy")
    assert etcd.poll() is not None and not agent.alive()
