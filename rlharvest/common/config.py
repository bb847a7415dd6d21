"""Service configuration: one pydantic-settings model per service.

Precedence, highest first: command-line flags, ``RLH_`` environment variables, a TOML or YAML
file, the model's defaults. Unknown keys and bad values are errors that name the key, so a typo in
a config file never silently falls back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, TypeVar, get_args, get_origin

from pydantic import Field, Secret, SecretBytes, SecretStr, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

ENV_PREFIX = "RLH_"


class ConfigError(ValueError):
    """A configuration the service refuses to start with; the message names every bad key."""


class ServiceConfig(BaseSettings):
    """Base of every service's config. Subclasses add fields; the loading rules live here."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # Mutual TLS for the service's gRPC server and every channel it opens (rlharvest/common/tls.py):
    # all three PEM files, or none (plaintext).
    tls_cert: str = Field("", description="PEM certificate of this service (mutual TLS)")
    tls_key: str = Field("", description="PEM private key of tls_cert")
    tls_ca: str = Field("", description="PEM CA: peers must present a certificate it signed")
    # etcd's own authentication (its auth enabled): both or neither; the password best from
    # the environment (RLH_ETCD_PASSWORD).
    etcd_username: str = Field("", description="etcd user (etcd auth enabled)")
    etcd_password: SecretStr = Field(SecretStr(""), description="etcd password of "
                                     "etcd_username (RLH_ETCD_PASSWORD keeps it off the command "
                                     "line; never logged nor exported)")
    etcd_token_renew_s: float = Field(30.0, gt=0, description="etcd auth: how often a fresh "
                                      "token is fetched (etcd forgets its tokens when it "
                                      "restarts; calls fail until the next renewal)")

    @model_validator(mode="after")
    def _credentials_complete(self) -> "ServiceConfig":
        given = {k: bool(getattr(self, k)) for k in ("tls_cert", "tls_key", "tls_ca")}
        if any(given.values()) and not all(given.values()):
            missing = ", ".join(k for k, v in given.items() if not v)
            raise ValueError(f"mutual TLS needs tls_cert, tls_key and tls_ca; {missing} not set")
        if bool(self.etcd_username) != bool(self.etcd_password.get_secret_value()):
            raise ValueError("etcd authentication needs etcd_username and etcd_password both")
        return self

    # Set by load_config for the duration of one load; pydantic-settings reads it in the hook below.
    _config_file: ClassVar[Path | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = cls._config_file
        if path is not None:
            if path.suffix == ".toml":
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
            else:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


Config = TypeVar("Config", bound=ServiceConfig)


def load_config(model: type[Config], config_file: str | Path | None = None,
                flags: dict[str, Any] | None = None) -> Config:
    """Build ``model`` from flags > RLH_ environment > file > defaults, or raise ConfigError."""
    path = Path(config_file) if config_file else None
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        if path.suffix not in (".toml", ".yaml", ".yml"):
            raise ConfigError(f"config file {path}: use a .toml, .yaml or .yml file")
    model._config_file = path
    try:
        return model(**(flags or {}))
    except ValidationError as exc:
        raise ConfigError(_describe(model, path, exc)) from None
    except ValueError as exc:  # a file that does not parse
        raise ConfigError(f"config file {path}: {exc}") from None
    finally:
        model._config_file = None


def _describe(model: type[ServiceConfig], path: Path | None, exc: ValidationError) -> str:
    lines = [f"invalid {model.__name__}" + (f" (file {path})" if path else "") + ":"]
    secrets = _secret_fields(model)
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(model.model_fields))
            lines.append(f"  {key}: unknown key (known keys: {known})")
        elif not err["loc"]:  # a check across several keys: the message names them
            lines.append(f"  {err['msg']}")
        else:
            given = err.get("input")
            # A secret's value (say a YAML password that parsed as a number) must not reach a
            # log or a terminal; its type is enough to see what went wrong.
            secret = err["loc"][0] in secrets
            shown = f"a secret of type {type(given).__name__}, not shown" if secret else repr(given)
            lines.append(f"  {key}: {err['msg']} (got {shown}; env {ENV_PREFIX}{key.upper()})")
    return "\n".join(lines)


def _secret_fields(model: type[ServiceConfig]) -> set[str]:
    """Fields declared as pydantic secrets (``SecretStr``, ``SecretBytes``, ``Secret[...]``),
    also inside ``Optional``/unions: their values are never shown."""
    return {name for name, field in model.model_fields.items() if _is_secret(field.annotation)}


def _is_secret(annotation: Any) -> bool:
    kind = get_origin(annotation) or annotation
    if isinstance(kind, type) and issubclass(kind, (SecretStr, SecretBytes, Secret)):
        return True
    return any(_is_secret(arg) for arg in get_args(annotation))
