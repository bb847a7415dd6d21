"""Shared by the transfer benchmarks: a local etcd plus transfer agents as real processes."""

from __future__ import annotations

import tempfile
import time
import urllib.request
from pathlib import Path

from results_file import results_path

from rlharvest.common.local_etcd import free_port
from rlharvest.cli.launcher import LocalStack


def local_stack() -> LocalStack:
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="rlh-bench-")))
    stack.start_etcd()
    return stack


def start_agent(stack: LocalStack, name: str, *extra: str, cluster: str = "default") -> tuple[str, int]:
    port, metrics_port = free_port(), free_port()
    proc = stack.start("transfer_agent", name, [
        "--agent-id", name, "--cluster", cluster, "--port", str(port), "--metrics-port",
        str(metrics_port), "--lease-ttl", "3", "--log-level", "warning", *extra])
    deadline = time.monotonic() + 60
    while True:
        if not proc.alive():
            raise RuntimeError(f"agent {name} exited:\n{proc.log_tail()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=1)
            return f"127.0.0.1:{port}", metrics_port
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent {name} not up:\n{proc.log_tail()}") from None
            time.sleep(0.1)


def write_results(name: str, text: str, quick: bool) -> None:
    results_path(name, quick).write_text(text)
    print(text)
