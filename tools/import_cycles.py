"""Print the import cycles of the rlharvest package, read from its source with ``ast``.

A cycle is a strongly connected component of more than one module in the graph "module A
imports module B" (only modules of the package; ``from pkg import name`` counts as importing
``pkg.name`` when that is a module, else ``pkg``). Each edge is labelled by where the import
sits: ``module`` (runs at import), ``function`` (inside a def: runs when called) or
``type-checking`` (under ``if TYPE_CHECKING:``: never runs, but still couples the two). Every
edge of a cycle is listed, so a cycle can be read (and broken) from the output alone.

    python tools/import_cycles.py [--root DIR] [--package rlharvest] [--module-level-only]

Exits 0 whether or not cycles exist: it reports, it does not judge.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

MODULE, FUNCTION, TYPE_CHECKING = "module", "function", "type-checking"


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    kind: str  # MODULE, FUNCTION or TYPE_CHECKING
    line: int


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with the kind of place it sits in (the innermost that matters:
    a def makes it FUNCTION, an ``if TYPE_CHECKING`` block TYPE_CHECKING)."""
    def walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, FUNCTION if kind == MODULE else kind)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), TYPE_CHECKING)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)

    return walk(tree, MODULE)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The dotted module a ``from ... import`` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             modules: Iterable[str]) -> Iterator[str]:
    known = set(modules)
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in known:  # import a.b.c binds a, runs a.b.c's chain
                name = name.rpartition(".")[0]
            if name:
                yield name
        return
    source = _absolute(module, is_package, node)
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        if sub in known:
            yield sub
        elif source in known:
            yield source


def edges(root: Path, package: str) -> list[Edge]:
    files = module_files(root, package)
    found: dict[Edge, None] = {}  # ordered, and one edge per statement however many names
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node, kind in _imports(tree):
            for target in _targets(node, module, is_package, files):
                if target != module:
                    found[Edge(module, target, kind, node.lineno)] = None
    return list(found)


def strongly_connected(nodes: Iterable[str], graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the package is deep enough to hit the recursion limit in
    a recursive one on some graphs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def cycles(all_edges: list[Edge], kinds: set[str]) -> list[tuple[list[str], list[Edge]]]:
    """The components of more than one module over the edges of ``kinds``, each with the edges
    that run inside it."""
    graph: dict[str, set[str]] = {}
    for edge in all_edges:
        if edge.kind in kinds:
            graph.setdefault(edge.source, set()).add(edge.target)
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})
    found = []
    for component in strongly_connected(nodes, graph):
        if len(component) > 1:
            members = set(component)
            inside = sorted((e for e in all_edges if e.kind in kinds and e.source in members
                             and e.target in members), key=lambda e: (e.source, e.line))
            found.append((component, inside))
    return sorted(found)


def loop_through(component: list[str], inside: list[Edge]) -> list[str]:
    """One shortest import loop from the component's first module back to it (BFS), so the
    output shows a cycle as a path, not only as a set."""
    start = component[0]
    graph: dict[str, list[str]] = {}
    for edge in inside:
        graph.setdefault(edge.source, []).append(edge.target)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in graph.get(node, ()):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    return [start]


def report(found: list[tuple[list[str], list[Edge]]], out=sys.stdout) -> None:
    if not found:
        print("no import cycles", file=out)
        return
    for number, (component, inside) in enumerate(found, 1):
        print(f"cycle {number}: {len(component)} modules", file=out)
        print("  loop: " + " -> ".join(loop_through(component, inside)), file=out)
        for module in component:
            print(f"  {module}", file=out)
        for edge in inside:
            print(f"    {edge.source} -> {edge.target}  [{edge.kind}, line {edge.line}]",
                  file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--package", default="rlharvest")
    parser.add_argument("--module-level-only", action="store_true",
                        help="count only imports that run at import time")
    args = parser.parse_args(argv)
    all_edges = edges(args.root, args.package)
    kinds = {MODULE} if args.module_level_only else {MODULE, FUNCTION, TYPE_CHECKING}
    print(f"{len(module_files(args.root, args.package))} modules, {len(all_edges)} import edges "
          f"inside the package; counting {', '.join(sorted(kinds))} imports")
    report(cycles(all_edges, kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
