"""`rlharvest etcd-roles`: etcd's users and roles for a cluster under mutual TLS, so each
service's certificate writes only its role's keys (``rlharvest/common/etcd_roles.py``).

etcd takes a client certificate's common name as its user. ``install`` creates a role per
service role, etcd's root user and the admins (operator certificates' names) with the root role,
and enables auth; ``add-user`` makes one more certificate name a user of a service role. Run both
with an admin's certificate (before ``install``: any certificate of the CA).

    rlharvest etcd-roles --etcd https://etcd:2379 --tls-cert op.pem --tls-key op.key \\
        --tls-ca ca.pem --admin operator --user worker-0=worker --user manager-0=manager
"""

from __future__ import annotations

import asyncio

import typer

from rlharvest.common import etcd_roles, registry
from rlharvest.common.config import ConfigError
from rlharvest.cli.up_command import configure_tls


def etcd_roles_command(
        etcd: str = typer.Option(..., help="etcd endpoint, https://host:port"),
        tls_cert: str = typer.Option(..., help="an admin's certificate (its common name is "
                                     "the etcd user; before install: any of the CA)"),
        tls_key: str = typer.Option(..., help="its private key"),
        tls_ca: str = typer.Option(..., help="the CA of etcd's and the services' certificates"),
        admin: list[str] = typer.Option([], help="install: a certificate name given etcd's "
                                        "root role (repeat); include the one you run as"),
        user: list[str] = typer.Option([], help="NAME=ROLE: a certificate name acting as a "
                                       f"service role, one of {sorted(etcd_roles.WRITES)} "
                                       "(repeat)"),
        install: bool = typer.Option(False, help="create the roles and enable auth first"),
) -> None:
    """Create etcd's roles and users for the services' certificates."""
    users = [_parse_user(u) for u in user]
    if install and not admin:
        raise typer.BadParameter("install needs --admin: without an admin nobody may manage "
                                 "etcd's users after auth is on", param_hint="--admin")
    configure_tls(tls_cert, tls_key, tls_ca)
    try:
        asyncio.run(_apply(etcd, tuple(admin) if install else None, users))
    except (ConnectionError, ConfigError) as exc:
        typer.echo(f"rlharvest etcd-roles: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"etcd at {etcd}: {'roles installed, auth on; ' if install else ''}"
               f"{len(users)} user(s) added")


def _parse_user(text: str) -> tuple[str, str]:
    name, sep, role = text.partition("=")
    if not sep or not name or role not in etcd_roles.WRITES:
        raise typer.BadParameter(f"{text!r}: give NAME=ROLE, ROLE one of "
                                 f"{sorted(etcd_roles.WRITES)}", param_hint="--user")
    return name, role


async def _apply(endpoint: str, admins: tuple[str, ...] | None,
                 users: list[tuple[str, str]]) -> None:
    client = await registry.connect(endpoint)
    try:
        if admins is not None:
            await etcd_roles.install(client, admins)
        for name, role in users:
            await etcd_roles.add_user(client, name, role)
    finally:
        await client.close()
