"""Turn a service's config model into command-line flags, without repeating its fields.

Every field ``max_running`` becomes ``--max-running VALUE`` (booleans: ``--json-logs`` /
``--no-json-logs``); ``--config FILE`` names a TOML or YAML file. Unknown flags are errors that
list the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, Optional, get_args, get_origin

import typer
from pydantic import SecretBytes, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlharvest.common import service_host
from rlharvest.common.config import ENV_PREFIX, ConfigError, ServiceConfig, load_config
from rlharvest.common.observability import run_service
from rlharvest.common.service_host import ServiceSpec


def parse_flags(model: type[ServiceConfig], args: list[str]) -> dict[str, Any]:
    fields = model.model_fields
    flags: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; flags look like --name value")
        name, eq, value = arg[2:].partition("=")
        key = name.replace("-", "_")
        if key not in fields and key.startswith("no_") and key[3:] in fields and not eq:
            flags[key[3:]] = False
            i += 1
            continue
        if key not in fields:
            known = " ".join("--" + f.replace("_", "-") for f in sorted(fields))
            raise ConfigError(f"unknown flag --{name}; known flags: --config {known}")
        if not eq:
            if fields[key].annotation is bool:
                flags[key] = True
                i += 1
                continue
            if i + 1 >= len(args):
                raise ConfigError(f"flag --{name} needs a value")
            value = args[i + 1]
            i += 1
        flags[key] = value
        i += 1
    return flags


@dataclass(frozen=True)
class FlagRow:
    """One config field as an operator meets it: the flag, its environment variable, the type
    of its value, its default and what it does (``--help`` and the docs site's tables)."""

    flag: str
    env: str
    type: str
    default: str
    description: str


def flag_rows(model: type[ServiceConfig]) -> list[FlagRow]:
    """Every field of ``model`` as a ``FlagRow``, in declaration order."""
    return [FlagRow(flag="--" + name.replace("_", "-"), env=ENV_PREFIX + name.upper(),
                    type=_type_text(info.annotation), default=_default_text(info),
                    description=info.description or "")
            for name, info in model.model_fields.items()]


def _type_text(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return " | ".join(str(arg) for arg in get_args(annotation))
    if isinstance(annotation, type):
        return "secret" if issubclass(annotation, (SecretStr, SecretBytes)) else annotation.__name__
    return str(annotation).replace("typing.", "")


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "<generated>"  # per process (a host name, a pid): no one value to show
    if info.default is PydanticUndefined:
        return "<required>"
    if isinstance(info.default, (SecretStr, SecretBytes)):  # never shown, even a default
        return "''" if not info.default.get_secret_value() else "<secret>"
    return repr(info.default)


def describe_flags(model: type[ServiceConfig]) -> str:
    """Help text listing every flag with its default and description."""
    lines = []
    for row in flag_rows(model):
        text = f"  {row.flag}  (default {row.default})"
        if row.description:
            text += f"  {row.description}"
        lines.append(text)
    return "Flags (also RLH_<NAME> environment variables and --config FILE keys):\n\n" + "\n\n".join(lines)


def service_app(spec: ServiceSpec) -> typer.Typer:
    """The ``rlharvest-<service>`` command of a declared service: flags from its config model,
    ``--config FILE``, exit code 2 with a message naming the key on bad configuration, then
    the service host on uvloop (graceful SIGTERM); the exit code is the host's."""
    model = spec.config
    app = typer.Typer(add_completion=False, help=spec.doc)
    epilog = describe_flags(model)
    if spec.tools:
        epilog = ("Tools (run instead of serving; each has --help): "
                  + ", ".join(f"{spec.program} {name}" for name in spec.tools) + "\n\n" + epilog)

    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                 epilog=epilog)
    def main(ctx: typer.Context,
             config: Optional[Path] = typer.Option(None, "--config",
                                                   help="TOML or YAML config file")) -> None:
        if ctx.args and ctx.args[0] in spec.tools:
            raise typer.Exit(spec.tools[ctx.args[0]](ctx.args[1:]))
        try:
            cfg = load_config(model, config, parse_flags(model, ctx.args))
        except ConfigError as exc:
            typer.echo(f"{spec.program}: {exc}", err=True)
            raise typer.Exit(2) from None
        if service_host.launch_rank()[0] > 0:
            try:
                raise typer.Exit(service_host.follow(spec, cfg))
            except ValueError as exc:
                typer.echo(f"{spec.program}: {exc}", err=True)
                raise typer.Exit(2) from None
        raise typer.Exit(run_service(partial(service_host.serve, spec, cfg)))

    return app

