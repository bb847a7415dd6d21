"""How an etcd endpoint is read (``registry.parse_endpoint``, ``registry.check_endpoint``):
``host:port`` and ``http://`` are plaintext as ever, ``https://`` dials TLS, and an https
endpoint in a process without TLS settings is refused naming them."""

from __future__ import annotations

import pytest

from rlharvest.common import registry, tls
from rlharvest.common.config import ConfigError


def test_host_port_and_http_are_plaintext_and_https_is_tls():
    assert registry.parse_endpoint("10.0.0.5:2379") == registry.Endpoint("10.0.0.5", 2379)
    assert registry.parse_endpoint(":2379") == registry.Endpoint("127.0.0.1", 2379)
    assert registry.parse_endpoint("http://etcd:2379") == registry.Endpoint("etcd", 2379)
    assert registry.parse_endpoint("https://etcd:2379/") == registry.Endpoint("etcd", 2379,
                                                                               tls=True)


@pytest.mark.parametrize("endpoint", ["etcd", "https://etcd", "etcd:port", "unix://etcd:2379"])
def test_an_endpoint_without_a_port_or_with_another_scheme_is_refused(endpoint):
    with pytest.raises(ValueError, match="must look like host:port"):
        registry.parse_endpoint(endpoint)


def test_an_https_endpoint_without_tls_settings_is_refused_naming_them():
    tls.configure("", "", "")
    with pytest.raises(ConfigError, match="tls_ca .* tls_cert and tls_key"):
        registry.check_endpoint("https://etcd:2379")
    assert registry.check_endpoint("etcd:2379").tls is False
