"""Start a throw-away etcd for the local stack and the tests: binary on PATH, free loopback
ports, a temporary data directory removed on stop."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalEtcd:
    def __init__(self, binary: str = "etcd", log_path: Path | None = None):
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(
                f"{binary!r} is not on PATH; install it (Debian: apt-get install etcd-server)")
        self.binary = path
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self._log_path = log_path
        self._data_dir: str | None = None
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> "LocalEtcd":
        self._data_dir = tempfile.mkdtemp(prefix="rlh-etcd-")
        client_url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        log = open(self._log_path or Path(self._data_dir) / "etcd.log", "ab")
        self.process = subprocess.Popen(
            [self.binary, "--name", "rlh-local", "--data-dir", self._data_dir,
             "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"rlh-local={peer_url}", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self._wait_healthy(client_url, timeout)
        return self

    def _wait_healthy(self, client_url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.process.returncode}; "
                                   f"see its log in {self._data_dir}")
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=1) as resp:
                    if b'"true"' in resp.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"etcd did not become healthy within {timeout}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def __enter__(self) -> "LocalEtcd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
