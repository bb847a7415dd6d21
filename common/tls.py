"""Mutual TLS for every gRPC server and client of a process.

One configuration per process (``tls_cert``, ``tls_key``, ``tls_ca``: PEM files, keys of every
service's config, so flags and ``RLH_`` env like any other key). ``configure`` loads them once at
start; from then on ``rpc.bind_server`` serves TLS and requires a client certificate signed by
the CA, and ``rpc.channel`` dials with this process's certificate and trusts only the CA — so a
service's clients (a manager's worker sessions, a worker's agent pulls) need no change. Without
it, nothing changes. A peer without a certificate from the CA fails the handshake (UNAVAILABLE).

``issue_certificates`` makes a throwaway CA and per-service certificates (the ``cryptography``
library) for local stacks and tests; production brings its own PKI.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

from rlharvest.common.config import ConfigError


@dataclass(frozen=True)
class TlsMaterial:
    cert: bytes
    key: bytes
    ca: bytes


_active: TlsMaterial | None = None


def configure(cert: str, key: str, ca: str) -> TlsMaterial | None:
    """Load this process's certificate, key and CA (all three, or none: plaintext). Raises
    ConfigError naming the missing key or the unreadable file."""
    global _active
    given = {"tls_cert": cert, "tls_key": key, "tls_ca": ca}
    if not any(given.values()):
        _active = None
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
    _active = TlsMaterial(loaded["tls_cert"], loaded["tls_key"], loaded["tls_ca"])
    return _active


def active() -> TlsMaterial | None:
    return _active


def server_credentials() -> grpc.ServerCredentials | None:
    if _active is None:
        return None
    return grpc.ssl_server_credentials([(_active.key, _active.cert)],
                                       root_certificates=_active.ca, require_client_auth=True)


def channel_credentials() -> grpc.ChannelCredentials | None:
    if _active is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_active.ca, private_key=_active.key,
                                        certificate_chain=_active.cert)


# ---- a throwaway CA -----------------------------------------------------------------------------

def issue_certificates(directory: Path, names: list[str],
                       hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                       days: int = 30) -> dict[str, tuple[Path, Path]]:
    """A new CA (``ca.pem``) under ``directory`` and, per name, a certificate and key
    (``<name>.pem``, ``<name>.key``) it signs, valid as server and client for ``hosts``. Returns
    name -> (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlharvest local CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    (directory / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    issued = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_path.chmod(0o600)
        issued[name] = (cert_path, key_path)
    return issued
