"""etcd's own users and roles, so that a service's certificate touches only its keys.

With ``--client-cert-auth`` and auth enabled, etcd takes a client certificate's common name as
its user: every certificate of the CA that names a user may read rlharvest's keys, and writes
only under the prefixes of its role (``WRITES``). A worker cannot rewrite a manager's election,
a lending claim, the placement state or another service's membership; an unknown name may
write nothing. The prefixes are per service role, not per job or member: a trainer may write
another job's records under ``jobs/`` (the gRPC calls are scoped by job, ``authorization.py``).

``WRITES`` and ``grants`` are pure; ``install`` and ``add_user`` speak etcd's Auth API with a
client that already holds root (before auth is enabled, any client).
"""

from __future__ import annotations

import aetcd
import aetcd.rpc
import grpc

from rlharvest.common import keys

ROOT_ROLE = "root"  # etcd's own: every key, and the Auth API
_READ_ALL = keys.ROOT + "/"

# Under keys.ROOT, the prefixes each service role writes (keys.py documents every key).
WRITES: dict[str, tuple[str, ...]] = {
    "worker": ("members/rollout_worker/", "pairing/"),
    "coexecutor": ("members/coexecutor/", "pairing/"),
    "agent": ("members/transfer_agent/", "weights/"),
    # The seed role registers as a rollout worker.
    "trainer": ("members/trainer/", "members/rollout_worker/", "jobs/"),
    # Every job's manager election (keys.manager_election: rollout_manager.<job>).
    "manager": ("members/rollout_manager/", "election/rollout_manager.", "lending/", "jobs/"),
    "scheduler": ("members/placement_scheduler/", f"election/{keys.PLACEMENT_ELECTION}/",
                  "placement/"),
}


def etcd_role(role: str) -> str:
    """The etcd role of a service role (its own namespace in etcd's role list)."""
    return f"rlharvest-{role}"


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range end of every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def grants(role: str) -> list[aetcd.rpc.Permission]:
    """What ``role`` may do: read every rlharvest key, read and write its own prefixes."""
    if role not in WRITES:
        raise ValueError(f"no etcd permissions for the role {role!r}; one of {sorted(WRITES)}")
    read = _READ_ALL.encode()
    perms = [aetcd.rpc.Permission(permType=aetcd.rpc.Permission.READ, key=read,
                                  range_end=prefix_end(read))]
    for prefix in WRITES[role]:
        key = f"{keys.ROOT}/{prefix}".encode()
        perms.append(aetcd.rpc.Permission(permType=aetcd.rpc.Permission.READWRITE, key=key,
                                          range_end=prefix_end(key)))
    return perms


async def install(client: aetcd.Client, admins: tuple[str, ...]) -> None:
    """Create a role per service role, etcd's root user and ``admins`` (common names of
    operator certificates) with the root role, then enable auth. Idempotent: an existing
    role, user or grant is left as it is."""
    auth = aetcd.rpc.AuthStub(client.channel)
    for role in WRITES:
        await _ignore_exists(auth.RoleAdd(aetcd.rpc.AuthRoleAddRequest(name=etcd_role(role))))
        for perm in grants(role):
            await auth.RoleGrantPermission(aetcd.rpc.AuthRoleGrantPermissionRequest(
                name=etcd_role(role), perm=perm))
    for name in ("root", *admins):
        await _add_user(auth, name, ROOT_ROLE)
    await auth.AuthEnable(aetcd.rpc.AuthEnableRequest())


async def add_user(client: aetcd.Client, name: str, role: str) -> None:
    """The user a certificate named ``name`` acts as, in the service role ``role``."""
    if role not in WRITES:
        raise ValueError(f"no etcd permissions for the role {role!r}; one of {sorted(WRITES)}")
    await _add_user(aetcd.rpc.AuthStub(client.channel), name, etcd_role(role))


async def _add_user(auth: aetcd.rpc.AuthStub, name: str, role: str) -> None:
    # No password: the user signs in with its certificate only.
    await _ignore_exists(auth.UserAdd(aetcd.rpc.AuthUserAddRequest(
        name=name, options=aetcd.rpc.UserAddOptions(no_password=True))))
    await auth.UserGrantRole(aetcd.rpc.AuthUserGrantRoleRequest(user=name, role=role))


async def _ignore_exists(call) -> None:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or "already exists" not in \
                (exc.details() or ""):
            raise
