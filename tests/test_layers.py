"""The packages form layers: no import cycle between ServePlan's parts, lazy imports included.

A part is a subpackage (engine.core, engine.model, planner.sim, ...) or a top-level module
(engine.config, planner.costmodel, ...). An import inside a function counts too: deferring an
import hides a cycle from the interpreter, not from the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "planner", "hwprofiles", "dashboard")


def _part(module: str) -> str | None:
    """'engine.model.attention' -> 'engine.model'; 'engine.config' -> 'engine.config'."""
    pieces = module.split(".")
    if pieces[0] not in PACKAGES:
        return None
    return ".".join(pieces[:2]) if len(pieces) > 1 else pieces[0]


def _module_of(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from engine import kernels`
    return found


def part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            module = _module_of(path)
            source = _part(module)
            assert source is not None
            edges = graph.setdefault(source, set())
            for imported in _imports(path, module):
                target = _part(imported)
                if target is not None and target != source and (ROOT / Path(*target.split("."))).with_suffix(".py").exists() | (
                        ROOT / Path(*target.split("."))).is_dir():
                    edges.add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_parts_are_found() -> None:
    graph = part_graph()
    assert {"engine.core", "engine.model", "engine.kernels", "engine.quant", "planner.sim", "planner.costmodel"} <= set(graph)
    assert "engine.core" in graph["planner.sim"]


def test_no_import_cycle_between_parts() -> None:
    cycle = _cycle(part_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
