"""Imports flow one way: the contracts of .importlinter hold (import-linter's ``lint-imports``), and
no module imports itself back through others (an import cycle inside the package)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nanguard

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(nanguard.__file__).parent


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                              os.environ.get("PATH", "")]))
    assert lint is not None, "lint-imports not found: install the test extra (pip install -e '.[test]')"
    result = subprocess.run([lint, "--config", str(REPO / ".importlinter"), "--no-cache", "--no-logo"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def run_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs: at the top of the module and inside functions alike, but
    not those under ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports (``from . import x``
    counts as importing ``x`` where ``x`` is a module, else its package)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: set[str] = set()
        for node in run_time_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
                continue
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            imported.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                            for alias in node.names)
        graph[name] = {other for other in imported if other in paths and other != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                elif successor in stack:
                    low[node] = min(low[node], index[successor])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back():
    graph = import_graph()
    assert {"nanguard.rank.decision", "nanguard.rank.diagnose"} <= graph.keys()
    assert "nanguard.rank.reading" in graph["nanguard.rank.diagnose"]  # (the graph is read at all)
    found = cycles(graph)
    assert not found, "import cycles (move the names both sides need to a module both can take): " + "; ".join(
        " <-> ".join(component) + " (" + ", ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a])
                                           if b in component) + ")" for component in found)


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
