"""MkDocs hook: a service page's flag table, generated from the service's config model.

Also ``<!-- etcd-keys -->``: the etcd key layout as ``rlharvest/common/keys.py`` documents it.

A page writes ``<!-- flags: rollout_worker -->`` where the table goes; the build imports
``rlharvest.services.rollout_worker.config``, takes the ``ServiceConfig`` subclass that module
defines and replaces the marker with one row per field (``rlharvest.common.cli.flag_rows``, the
rows ``--help`` prints). A marker naming no service fails the build, so a renamed service
cannot leave a page without its table. Wired in ``mkdocs.yml`` (``hooks:``).
"""

from __future__ import annotations

import html
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout, as for `python -m rlharvest...`
    sys.path.insert(0, str(ROOT))

from rlharvest.common.cli import flag_rows  # noqa: E402
from rlharvest.common.config import ServiceConfig  # noqa: E402

MARKER = re.compile(r"<!--\s*flags:\s*([A-Za-z0-9_]+)\s*-->")
KEYS_MARKER = "<!-- etcd-keys -->"


class UnknownService(Exception):
    """A flags marker names no package under rlharvest/services/ with a config model."""


def services() -> list[str]:
    """The services that have a config model: rlharvest/services/<name>/config.py."""
    return sorted(p.parent.name for p in (ROOT / "rlharvest" / "services").glob("*/config.py"))


def config_model(service: str) -> type[ServiceConfig]:
    if service not in services():
        raise UnknownService(f"flags marker names {service!r}, not a service "
                             f"(known: {', '.join(services())})")
    module = importlib.import_module(f"rlharvest.services.{service}.config")
    models = [v for v in vars(module).values()
              if isinstance(v, type) and issubclass(v, ServiceConfig)
              and v.__module__ == module.__name__]
    if len(models) != 1:
        raise UnknownService(f"rlharvest/services/{service}/config.py defines "
                             f"{len(models)} ServiceConfig models, not one")
    return models[0]


def _cell(text: str) -> str:
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return "`" + text.replace("`", "'") + "`"


def flags_table(service: str) -> str:
    model = config_model(service)
    lines = [f"Every key of `{model.__name__}` "
             f"(`rlharvest/services/{service}/config.py`), generated from the model at build "
             "time. Precedence: flag, then `RLH_` environment variable, then "
             "`--config FILE` (TOML or YAML, the key as in the first column without `--`, "
             "dashes as underscores), then the default.",
             "",
             "| flag | environment | type | default | description |",
             "| --- | --- | --- | --- | --- |"]
    for row in flag_rows(model):
        kind = " or ".join(_code(t) for t in row.type.split(" | "))
        lines.append(f"| {_code(row.flag)} | {_code(row.env)} | {kind} | "
                     f"{_code(row.default)} | {_cell(row.description)} |")
    return "\n".join(lines) + "\n"


def etcd_keys() -> str:
    """The key layout block of ``rlharvest/common/keys.py``'s docstring, as a code block."""
    from rlharvest.common import keys

    layout = [line for line in (keys.__doc__ or "").splitlines()[1:] if line.strip()]
    return "```\n" + "\n".join(layout) + "\n```\n"


def expand(markdown: str) -> str:
    if KEYS_MARKER in markdown:
        markdown = markdown.replace(KEYS_MARKER, etcd_keys())
    return MARKER.sub(lambda m: flags_table(m.group(1)), markdown)


def on_page_markdown(markdown: str, **_: object) -> str:
    try:
        return expand(markdown)
    except UnknownService as exc:
        from mkdocs.exceptions import PluginError

        raise PluginError(str(exc)) from None
