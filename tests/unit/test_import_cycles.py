"""The package's modules import each other without a cycle, counting imports inside functions
and under TYPE_CHECKING too (tools/import_cycles.py draws the graph from the source)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("import_cycles",
                                                  ROOT / "tools" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_import_cycle() -> None:
    tool = _tool()
    edges = tool.edges(ROOT, "rlharvest")
    assert len(edges) > 500  # the graph was drawn: the package's own imports were found
    found = tool.cycles(edges, {tool.MODULE, tool.FUNCTION, tool.TYPE_CHECKING})
    assert not found, [component for component, _ in found]


def test_the_tool_finds_a_cycle_through_a_function_level_import(tmp_path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import x\n")
    tool = _tool()
    found = tool.cycles(tool.edges(tmp_path, "pkg"), {tool.MODULE, tool.FUNCTION})
    assert [component for component, _ in found] == [["pkg.a", "pkg.b"]]
