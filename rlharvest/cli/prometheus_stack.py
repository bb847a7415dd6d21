"""`rlharvest up --prometheus`: a real Prometheus scraping the local stack.

Every service registers its metrics address in etcd (``member_info["metrics"]``, the service
host adds it), and members come and go (a spot worker is SIGKILLed, a replacement joins), so the
targets are not a fixed list: a sync loop writes etcd's members to a ``file_sd`` targets file,
which Prometheus re-reads by itself (no reload). The binary is the Debian package's
(``make install`` installs it when missing); its config and data live in the stack's log dir.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlharvest.common import registry
from rlharvest.common.local_etcd import stop_process

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 1.0


@dataclass(frozen=True)
class TlsFiles:
    """The client certificate, its key and the CA Prometheus scrapes a TLS stack with."""

    cert: Path
    key: Path
    ca: Path


def target_groups(members: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """etcd members (key -> info) as Prometheus ``file_sd`` target groups, one per member,
    labelled with its service and id; members without a metrics address are left out."""
    groups = []
    for key in sorted(members):
        address = members[key].get("metrics")
        if not address:
            continue
        service, member = key.rstrip("/").split("/")[-2:]
        groups.append({"targets": [address], "labels": {"service": service, "member": member}})
    return groups


def duration(seconds: float) -> str:
    """Prometheus durations take no fractions: whole milliseconds."""
    return f"{max(1, round(seconds * 1000))}ms"


# The alert rules the compose stack loads; a source checkout has them, an installed wheel may not.
ALERT_RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


def config_text(targets_file: Path, scrape_interval_s: float,
                rule_files: tuple[Path, ...] = (), tls: TlsFiles | None = None) -> str:
    """prometheus.yml: one scrape job over the targets file (JSON is valid YAML), evaluating
    ``rule_files``; with ``tls``, over HTTPS with that client certificate (a mutual-TLS
    stack's /metrics want one of its CA)."""
    job: dict[str, Any] = {
        "job_name": "rlharvest",
        "file_sd_configs": [{"files": [str(targets_file)],
                             "refresh_interval": duration(SYNC_INTERVAL_S)}],
    }
    if tls is not None:
        job["scheme"] = "https"
        job["tls_config"] = {"cert_file": str(tls.cert), "key_file": str(tls.key),
                             "ca_file": str(tls.ca)}
    return json.dumps({
        "global": {"scrape_interval": duration(scrape_interval_s),
                   "evaluation_interval": duration(scrape_interval_s)},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [job],
    }, indent=1)


def api(url: str, path: str, **params: Any) -> dict[str, Any]:
    """The ``data`` of a Prometheus HTTP API call (``query``, ``query_range``, ``rules``...) at
    the server ``url``; RuntimeError when it does not succeed."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{url}/api/v1/{path}{query}", timeout=10) as reply:
        body = json.loads(reply.read())
    if body.get("status") != "success":
        raise RuntimeError(f"prometheus {path} {params} failed: {body}")
    return dict(body["data"])


def write_if_changed(path: Path, text: str) -> bool:
    """Atomic (rename) so Prometheus never reads half a file."""
    if path.exists() and path.read_text() == text:
        return False
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


@dataclass
class LocalPrometheus:
    """A Prometheus process scraping whatever is registered in ``etcd_endpoint``."""

    etcd_endpoint: str
    directory: Path
    port: int = 9090
    scrape_interval_s: float = 1.0
    tls: TlsFiles | None = None  # scrape over HTTPS with this certificate
    process: subprocess.Popen | None = None
    _stop: threading.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def targets_file(self) -> Path:
        return self.directory / "targets.json"

    def start(self, ready_timeout: float = 30.0) -> LocalPrometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("no prometheus binary on PATH: `make install` installs the Debian "
                               "package, or apt-get install prometheus")
        self.directory.mkdir(parents=True, exist_ok=True)
        write_if_changed(self.targets_file, "[]")
        config = self.directory / "prometheus.yml"
        rules = (ALERT_RULES,) if ALERT_RULES.is_file() else ()
        config.write_text(config_text(self.targets_file, self.scrape_interval_s, rules,
                                      self.tls))
        self._stop = threading.Event()
        threading.Thread(target=self._sync_thread, name="prometheus targets", daemon=True).start()
        with open(self.directory / "prometheus.log", "ab") as out:
            self.process = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={self.directory / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(ready_timeout)
        except BaseException:  # never ready (or Ctrl-C): it must not outlive the caller
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.process.returncode}); see "
                                   f"{self.directory / 'prometheus.log'}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready on {self.url} within {timeout:g}s")

    def _sync_thread(self) -> None:
        asyncio.run(self._sync())

    async def _sync(self) -> None:
        """etcd members -> the targets file, until stopped; an etcd hiccup keeps the last file."""
        assert self._stop is not None
        etcd = await registry.connect(self.etcd_endpoint)
        try:
            while not self._stop.is_set():
                try:
                    members = await registry.list_members(etcd)
                    write_if_changed(self.targets_file,
                                     json.dumps(target_groups(members), indent=1))
                except Exception as exc:  # noqa: BLE001 - keep the last targets, try again
                    log.warning("could not sync Prometheus targets from etcd: %s", exc)
                await asyncio.sleep(SYNC_INTERVAL_S)
        finally:
            await etcd.close()

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query through the HTTP API: the result vector."""
        return list(api(self.url, "query", query=promql)["result"])

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self.process is not None:
            stop_process(self.process)
