"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

import itertools
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import tiers
from _pytest.mark.expression import Expression  # what -m is compiled to (pytest has no public name for it)

MODES = ("sentinel", "full")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(tiers.ProcessWatch(), "nanguard-process-watch")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A module whose every test is in a tier that ``-m`` leaves out is not even imported (Lightning or
    transformers alone take seconds): so it is for every tier its tests may be in besides."""
    markexpr = config.getoption("markexpr")
    if not markexpr or not (collection_path.name.startswith("test_") and collection_path.suffix == ".py"):
        return None
    certain = tiers.file_tiers(collection_path)
    others = [tier for tier in tiers.TIERS if tier not in certain]
    expression = Expression.compile(markexpr)
    if certain and not any(expression.evaluate(lambda name, **_: name in certain or name in extra)
                           for extra in (set(c) for n in range(len(others) + 1)
                                         for c in itertools.combinations(others, n))):
        return True
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test with its tiers (tests/tiers.py says how they are read from its code), before
    ``-m`` selects: ``make test-fast`` runs what is in none of them."""
    reader = tiers.Reader()
    for item in items:
        for tier in sorted(tiers.tiers_of(item, reader)):
            if item.get_closest_marker(tier) is None:
                item.add_marker(tier)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``modes("sentinel", "full")`` runs once in each guard mode (``NANGUARD_MODE``,
    which every guard it makes, and every torchrun worker it starts, reads); ``modes("full")`` pins
    a test of one mode's own mechanics."""
    marker = metafunc.definition.get_closest_marker("modes")
    if marker is not None:
        unknown = [mode for mode in marker.args if mode not in MODES]
        if unknown or not marker.args:
            raise pytest.UsageError(f"{metafunc.definition.nodeid}: modes{marker.args} names no mode of {MODES}")
        metafunc.parametrize("guard_mode", marker.args, indirect=True)


@pytest.fixture(autouse=True)
def guard_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The guard mode of the test (its ``modes`` marker's, else the environment's or the default)."""
    mode = getattr(request, "param", None)
    if mode is not None:
        monkeypatch.setenv("NANGUARD_MODE", mode)
    return mode or os.environ.get("NANGUARD_MODE", "sentinel")


@pytest.fixture
def tool() -> Callable[[str], str]:
    """``tool("promtool")``: the path of a command-line tool a test needs.

    Without it the test is skipped on a developer's machine, but fails where the tools must be
    there: ``.ci/run`` installs them (``.ci/install-tools``) and sets ``CI_REQUIRE_TOOLS=1``.
    Tools installed into the virtual environment are found beside its python.
    """

    def find(name: str) -> str:
        venv_bin = os.path.dirname(os.path.abspath(sys.executable))
        path = shutil.which(name, path=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]))
        if path is not None:
            return path
        message = f"{name} is not installed (.ci/install-tools installs it)"
        if os.environ.get("CI_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)

    return find
