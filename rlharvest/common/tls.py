"""Mutual TLS for every gRPC server and client of a process.

One configuration per process (``tls_cert``, ``tls_key``, ``tls_ca``: PEM files, keys of every
service's config, so flags and ``RLH_`` env like any other key). ``configure`` loads them once at
start; from then on ``rpc.bind_server`` serves TLS and requires a client certificate signed by
the CA, and ``rpc.channel`` dials with this process's certificate and trusts only the CA — so a
service's clients (a manager's worker sessions, a worker's agent pulls) need no change, and
``registry.connect`` dials an ``https://`` etcd endpoint the same way; the
HTTP endpoints (``/metrics``, ``/healthz``, the agent's data path) serve HTTPS with the same
rule. Without it, nothing changes. A peer without a certificate from the CA fails the handshake (UNAVAILABLE).

A client dialing a peer of a given role (``rpc.channel(peer_role=)``, the data path's
``RangeFetcher``) checks that the server's certificate names that role as the DNS name
``<role>.role.rlharvest`` (``authorization.role_name``); a certificate that lacks it is refused
in the handshake. ``configure`` logs which role names the process's certificate lacks.

``issue_certificates`` makes a throwaway CA and per-service certificates (the ``cryptography``
library) for local stacks and tests; production brings its own PKI.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import logging
import os
import ssl
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from rlharvest.common.authorization import (
    SERVICE_ROLES,
    job_uri,
    peer_identity,
    role_name,
    role_uri,
)
from rlharvest.common.config import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsMaterial:
    cert: bytes
    key: bytes
    ca: bytes
    paths: tuple[str, str, str]  # cert, key, CA files (the ssl module loads from files)


_active: TlsMaterial | None = None


def configure(cert: str, key: str, ca: str) -> TlsMaterial | None:
    """Load this process's certificate, key and CA (all three, or none: plaintext) for every
    later server, channel and etcd client. Raises ConfigError naming the missing key or the
    unreadable file."""
    global _active
    _active = load(cert, key, ca)
    if _active is not None:
        for role in missing_role_names(_active.cert):
            log.warning(
                "the certificate %s names role %r (%s) but not the DNS name %s: peers that dial "
                "a %s check that name in the handshake and refuse this process (UNAVAILABLE, "
                "'Hostname Verification Check failed'); reissue it with %s as a DNS subject "
                "alternative name (`rlharvest up --tls` and tls.LocalCA issue it)", cert, role,
                role_uri(role), role_name(role), role, role_name(role))
    return _active


def missing_role_names(pem_certificate: bytes) -> list[str]:
    """The service roles a PEM certificate names as URIs (``urn:rlharvest:role:<role>``) but
    not as the DNS name peers check (``<role>.role.rlharvest``): one issued before clients
    checked roles. Roles no client dials (operator, metrics) are left out."""
    try:
        identity = peer_identity(pem_certificate)
    except ValueError:  # not a certificate: the handshake will say so
        return []
    served = set(SERVICE_ROLES.values())
    return [role for role in identity.roles
            if role in served and role_name(role) not in identity.names]


def load(cert: str, key: str, ca: str) -> TlsMaterial | None:
    """The one reader of PEM files: all three, or none (None). Raises ConfigError naming the
    missing key or the unreadable file."""
    given = {"tls_cert": cert, "tls_key": key, "tls_ca": ca}
    if not any(given.values()):
        return None
    missing = [k for k, v in given.items() if not v]
    if missing:
        raise ConfigError(f"mutual TLS needs tls_cert, tls_key and tls_ca; {', '.join(missing)} "
                          "not set")
    loaded = {}
    for name, path in given.items():
        try:
            loaded[name] = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{name}: cannot read {path}: {exc.strerror}") from None
    return TlsMaterial(loaded["tls_cert"], loaded["tls_key"], loaded["tls_ca"], (cert, key, ca))


def active() -> TlsMaterial | None:
    return _active


def server_credentials() -> grpc.ServerCredentials | None:
    return None if _active is None else _server_credentials(_active)


def channel_credentials() -> grpc.ChannelCredentials | None:
    """Built once per configuration: every ``rpc.channel`` of the process asks for them."""
    return None if _active is None else _channel_credentials(_active)


def server_ssl_context() -> ssl.SSLContext | None:
    """For the HTTP endpoints (metrics, health, the agent's data path): the same certificate.
    A client certificate, when presented, must be the CA's; whether one is needed is per path
    (``observability.serve_app``: all but ``/healthz``, which a kubelet probe reads without)."""
    return None if _active is None else _server_ssl_context(_active)


def client_ssl_context() -> ssl.SSLContext | None:
    """Built once per configuration (it reads the files): every weight pull asks for it."""
    return None if _active is None else client_ssl_context_for(_active)


@functools.cache
def _server_credentials(tls: TlsMaterial) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                       require_client_auth=True)


@functools.cache
def _channel_credentials(tls: TlsMaterial) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                        certificate_chain=tls.cert)


@functools.cache
def _server_ssl_context(tls: TlsMaterial) -> ssl.SSLContext:
    cert, key, ca = tls.paths
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    context.load_cert_chain(cert, key)
    context.verify_mode = ssl.CERT_OPTIONAL
    return context


@functools.cache
def client_ssl_context_for(tls: TlsMaterial) -> ssl.SSLContext:
    """An HTTPS client context for ``tls`` (not necessarily the process's identity: a local
    etcd checks its own health with its certificate)."""
    cert, key, ca = tls.paths
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    context.load_cert_chain(cert, key)
    return context


def http_scheme() -> str:
    return "http" if _active is None else "https"


# ---- a throwaway CA -----------------------------------------------------------------------------

class LocalCA:
    """A new certificate authority under ``directory`` (``ca.pem``; its key stays in memory)
    that issues certificates valid as server and client for ``hosts``, each naming its holder's
    role (``authorization.py``): as a URI, which servers read of their clients, and as the DNS
    name ``<role>.role.rlharvest``, which clients check of the servers they dial by role. For
    local stacks and tests; production brings its own PKI."""

    def __init__(self, directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                 days: int = 30) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self._hosts, self._days = directory, hosts, days
        self._now = datetime.datetime.now(datetime.timezone.utc)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlharvest local CA")])
        cert = (x509.CertificateBuilder().subject_name(self._name).issuer_name(self._name)
                .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(self._now)
                .not_valid_after(self._now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(_key_usage(signs_certificates=True), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(
                    self._key.public_key()), critical=False)
                .sign(self._key, hashes.SHA256()))
        self.ca_path = directory / "ca.pem"
        self.ca_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, role: str, jobs: Sequence[str] = ()) -> tuple[Path, Path]:
        """``<name>.pem`` and ``<name>.key`` under the CA's directory, for a holder of
        ``role`` acting for ``jobs`` (a trainer's: its job; ``*`` for every job)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        sans: list[x509.GeneralName] = []
        for host in self._hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        sans.append(x509.DNSName(role_name(role)))  # what a client dialing a `role` checks
        sans.append(x509.UniformResourceIdentifier(role_uri(role)))
        sans += [x509.UniformResourceIdentifier(job_uri(job)) for job in jobs]
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self._name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(self._now)
                .not_valid_after(self._now + datetime.timedelta(days=self._days))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                # What strict verifiers (Python 3.13's default VERIFY_X509_STRICT) require.
                .add_extension(_key_usage(signs_certificates=False), critical=True)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    self._key.public_key()), critical=False)
                .sign(self._key, hashes.SHA256()))
        cert_path, key_path = self.directory / f"{name}.pem", self.directory / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        # Created 0600: the key is never readable by others, not even between write and chmod.
        descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(key.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
        return cert_path, key_path

    def flags(self, name: str, role: str, jobs: Sequence[str] = ()) -> list[str]:
        """The flags that give a service ``name`` its certificate (issued now) and the CA."""
        return self.flags_of(*self.issue(name, role, jobs))

    def flags_of(self, cert: Path, key: Path) -> list[str]:
        """The flags that give a process this certificate (issued before) and the CA."""
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(self.ca_path)]


def _key_usage(signs_certificates: bool):
    """A CA key signs certificates; a service's key signs handshakes and agrees keys (EC)."""
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=not signs_certificates, content_commitment=False,
        key_encipherment=False, data_encipherment=False,
        key_agreement=not signs_certificates, key_cert_sign=signs_certificates,
        crl_sign=signs_certificates, encipher_only=False, decipher_only=False)


def issue_certificates(directory: Path, names: list[str],
                       hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                       days: int = 30,
                       roles: Mapping[str, str] | None = None) -> dict[str, tuple[Path, Path]]:
    """A new CA (``ca.pem``) under ``directory`` and, per name, a certificate and key it signs
    naming its holder's role (``roles[name]``, else the name itself). Returns name -> (cert,
    key)."""
    ca = LocalCA(directory, hosts, days)
    return {name: ca.issue(name, (roles or {}).get(name, name)) for name in names}
