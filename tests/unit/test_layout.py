"""The shape of the package: no class or function grows past what a newcomer can read
(docs/architecture.md, "Layout"). That imports flow one way (the rank side imports neither the
coordinator nor prometheus_client, among others) is the contracts of .importlinter, which
tests/unit/test_imports.py runs."""

from __future__ import annotations

import ast
import pathlib

import nanguard

PACKAGE = pathlib.Path(nanguard.__file__).parent
MAX_CLASS_LINES = 260
MAX_FUNCTION_LINES = 55
MAX_FILE_LINES = 500


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


def test_no_module_outgrows_a_reading():
    """A module past ~500 lines holds more than one job: split it where there is a seam."""
    too_long = [f"{path.relative_to(PACKAGE)} ({count} lines)" for path in sorted(PACKAGE.rglob("*.py"))
                if (count := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not too_long, "split these: " + ", ".join(too_long)
