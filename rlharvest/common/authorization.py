"""Who may call what, by the role in the caller's certificate (mutual TLS only).

A certificate carries its holder's role as a URI subject alternative name
``urn:rlharvest:role:<role>`` (``tls.LocalCA`` writes it). The calls that change what the system
learns, runs or schedules take only some roles:

- ``RolloutManager.SubmitStep``, ``RolloutManager.HoldSeedWindow`` and ``TransferAgent.Publish``
  — a trainer (its job's steps, seeding windows and weights); ``RolloutManager.Generate`` — a
  trainer or an operator;
- ``RolloutWorker.Session`` — a manager (it runs rollouts on workers and co-executors);
  ``RolloutWorker.LoadWeights`` — a trainer or an operator;
- the placement scheduler's ``SubmitJob``, ``CancelJob``, ``AcquirePermit``, ``ReleasePermit``
  and ``ReportProgress`` — a trainer (a job) or an operator.

The reads (status, info, placements, weight pulls, health, reflection) are open to any peer
the CA vouches for: workers, co-executors and agents pull weights. A call from another role
gets PERMISSION_DENIED naming the roles it needs. Without TLS there are no identities and
nothing is checked (plaintext is for a trusted network only).

Steps and weights are also scoped to a job: a certificate names the jobs its holder acts for as
``urn:rlharvest:job:<job>`` (``*``: every job), and a manager takes ``SubmitStep``,
``HoldSeedWindow`` and ``Generate`` only for its own job, an agent ``Publish`` only for the job the publish names, from
a certificate naming that job (``job_refusal``); an operator acts for any job. The placement
scheduler's calls stay scoped by role. Pure: the policy takes the method and the peer's
identity; ``peer_identity`` reads it from a certificate.

The other way round, a client checks the role of the server it dials where a peer of another
role could do harm (a weight holder, a worker, a manager, the scheduler: endpoints read from
etcd): a certificate also names its role as the DNS name ``<role>.role.rlharvest``
(``role_name``), and ``rpc.channel(peer_role=)`` has the TLS handshake check that name.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

ROLE_URI_PREFIX = "urn:rlharvest:role:"
JOB_URI_PREFIX = "urn:rlharvest:job:"
ANY_JOB = "*"

_JOB = ("trainer", "operator")
_SCHEDULER = "/rlharvest.v1.PlacementScheduler/"
REQUIRED_ROLE: dict[str, tuple[str, ...]] = {
    "/rlharvest.v1.RolloutManager/SubmitStep": ("trainer",),
    "/rlharvest.v1.RolloutManager/HoldSeedWindow": ("trainer",),
    "/rlharvest.v1.RolloutManager/Generate": _JOB,
    "/rlharvest.v1.TransferAgent/Publish": ("trainer",),
    "/rlharvest.v1.RolloutWorker/Session": ("manager",),
    "/rlharvest.v1.RolloutWorker/LoadWeights": _JOB,
    **{_SCHEDULER + m: _JOB for m in ("SubmitJob", "CancelJob", "AcquirePermit",
                                      "ReleasePermit", "ReportProgress")},
}


# The role each service's certificate carries (``LocalStack`` issues them so).
SERVICE_ROLES = {"rollout_worker": "worker", "rollout_manager": "manager",
                 "transfer_agent": "agent", "trainer": "trainer", "coexecutor": "coexecutor",
                 "placement_scheduler": "scheduler"}


def role_uri(role: str) -> str:
    return ROLE_URI_PREFIX + role


ROLE_NAME_SUFFIX = ".role.rlharvest"


def role_name(role: str) -> str:
    """The DNS subject alternative name a certificate of ``role`` carries besides its URI, e.g.
    ``agent.role.rlharvest``: what a client dialing a peer of that role checks in the TLS
    handshake (``rpc.channel(peer_role=)``), where the URI cannot be checked."""
    return role + ROLE_NAME_SUFFIX


def job_uri(job: str) -> str:
    return JOB_URI_PREFIX + job


@dataclass(frozen=True)
class Identity:
    """What a peer's certificate says of its holder: its roles and the jobs it acts for."""

    roles: tuple[str, ...] = ()
    jobs: tuple[str, ...] = ()
    # Its DNS names (hosts, and role_name of its roles): what clients check, not who it is.
    names: tuple[str, ...] = field(default=(), compare=False)


def refusal(method: str, roles: Iterable[str]) -> str | None:
    """Why a peer holding ``roles`` may not call ``method``, or None when it may."""
    needed = REQUIRED_ROLE.get(method)
    held = sorted(set(roles))
    if needed is None or set(needed) & set(held):
        return None
    return (f"{method} needs a certificate of role {' or '.join(repr(r) for r in needed)}; "
            f"the caller's has {', '.join(repr(r) for r in held) or 'no role'}")


def job_refusal(job: str, identity: Identity) -> str | None:
    """Why ``identity`` may not submit steps or publish weights of ``job``, or None when it
    may: its certificate names the job (or every job), or it is an operator's."""
    if "operator" in identity.roles or ANY_JOB in identity.jobs or job in identity.jobs:
        return None
    named = ", ".join(repr(j) for j in identity.jobs) or "no job"
    return (f"job {job!r} needs a certificate naming it ({job_uri(job)}); the caller's "
            f"names {named}")


def peer_roles(pem_certificate: bytes) -> list[str]:
    """The roles a PEM certificate names in its URI subject alternative names."""
    return list(peer_identity(pem_certificate).roles)


@functools.lru_cache(maxsize=256)
def peer_identity(pem_certificate: bytes) -> Identity:
    """Parsed once per certificate: every guarded call would otherwise parse its peer's PEM."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem_certificate)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return Identity()
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    return Identity(tuple(u[len(ROLE_URI_PREFIX):] for u in uris
                          if u.startswith(ROLE_URI_PREFIX)),
                    tuple(u[len(JOB_URI_PREFIX):] for u in uris if u.startswith(JOB_URI_PREFIX)),
                    tuple(sans.get_values_for_type(x509.DNSName)))
