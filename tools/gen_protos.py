"""Regenerates rlharvest/common/pb from protos/ (run by `make protos`; tests/unit/test_protos.py checks it).

protoc writes imports as `from rlharvest.v1 import x_pb2`; the generated modules live in
`rlharvest.common.pb`, so the imports are rewritten. The output is deterministic.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc
import grpc_tools

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "rlharvest" / "common" / "pb"


def generate(out_dir: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                          f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *protos])
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted((Path(tmp) / "rlharvest" / "v1").iterdir()):
            text = re.sub(r"from rlharvest\.v1 import", "from rlharvest.common.pb import", path.read_text())
            (out_dir / path.name).write_text(text)
    (out_dir / "__init__.py").write_text('"""Generated from protos/ by `make protos`; do not edit."""\n')


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    if target == OUT and OUT.exists():
        shutil.rmtree(OUT)
    generate(target)
