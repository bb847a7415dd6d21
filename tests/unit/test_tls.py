"""The TLS settings every service takes (``common/tls.py``, ``common/config.py``): all three
files or none, unreadable files named, and the throwaway CA's certificates verify."""

from __future__ import annotations

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
