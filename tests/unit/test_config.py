"""Config precedence (flags > RLH_ env > file > defaults) and errors that name the key."""

from pathlib import Path

import pytest
from pydantic import Field, SecretStr

from rlharvest.common.cli import parse_flags
from rlharvest.common.config import ConfigError, ServiceConfig, load_config
from rlharvest.services.rollout_worker.config import WorkerConfig


class DemoConfig(ServiceConfig):
    port: int = Field(50051, gt=0, lt=65536)
    name: str = "default"
    verbose: bool = False


def test_defaults_apply_without_file_env_or_flags(monkeypatch):
    monkeypatch.delenv("RLH_PORT", raising=False)
    cfg = load_config(DemoConfig)
    assert (cfg.port, cfg.name, cfg.verbose) == (50051, "default", False)


@pytest.mark.parametrize("suffix,text", [(".toml", 'port = 7000\nname = "file"\n'),
                                         (".yaml", "port: 7000\nname: file\n")])
def test_precedence_flags_over_env_over_file(tmp_path: Path, monkeypatch, suffix, text):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    assert load_config(DemoConfig, path).name == "file"
    monkeypatch.setenv("RLH_NAME", "env")
    cfg = load_config(DemoConfig, path)
    assert (cfg.name, cfg.port) == ("env", 7000)
    assert load_config(DemoConfig, path, {"name": "flag"}).name == "flag"


def test_unknown_file_key_is_named(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text("prot = 7000\n")
    with pytest.raises(ConfigError, match=r"prot: unknown key"):
        load_config(DemoConfig, path)


def test_bad_env_value_names_key_and_variable(monkeypatch):
    monkeypatch.setenv("RLH_PORT", "seventy")
    with pytest.raises(ConfigError, match=r"port: .*valid integer.*RLH_PORT"):
        load_config(DemoConfig)


def test_out_of_range_flag_is_refused():
    with pytest.raises(ConfigError, match=r"port: Input should be greater than 0"):
        load_config(DemoConfig, flags={"port": "-1"})


def test_malformed_file_is_a_config_error(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text("port = = 3\n")
    with pytest.raises(ConfigError, match=str(path)):
        load_config(DemoConfig, path)


def test_missing_file_and_unknown_suffix(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(DemoConfig, tmp_path / "nope.toml")
    other = tmp_path / "c.ini"
    other.write_text("")
    with pytest.raises(ConfigError, match=r"\.toml, \.yaml"):
        load_config(DemoConfig, other)


def test_flags_parse_from_field_names():
    flags = parse_flags(DemoConfig, ["--port", "9", "--name=x", "--verbose"])
    assert flags == {"port": "9", "name": "x", "verbose": True}
    assert parse_flags(DemoConfig, ["--no-verbose"]) == {"verbose": False}
    with pytest.raises(ConfigError, match=r"unknown flag --prot; known flags: .*--port"):
        parse_flags(DemoConfig, ["--prot", "9"])
    with pytest.raises(ConfigError, match="needs a value"):
        parse_flags(DemoConfig, ["--port"])


def test_worker_config_validates_its_fields():
    with pytest.raises(ConfigError, match="max_running"):
        load_config(WorkerConfig, flags={"max_running": "0"})
    with pytest.raises(ConfigError, match="kind"):
        load_config(WorkerConfig, flags={"kind": "preemptible"})
    assert load_config(WorkerConfig, flags={"kind": "spot"}).kind == "spot"


def test_a_seed_kind_worker_under_tls_is_refused_saying_the_seed_engine_is_the_trainers():
    tls = {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_ca": "ca.pem"}
    with pytest.raises(ConfigError, match="--kind seed under TLS.*--seed-role"):
        load_config(WorkerConfig, flags={"kind": "seed", **tls})
    assert load_config(WorkerConfig, flags={"kind": "spot", **tls}).kind == "spot"
    assert load_config(WorkerConfig, flags={"kind": "seed"}).kind == "seed"  # no TLS: as before


class TokenConfig(ServiceConfig):
    api_token: SecretStr | None = None


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "etcd_username: alice\netcd_password: 904512377\n"),
    (".toml", 'etcd_username = "alice"\netcd_password = 904512377\n')])
def test_a_bad_etcd_password_is_named_but_never_shown(tmp_path: Path, suffix, text):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(ServiceConfig, path)
    message = str(raised.value)
    assert "904512377" not in message
    assert "etcd_password" in message and "RLH_ETCD_PASSWORD" in message


def test_a_secret_field_a_service_declares_is_never_shown_in_errors():
    with pytest.raises(ConfigError, match=r"api_token: .*secret of type list, not shown") as raised:
        load_config(TokenConfig, flags={"api_token": ["s3cr3t-value"]})
    assert "s3cr3t-value" not in str(raised.value)

