"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable

import pytest

MODES = ("sentinel", "full")


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
