"""`rlharvest etcd-maintain`: keep a cluster's etcd small until SIGTERM — compact it to the
revision of ``--keep-s`` ago and defragment it when its file is mostly free space
(``rlharvest/common/etcd_maintenance.py``). One per etcd cluster (two are harmless); with auth on
it needs an admin's certificate (etcd's root role: a service role may not defragment). The
endpoint and the TLS files also come from ``RLH_ETCD`` and ``RLH_TLS_*``, as the services'.

    rlharvest etcd-maintain --etcd https://etcd:2379 --tls-cert op.pem --tls-key op.key \\
        --tls-ca ca.pem --metrics-port 9400
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

import typer

from rlharvest.common import observability, registry
from rlharvest.common.etcd_maintenance import EtcdMaintainer, MaintenanceConfig, MiB
from rlharvest.cli.up_command import configure_tls


def etcd_maintain_command(
        etcd: str = typer.Option("127.0.0.1:2379", envvar="RLH_ETCD", help="etcd endpoint (https://host:port: "
                                 "over TLS with --tls-*)"),
        tls_cert: str = typer.Option("", envvar="RLH_TLS_CERT", help="an admin's certificate (etcd's root role)"),
        tls_key: str = typer.Option("", envvar="RLH_TLS_KEY", help="its private key"),
        tls_ca: str = typer.Option("", envvar="RLH_TLS_CA", help="the CA of etcd's certificate"),
        keep_s: float = typer.Option(300.0, help="history kept: compact to the revision of "
                                     "this many seconds ago"),
        compact_every_s: float = typer.Option(60.0, help="at most one compaction per this"),
        defrag_free_share: float = typer.Option(0.5, help="defragment when more than this "
                                                "share of the file is free ..."),
        defrag_min_free_mib: float = typer.Option(64.0, help="... and at least this much"),
        defrag_every_s: float = typer.Option(3600.0, help="at most one defrag per this (it "
                                             "blocks etcd's writes while it runs)"),
        period_s: float = typer.Option(10.0, help="seconds between status checks"),
        metrics_port: int = typer.Option(0, help="serve /metrics here (rlh_etcd_*; 0: none)"),
) -> None:
    """Compact and defragment etcd by policy until SIGTERM."""
    if tls_cert or tls_key or tls_ca:
        configure_tls(tls_cert, tls_key, tls_ca)
    try:
        registry.check_endpoint(etcd)  # a typo or missing TLS files: said now, not retried
        config = MaintenanceConfig(keep_s, compact_every_s, defrag_free_share,
                                   int(defrag_min_free_mib * MiB), defrag_every_s)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    observability.setup_logging("etcd-maintain", json_logs=False)
    maintainer = EtcdMaintainer(partial(registry.connect, etcd), config, period_s)
    observability.run_service(partial(_serve, maintainer, metrics_port), use_uvloop=False)


async def _serve(maintainer: EtcdMaintainer, metrics_port: int, stop: asyncio.Event) -> None:
    runner = None
    if metrics_port:
        runner, _ = await observability.start_http(
            "0.0.0.0", metrics_port, lambda: {"status": "ok"})
    task = asyncio.create_task(maintainer.run())
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # run() ends only by an error etcd being away does not explain
    finally:
        stopped.cancel()
        task.cancel()
        if runner is not None:
            await runner.cleanup()
        logging.getLogger(__name__).info("etcd maintenance stopped: %d compactions, %d defrags",
                                         maintainer.compactions, maintainer.defrags)
