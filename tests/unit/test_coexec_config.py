"""A co-executor with a bad setting does not start, and the message names the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlharvest.cli.launcher import child_environment


@pytest.mark.parametrize(("flag", "value"), [("--headroom", "1.5"), ("--headroom", "0"),
                                             ("--ttft-slo-ms", "0"), ("--tpot-slo-ms", "-1"),
                                             ("--page-tokens", "0"), ("--slo-margin", "1")])
def test_a_bad_setting_stops_the_service_naming_the_key(flag, value):
    done = subprocess.run([sys.executable, "-m", "rlharvest.services.coexecutor.main", flag,
                           value], capture_output=True, text=True, env=child_environment(),
                          timeout=120)
    assert done.returncode == 2
    assert flag[2:].replace("-", "_") + ":" in done.stderr, done.stderr
