"""Which tier a test is in, read from its code (tests/conftest.py applies the markers).

- ``processes``: the test starts a process: it uses ``subprocess``, ``multiprocessing`` or
  ``os.fork``/``os.system``/``os.posix_spawn``, in its own code, in a fixture it uses, or in a
  function or class of tests/ that it refers to, at any depth (the ``torchrun`` and ``coordinator``
  fixtures are such fixtures); and everything in tests/integration.
- ``realworld``: the test needs a third-party framework: it lives in tests/realworld, or its module,
  its code or a fixture it uses imports (or ``pytest.importorskip``\\ s) transformers, timm,
  lightning or accelerate.
- ``deploy``: the test checks deploy/ with its own tools: the modules in ``DEPLOY_MODULES``, and
  every test that uses the ``tool`` fixture (promtool, alertmanager, shellcheck, hadolint...).
- ``slow``: seconds a test: its code (as above) calls ``torch.compile`` or a module's ``.compile``,
  makes a process group (``init_process_group``: the ``gloo`` fixture), or is a hypothesis
  property (``@given``: hundreds of examples); or it is marked so by hand (the tests/integration
  modules are).

A test that starts a process without being marked ``processes`` fails (``ProcessWatch``): the rule
reads code, so a process started from nanguard's own code, say, needs ``@pytest.mark.processes``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import multiprocessing.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TIERS = ("processes", "realworld", "deploy", "slow")
TESTS = Path(__file__).resolve().parent
DEPLOY_MODULES = {"test_deploy_prometheus.py", "test_docker.py", "test_k8s.py", "test_slurm.py"}
DEPLOY_FIXTURES = {"tool"}
FRAMEWORKS = {"transformers", "timm", "lightning", "pytorch_lightning", "accelerate"}
_SPAWN_MODULES = {"subprocess", "multiprocessing"}
_SPAWN_CALLS = {"os.fork", "os.forkpty", "os.system", "os.popen", "os.posix_spawn", "os.posix_spawnp",
                "os.spawnv", "os.spawnve", "os.spawnl", "os.spawnle", "torch.multiprocessing", "mp.spawn"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def spawns(node: ast.AST) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        return any(name.split(".")[0] in _SPAWN_MODULES for name in names)
    name = _dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
    return name is not None and (name.split(".")[0] in _SPAWN_MODULES or name.split(".")[-1] == "Popen"
                                 or any(name == c or name.startswith(c + ".") for c in _SPAWN_CALLS))


def needs_framework(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] in FRAMEWORKS for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] in FRAMEWORKS
    return (isinstance(node, ast.Call) and (_dotted(node.func) or "").endswith("importorskip")
            and bool(node.args) and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).split(".")[0] in FRAMEWORKS)


def takes_seconds(node: ast.AST) -> bool:
    """torch.compile (or a module's .compile), a gloo process group, hypothesis's hundreds of examples:
    seconds each."""
    name = _dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
    return name is not None and (name in ("given", "hypothesis.given") or name.endswith("init_process_group")
                                 or (name.endswith(".compile") and not name.startswith("re.")))


SIGNS = {"processes": spawns, "realworld": needs_framework, "slow": takes_seconds}
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@functools.cache
def _tree(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(), path)


@functools.cache
def _file_signs(path: str) -> frozenset[str]:
    """The signs in a module's own statements, outside its functions and classes."""
    body = [stmt for stmt in _tree(path).body if not isinstance(stmt, _DEFS)]
    return frozenset(tier for tier, sign in SIGNS.items() for stmt in body for node in ast.walk(stmt) if sign(node))


def file_tiers(path: Path) -> set[str]:
    """The tiers every test of the module at ``path`` is in, read without importing it."""
    return set(_file_tiers(str(path)))


@functools.cache
def _file_tiers(name: str) -> frozenset[str]:
    path = Path(name).resolve()
    found = _file_signs(str(path)) & {"realworld"}
    if path.is_relative_to(TESTS / "integration"):
        found |= {"processes"}
    if path.is_relative_to(TESTS / "realworld"):
        found |= {"realworld"}
    if path.name in DEPLOY_MODULES:
        found |= {"deploy"}
    return found


def _namespace(obj: object) -> dict:
    """The globals ``obj``'s code runs in (a conftest's module is not ``sys.modules[obj.__module__]``:
    every conftest is a module ``conftest``)."""
    if inspect.isclass(obj):
        functions = [inspect.unwrap(getattr(v, "__func__", v)) for v in vars(obj).values()]
        obj = next((f for f in functions if inspect.isfunction(f)), None)
    if inspect.isfunction(obj):
        return obj.__globals__
    return getattr(sys.modules.get(getattr(obj, "__module__", None) or ""), "__dict__", {})


def _code_of(obj: object) -> tuple[object, str, str] | None:
    """``(obj, its file, its qualname)`` for a function or class of tests/, else None."""
    obj = getattr(obj, "__func__", obj)  # a method, classmethod or staticmethod
    obj = getattr(getattr(obj, "hypothesis", None), "inner_test", obj)  # what @given wraps
    if inspect.isfunction(obj):
        obj = inspect.unwrap(obj)
        path = obj.__code__.co_filename
    elif inspect.isclass(obj):
        path = _namespace(obj).get("__file__")
    else:
        return None
    qualname = getattr(obj, "__qualname__", "")
    if not isinstance(path, str) or not path.startswith(str(TESTS) + os.sep) or "<locals>" in qualname:
        return None
    return obj, path, qualname


def _node(path: str, qualname: str) -> ast.AST | None:
    """The def or class ``qualname`` (``A.b``) of the module at ``path``."""
    node: ast.AST | None = _tree(path)
    for part in qualname.split("."):
        node = next((c for c in ast.iter_child_nodes(node) if isinstance(c, _DEFS) and c.name == part), None)
        if node is None:
            return None
    return node


def _owner(namespace: dict, qualname: str) -> type | None:
    *classes, _ = qualname.split(".")
    obj = namespace.get(classes[0]) if classes else None
    for part in classes[1:]:
        obj = getattr(obj, part, None)
    return obj if inspect.isclass(obj) else None


def _referenced(name: str, namespace: dict, owner: type | None) -> object:
    """What ``name`` (``a``, ``a.b``) in code run in ``namespace`` refers to (``self.x``: the owner class's)."""
    root, *rest = name.split(".")
    obj = owner if root in ("self", "cls") and owner is not None else namespace.get(root)
    for attr in rest:
        obj = inspect.getattr_static(obj, attr, None) if obj is not None else None
    return obj


class Reader:
    """The signs (``SIGNS``) that functions and classes of tests/ show, in their own code or in the
    code of the functions and classes of tests/ that they refer to, at any depth."""

    def __init__(self):
        self._parts: dict[tuple[str, str], tuple[frozenset[str], list[tuple[object, str, str]]]] = {}

    def signs(self, *objects: object) -> set[str]:
        found: set[str] = set()
        seen: set[tuple[str, str]] = set()
        todo = [code for code in map(_code_of, objects) if code is not None]
        while todo:
            obj, path, qualname = todo.pop()
            if (path, qualname) not in seen:
                seen.add((path, qualname))
                own, refs = self._read(obj, path, qualname)
                found |= own
                todo.extend(refs)
        return found

    def _read(self, obj: object, path: str, qualname: str) -> tuple[frozenset[str], list[tuple[object, str, str]]]:
        """The signs in ``obj``'s own code, and the functions and classes of tests/ that its code names."""
        if (path, qualname) not in self._parts:
            node = _node(path, qualname)
            namespace = _namespace(obj)
            owner = obj if inspect.isclass(obj) else _owner(namespace, qualname)
            own, names = set(), set()
            for child in ast.walk(node) if node is not None else ():
                own.update(tier for tier, sign in SIGNS.items() if sign(child))
                if isinstance(child, (ast.Name, ast.Attribute)) and (name := _dotted(child)) is not None:
                    names.add(name)
            refs = {code[1:]: code for name in names if (code := _code_of(_referenced(name, namespace, owner)))}
            refs.pop((path, qualname), None)
            self._parts[path, qualname] = frozenset(own), list(refs.values())
        return self._parts[path, qualname]


def _fixture_functions(item: pytest.Item) -> Iterator[tuple[str, object]]:
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (getattr(info, "name2fixturedefs", None) or {}).items():
        for fixturedef in defs:
            yield name, fixturedef.func


def tiers_of(item: pytest.Item, reader: Reader) -> set[str]:
    """The tiers the rules above put ``item`` in."""
    fixtures = list(_fixture_functions(item))
    found = file_tiers(Path(str(item.path))) | reader.signs(getattr(item, "function", None),
                                                           *(func for _, func in fixtures))
    if any(name in DEPLOY_FIXTURES for name, _ in fixtures):
        found.add("deploy")
    return found


class ProcessWatch:
    """Fails a test not marked ``processes`` that starts a process anyway (an audit hook sees
    subprocess, os.fork, os.system, os.posix_spawn; multiprocessing's spawn is patched while it runs)."""

    EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.spawn"}
    HELPERS = ("platform", "ctypes.util", "torch._inductor", "torch.utils.cpp_extension")
    """modules whose processes are no test's: the standard library's probes of the machine (uname,
    ldconfig), torch.compile's C++ compiler and compile workers"""

    def __init__(self):
        self.item: pytest.Item | None = None
        self.started: dict[str, str] = {}
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple) -> None:
        if self.item is not None and event in self.EVENTS and not self._from_helper():
            self._refuse(f"{event} {args[:2]!r}")

    def _from_helper(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if any(name == helper or name.startswith(helper + ".") for helper in self.HELPERS):
                return True
            frame = frame.f_back
        return False

    def _refuse(self, what: str) -> None:
        self.started.setdefault(self.item.nodeid, what)
        pytest.fail(f"{self.item.nodeid} starts a process ({what[:300]}) but is not marked `processes`: "
                    "tests/tiers.py marks the tests whose code uses subprocess, multiprocessing or os.fork; "
                    "mark one that starts a process some other way with @pytest.mark.processes", pytrace=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        if item.get_closest_marker("processes") is not None:
            return (yield)
        self.item = item
        spawnv = multiprocessing.util.spawnv_passfds
        multiprocessing.util.spawnv_passfds = lambda path, args, passfds: self._refuse(f"multiprocessing {args!r}")
        try:
            return (yield)
        finally:
            multiprocessing.util.spawnv_passfds = spawnv
            self.item = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        what = self.started.get(item.nodeid)
        if what is not None and report.passed and report.when == "call":
            report.outcome = "failed"  # it swallowed the refusal
            report.longrepr = f"{item.nodeid} started a process ({what[:300]}) but is not marked `processes`"
        return report
