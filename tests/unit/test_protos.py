"""The committed generated code is what `make protos` produces from protos/ today."""

import filecmp
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "tools" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_not_stale(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    _load_generator().generate(tmp_path)
    committed = ROOT / "rlharvest" / "common" / "pb"
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == sorted(p.name for p in committed.iterdir() if p.name != "__pycache__"), \
        "generated file set differs: run `make protos`"
    for name in fresh:
        assert filecmp.cmp(tmp_path / name, committed / name, shallow=False), \
            f"rlharvest/common/pb/{name} is stale: run `make protos` and commit the result"


def test_every_proto_has_generated_modules():
    for proto in (ROOT / "protos").rglob("*.proto"):
        assert (ROOT / "rlharvest" / "common" / "pb" / f"{proto.stem}_pb2.py").is_file(), proto
