"""Start a throw-away etcd for the local stack and the tests: binary on PATH, free loopback
ports, a temporary data directory removed on stop; with a ``tls.LocalCA``, clients speak
mutual TLS to it (``https://`` endpoint, a certificate of the CA required)."""

from __future__ import annotations

import functools
import random
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Sequence
import urllib.request
from pathlib import Path

from rlharvest.common import tls


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


_handed_out: set[int] = set()  # ports this process picked: never picked twice
_rng = random.Random()


@functools.cache
def _ephemeral_floor() -> int:
    """The lowest port the kernel picks for outgoing connections (Linux: 32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct free ports for services to bind later. They come from below the kernel's
    ephemeral range, so no outgoing connection can take one as its source port between the
    pick and the bind (CI once lost a worker's metrics port so), and never twice in a process.
    Another process binding explicitly may still take one; callers that bind later retry on
    "address already in use". Without room below that range, the kernel picks."""
    floor = _ephemeral_floor()
    low, high = 10_000, floor - 1
    if high - low < 1_000:
        return _kernel_picked(count, host)
    if len(_handed_out) > (high - low) // 2:
        _handed_out.clear()  # a very long run: recycle (long-finished tests released them)
    picked: list[int] = []
    while len(picked) < count:
        port = _rng.randint(low, high)
        if port not in _handed_out and port not in picked and _bindable(host, port):
            picked.append(port)
    _handed_out.update(picked)
    return picked


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_picked(count: int, host: str) -> list[int]:
    """Distinct ports the kernel picks: every socket stays bound until all are picked."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class PortTakenError(OSError):
    """etcd could not bind a port picked as free (another process took it first)."""


def stop_process(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM a local server process, SIGKILL it after ``timeout``; returns once it is gone."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()



def stop_processes(processes: Sequence[subprocess.Popen], timeout: float = 30.0) -> None:
    """``stop_process`` for many at once: all are sent SIGTERM first, so their shutdowns
    overlap, then each gets up to ``timeout`` before SIGKILL."""
    alive = [p for p in processes if p.poll() is None]
    for process in alive:
        process.terminate()
    for process in alive:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

def _server_identity(ca: tls.LocalCA) -> tls.TlsMaterial | None:
    """etcd's certificate, issued by ``ca``; it also checks etcd's health as a client
    certificate of the CA (the CA's certificates serve both ways)."""
    cert, key = ca.issue("etcd", "etcd")
    return tls.load(str(cert), str(key), str(ca.ca_path))


# The common name only etcd's own peer certificate carries. etcd 3.4 serves its whole v3 API
# on the peer port too, so a peer port that took any certificate of the CA (a worker's) would
# let every service write every key past the client port's checks.
PEER_COMMON_NAME = "etcd-peer"


def _peer_identity(ca: tls.LocalCA) -> tuple[str, str]:
    cert, key = ca.issue(PEER_COMMON_NAME, "etcd")
    return str(cert), str(key)


class LocalEtcd:
    """``ca``: serve clients over TLS with a certificate ``ca`` issues (for 127.0.0.1 and
    localhost) and require theirs to be the CA's too (etcd's ``--client-cert-auth``); the
    endpoint is then ``https://127.0.0.1:PORT``, which ``registry.connect`` dials with the
    process's certificate. The peer port then takes TLS too, and only a certificate named
    ``etcd-peer`` (``PEER_COMMON_NAME``): a single member has no peers, and etcd answers its
    whole API there. Without ``ca``, plaintext on ``127.0.0.1:PORT``, peers too."""

    def __init__(self, binary: str = "etcd", log_path: Path | None = None,
                 ca: tls.LocalCA | None = None, compaction_retention: str = "5m"):
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(
                f"{binary!r} is not on PATH; install it (Debian: apt-get install etcd-server)")
        self.binary = path
        # etcd compacts every retention period to the revision of one period before: the
        # history in use levels off at one to two periods of writes.
        self._retention = compaction_retention
        self._tls = None if ca is None else _server_identity(ca)
        self._peer = None if ca is None else _peer_identity(ca)
        self._pick_ports()
        self._log_path = log_path
        self._data_dir: str | None = None
        self.process: subprocess.Popen | None = None

    def _pick_ports(self) -> None:
        self.client_port, self.peer_port = free_ports(2)
        self.peer_url = f"{'https' if self._tls else 'http'}://127.0.0.1:{self.peer_port}"
        self.client_url = f"{'https' if self._tls else 'http'}://127.0.0.1:{self.client_port}"
        # What services take as --etcd: plain host:port without TLS, as always.
        self.endpoint = self.client_url if self._tls else f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0, attempts: int = 3) -> "LocalEtcd":
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(timeout)
            except PortTakenError:
                if attempt == attempts:
                    raise
                self._pick_ports()  # a port was taken between picking and binding: try others
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> "LocalEtcd":
        self._data_dir = tempfile.mkdtemp(prefix="rlh-etcd-")
        return self._launch(timeout)

    def restart(self, timeout: float = 20.0, *, crash: bool = False, down_s: float = 0.0) -> None:
        """Stop etcd and start it again on the same ports and data, as an operator's restart
        does: the keys, leases and users stay; what etcd keeps only in memory (auth tokens,
        watches) is gone. ``crash``: SIGKILL it instead of stopping it; ``down_s``: how long it
        stays down before it starts again."""
        if self.process is None or self._data_dir is None:
            raise RuntimeError("LocalEtcd.restart needs a started etcd")
        if crash:
            self.process.kill()
            self.process.wait()
        else:
            stop_process(self.process)
        time.sleep(down_s)
        self._launch(timeout)

    def _launch(self, timeout: float) -> "LocalEtcd":
        assert self._data_dir is not None  # set by _start_once, kept by restart
        client_url = self.client_url
        peer_url = self.peer_url
        log = open(self._log_file(), "ab")
        self._log_offset = log.tell()  # a shared log file keeps earlier attempts' lines
        self.process = subprocess.Popen(
            [self.binary, "--name", "rlh-local", "--data-dir", self._data_dir,
             "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"rlh-local={peer_url}", "--log-level", "warn",
             # The services write a few hundred revisions a minute: old ones are compacted
             # away (5 minutes kept), so the database levels off instead of reaching the quota.
             "--auto-compaction-mode", "periodic", "--auto-compaction-retention",
             self._retention,
             *self._tls_flags()],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self._wait_healthy(client_url, timeout)
        return self

    def _tls_flags(self) -> list[str]:
        if self._tls is None:
            return []
        cert, key, ca = self._tls.paths
        assert self._peer is not None  # issued with the server's identity
        peer_cert, peer_key = self._peer
        return ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca,
                "--client-cert-auth", "--peer-cert-file", peer_cert, "--peer-key-file", peer_key,
                "--peer-trusted-ca-file", ca, "--peer-client-cert-auth",
                "--peer-cert-allowed-cn", PEER_COMMON_NAME]

    def _wait_healthy(self, client_url: str, timeout: float) -> None:
        process = self.process
        if process is None:
            raise RuntimeError("LocalEtcd._wait_healthy called before the etcd process was started")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                with open(self._log_file(), "rb") as log:
                    log.seek(self._log_offset)
                    log_text = log.read().decode(errors="replace")
                self.stop()
                if "address already in use" in log_text:
                    raise PortTakenError(log_text.strip().splitlines()[-1])
                raise RuntimeError(f"etcd exited with code {process.returncode}: "
                                   f"{log_text.strip().splitlines()[-1:] }")
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=1,
                                            context=self._health_context()) as resp:
                    if b'"true"' in resp.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"etcd did not become healthy within {timeout}s")

    def _health_context(self) -> ssl.SSLContext | None:
        return None if self._tls is None else tls.client_ssl_context_for(self._tls)

    def _log_file(self) -> Path:
        if self._log_path is not None:
            return self._log_path
        if self._data_dir is None:
            raise RuntimeError("LocalEtcd has no data directory (not started, or already stopped) "
                               "and no log_path; pass log_path= or start() it first")
        return Path(self._data_dir) / "etcd.log"

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
        if self._data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def __enter__(self) -> "LocalEtcd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
