"""The TLS settings every service takes (``rlharvest/common/tls.py``, ``rlharvest/common/config.py``): all three
files or none, unreadable files named, and the throwaway CA's certificates verify and name
their role as the DNS name clients check (a certificate without it is named at start)."""

from __future__ import annotations

import logging

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from rlharvest.common import tls
from rlharvest.common.config import ConfigError, load_config
from rlharvest.services.rollout_manager.config import ManagerConfig


@pytest.fixture(autouse=True)
def plaintext_after():
    yield
    tls.configure("", "", "")


def test_a_config_with_part_of_the_tls_settings_is_refused_naming_the_missing_keys():
    with pytest.raises(ConfigError, match="tls_key, tls_ca not set"):
        load_config(ManagerConfig, flags={"tls_cert": "c.pem"})
    assert load_config(ManagerConfig).tls_cert == ""  # none: plaintext


def test_an_unreadable_file_is_named(tmp_path):
    (tmp_path / "c.pem").write_text("x")
    with pytest.raises(ConfigError, match="tls_key: cannot read"):
        tls.configure(str(tmp_path / "c.pem"), str(tmp_path / "missing.key"),
                      str(tmp_path / "c.pem"))
    assert tls.active() is None


def test_the_local_ca_signs_certificates_valid_for_the_local_hosts(tmp_path):
    issued = tls.issue_certificates(tmp_path, ["manager", "worker"])
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    for name, (cert_path, key_path) in issued.items():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        assert cert.issuer == ca.subject
        public = ca.public_key()
        assert isinstance(public, ec.EllipticCurvePublicKey)
        public.verify(cert.signature, cert.tbs_certificate_bytes,
                      ec.ECDSA(cert.signature_hash_algorithm))
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "localhost" in sans.get_values_for_type(x509.DNSName)
        assert oct(key_path.stat().st_mode & 0o777) == "0o600"
    material = tls.configure(str(issued["manager"][0]), str(issued["manager"][1]),
                             str(tmp_path / "ca.pem"))
    assert material is not None and tls.server_credentials() is not None
    assert tls.channel_credentials() is not None


def test_issued_certificates_name_their_role_as_the_dns_name_clients_check(tmp_path):
    ca = tls.LocalCA(tmp_path)
    for name, role in (("a0", "agent"), ("w0", "worker"), ("op", "operator")):
        cert_path, _ = ca.issue(name, role)
        pem = cert_path.read_bytes()
        sans = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
        assert f"{role}.role.rlharvest" in sans.get_values_for_type(x509.DNSName)
        assert "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
        assert f"urn:rlharvest:role:{role}" in sans.get_values_for_type(
            x509.UniformResourceIdentifier)
        assert tls.missing_role_names(pem) == []


def _certificate_without_role_names(tmp_path, roles: list[str]) -> tuple[str, str]:
    """A certificate as issued before clients checked roles: role URIs, no role DNS names."""
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old")])
    now = datetime.datetime.now(datetime.timezone.utc)
    sans = [x509.DNSName("localhost"),
            *(x509.UniformResourceIdentifier(f"urn:rlharvest:role:{r}") for r in roles)]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "old.pem", tmp_path / "old.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_a_certificate_issued_before_role_names_is_named_with_how_to_reissue_it(
        tmp_path, caplog):
    cert, key = _certificate_without_role_names(tmp_path, ["agent", "operator"])
    assert tls.missing_role_names((tmp_path / "old.pem").read_bytes()) == ["agent"]
    with caplog.at_level(logging.WARNING, logger="rlharvest.common.tls"):
        assert tls.configure(cert, key, cert) is not None
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "agent.role.rlharvest" in said and "reissue" in said, said
    assert "operator.role" not in said  # no client dials an operator: its name is not needed
