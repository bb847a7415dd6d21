"""Each service's flag table in the docs is generated from its config model, so it cannot
drift: every field is a row, every service page carries the marker, an unknown service fails."""

from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field, SecretStr

from rlharvest.common.cli import describe_flags, flag_rows
from rlharvest.common.config import ServiceConfig
from tools import docs_flags

ROOT = Path(__file__).resolve().parents[2]


class DemoConfig(ServiceConfig):
    max_running: int = Field(64, description="concurrently executing requests")
    kind: Literal["dedicated", "spot"] = "dedicated"
    worker_id: str = Field(default_factory=lambda: "host-123")
    token: SecretStr = SecretStr("hunter2")


def test_flag_rows_give_flag_env_type_default_and_description_per_field():
    rows = {r.flag: r for r in flag_rows(DemoConfig)}
    assert list(rows) == ["--" + name.replace("_", "-") for name in DemoConfig.model_fields]
    row = rows["--max-running"]
    assert (row.env, row.type, row.default, row.description) == (
        "RLH_MAX_RUNNING", "int", "64", "concurrently executing requests")
    assert rows["--kind"].type == "dedicated | spot"


def test_flag_rows_never_show_a_secret_or_a_per_process_default():
    rows = {r.flag: r for r in flag_rows(DemoConfig)}
    assert rows["--token"].type == "secret" and "hunter2" not in rows["--token"].default
    assert rows["--worker-id"].default == "<generated>"
    assert "hunter2" not in describe_flags(DemoConfig)


@pytest.mark.parametrize("service", docs_flags.services())
def test_every_field_of_a_service_config_is_a_row_of_its_table(service):
    model = docs_flags.config_model(service)
    table = docs_flags.flags_table(service)
    for name in model.model_fields:
        assert f"| `--{name.replace('_', '-')}` | `RLH_{name.upper()}` |" in table


def test_every_service_has_a_page_with_its_flags_marker():
    pages = {p.read_text(): p for p in (ROOT / "docs" / "services").glob("*.md")}
    for service in docs_flags.services():
        marker = f"<!-- flags: {service} -->"
        assert any(marker in text for text in pages), f"no docs/services page has {marker}"


def test_the_marker_becomes_the_table():
    out = docs_flags.expand("# Trainer\n\n<!-- flags: trainer -->\n")
    assert "<!--" not in out and "| `--checkpoint-dir` |" in out


def test_a_marker_naming_no_service_fails_the_build():
    with pytest.raises(docs_flags.UnknownService, match="not_a_service"):
        docs_flags.expand("<!-- flags: not_a_service -->")


def test_the_etcd_keys_marker_becomes_the_layout_keys_py_documents():
    out = docs_flags.expand("<!-- etcd-keys -->")
    assert out.startswith("```") and "/rlharvest/v1/members/<service>/<member_id>" in out
