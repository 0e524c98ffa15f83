"""The real-model suite: tiny models of transformers, timm, Lightning, the HF Trainer, accelerate
and a nanoGPT-style loop, each with a fault at a known place and an oracle that does not ask
nanguard (oracles.py). Needs the ``realworld`` extra: ``pip install -c constraints.txt -e '.[realworld]'``.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _integration_launcher():
    """The Launcher of tests/integration (torchrun jobs in their own sessions, killed on
    timeout and at teardown), loaded under a name of its own."""
    path = HERE.parent / "integration" / "conftest.py"
    spec = importlib.util.spec_from_file_location("nanguard_integration_launch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


LAUNCH = _integration_launcher()


@pytest.fixture(autouse=True)
def realworld_env(tmp_path, monkeypatch):
    """No hub downloads; incidents in the test's own folder; no NANGUARD_* of the caller's but the guard
    mode (tests/conftest.py's ``guard_mode``)."""
    import os

    for name in [n for n in os.environ if n.startswith("NANGUARD_") and n != "NANGUARD_MODE"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("NANGUARD_DIR", str(tmp_path / "incidents"))
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return tmp_path / "incidents"


@pytest.fixture
def torchrun(tmp_path):
    launcher = LAUNCH.Launcher(tmp_path)
    try:
        yield launcher
    finally:
        launcher.close()

