"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable

import pytest


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
