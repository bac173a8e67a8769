"""Import circles between pdd's modules: none at module level, and under `TYPE_CHECKING`
(which import-linter leaves out) none but the one named here with its reason."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pdd"

# circles that only type annotations close, each with why it is still there (none now: the
# simulator's Cluster, one class over three partial bases whose halves named it, is composed
# of its managers)
KNOWN: dict[frozenset[str], str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules: dict[str, Path], type_checking: bool) -> set[str]:
    """The pdd modules `path` imports at module level (function bodies are not: they import
    when called), with or without what it imports for type checking alone."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                if type_checking:
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                             for a in node.names)
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                    visit(block)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in modules}


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []
    counter = itertools.count()

    def strong(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
            if component:
                out.append(frozenset(component | {v}))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_circle_at_module_level_and_only_named_ones_under_type_checking() -> None:
    modules = _modules()
    for type_checking in (False, True):
        graph = {name: _imports(path, modules, type_checking) - {name} for name, path in modules.items()}
        circles = _circles(graph)
        if not type_checking:
            assert circles == [], circles
        else:
            assert set(circles) == set(KNOWN), [sorted(c) for c in circles]
