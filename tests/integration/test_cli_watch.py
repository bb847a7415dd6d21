"""`rlharvest status --watch` on a live stack, as a script runs it: stdout is a pipe, so every
refresh prints one frame; a SIGKILLed worker turns gone, Ctrl-C ends the watch cleanly."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time

import pytest

from rlharvest.common.local_etcd import free_port

from .test_cli import CLI, ENV
from .worker_client import WorkerHandle, launch_worker, wait_serving

pytestmark = pytest.mark.integration
FRAME = re.compile(r"─ refresh (\d+) ─")


class Frames:
    """The watch's stdout, read by a thread and cut into frames at each refresh rule."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def frames(self) -> list[str]:
        out: list[list[str]] = []
        for line in list(self.lines):
            if FRAME.search(line):
                out.append([])
            elif out:
                out[-1].append(line)
        return ["".join(f) for f in out]

    def wait_for(self, ok, what: str, timeout: float) -> str:
        """The first complete frame (one followed by another) that ``ok`` accepts."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for frame in self.frames()[:-1]:
                if ok(frame):
                    return frame
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no frame with {what}:\n{''.join(self.lines[-80:])}")


def row(frame: str, first: str) -> str:
    """The line of the members or workers table that starts with ``first``."""
    return next((line for line in frame.splitlines()
                 if line.strip("│ ").split("│")[0].strip() == first), "")


def test_watch_follows_the_live_stack_and_stops_on_ctrl_c(stack, etcd_endpoint):
    port, metrics_port = free_port(), free_port()
    manager = WorkerHandle(stack.start("rollout_manager", "watch-m0", [
        "--manager-id", "watch-m0", "--port", str(port), "--metrics-port", str(metrics_port),
        "--lease-ttl", "2"]), f"127.0.0.1:{port}", metrics_port)
    worker = launch_worker(stack, "watch-w0", "--kind", "spot")
    # started with the services: its imports overlap theirs
    watch = subprocess.Popen([*CLI, "status", "--etcd", etcd_endpoint, "--watch", "--interval",
                              "0.2", "--timeout", "1", "--max-refreshes", "1000"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        out = Frames(watch)
        wait_serving(manager, 90)
        wait_serving(worker, 90)
        live = out.wait_for(lambda f: "spot" in row(f, "watch-w0") and "1/1 healthy" in
                            row(f, "watch-m0") and "│ up" in row(f, "watch-w0"),
                            "the worker up with its load, the manager with it healthy", 30)
        assert f"etcd {etcd_endpoint}" in live
        members = [line for line in live.splitlines() if "127.0.0.1:" in line]
        assert any("rollout_manager" in m and "watch-m0" in m for m in members), live
        assert any("rollout_worker" in m and "watch-w0" in m for m in members), live
        worker_row = row(live, "watch-w0")  # the members table's, then the load table's
        cells = [c.strip() for c in worker_row.split("│")[1:-1]]
        assert cells[:2] == ["watch-w0", "spot"] and cells[-1] == "up", worker_row
        assert all(c.isdigit() for c in cells[4:6]), worker_row  # pending, executing

        worker.process.kill()  # its lease (2 s) runs out: the member is gone, not dropped
        out.wait_for(lambda f: "gone" in row(f, "watch-w0"), "the killed worker gone", 20)

        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=20) == 0
        text = "".join(out.lines)
        assert "Traceback" not in text and "KeyboardInterrupt" not in text
        refreshes = [int(m.group(1)) for m in FRAME.finditer(text)]
        assert refreshes == list(range(1, len(refreshes) + 1))  # one frame a refresh
    finally:
        if watch.poll() is None:
            watch.kill()


def test_watch_exits_after_max_refreshes_and_says_when_etcd_is_unreachable():
    shown = subprocess.run([*CLI, "status", "--etcd", "127.0.0.1:1", "--timeout", "0.5",
                            "--watch", "--interval", "0.1", "--max-refreshes", "2"],
                           capture_output=True, text=True, env=ENV, timeout=60)
    assert shown.returncode == 1  # the last refresh did not reach etcd
    assert [int(n) for n in FRAME.findall(shown.stdout)] == [1, 2]
    assert shown.stdout.count("etcd at 127.0.0.1:1 is unreachable") == 2
    assert "Traceback" not in shown.stdout + shown.stderr
