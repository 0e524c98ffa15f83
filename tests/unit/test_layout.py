"""The shape of the package: imports flow one way, and no class or function grows past what a
newcomer can read (docs/architecture.md, "Layout")."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import nanguard

PACKAGE = pathlib.Path(nanguard.__file__).parent
MAX_CLASS_LINES = 260
MAX_FUNCTION_LINES = 55


def imported_in_fresh_interpreter(modules: list[str]) -> set[str]:
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
            "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_the_rank_side_never_imports_prometheus_client_nor_the_coordinator():
    loaded = imported_in_fresh_interpreter(
        ["nanguard", "nanguard.rank.guard", "nanguard.replay", "nanguard.client", "nanguard.incident"])
    assert "torch" in loaded
    assert "prometheus_client" not in loaded
    assert not any(name.startswith("nanguard.coordinator") for name in loaded)


def test_no_class_or_function_outgrows_a_reading():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"
                                f" ({node.end_lineno - node.lineno + 1} lines)")
    assert not too_long, "split these: " + ", ".join(too_long)
