"""What the tests of this suite share: running a training loop until nanguard stops it, with the
state copied before every step and the oracles reset, and the checks every stop must pass."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import nanguard
from oracles import StateBefore

WORKERS = Path(__file__).resolve().parent / "workers"
"""the torchrun worker scripts of this suite"""


def needs(*packages: str) -> None:
    """Skip when a package of the realworld extra is missing; fail in CI (CI_REQUIRE_TOOLS=1),
    where `make test` has installed it."""
    for package in packages:
        if importlib.util.find_spec(package) is None:
            message = (f"{package} is not installed: pip install -c constraints.txt -e '.[realworld]'"
                       " (the Makefile's install does, and timm with --no-deps)")
            if os.environ.get("CI_REQUIRE_TOOLS") == "1":
                pytest.fail(message)
            pytest.skip(message, allow_module_level=True)


def until_stop(step: Callable[[int], Any], model: torch.nn.Module, optimizer: Any, *, steps: int,
               arm: Callable[[int], None] = lambda s: None, oracles: Sequence[Any] = ()
               ) -> tuple[int, nanguard.NonFiniteError, StateBefore]:
    """Run ``step(i)`` for i in range(steps), ``arm(i)`` first (the fault is injected there);
    return (the loop step that raised, the error, the state copied right before that step)."""
    for i in range(steps):
        arm(i)
        for oracle in oracles:
            oracle.reset() if hasattr(oracle, "reset") else oracle.order.clear()
        before = StateBefore(model, optimizer)
        try:
            step(i)
        except nanguard.NonFiniteError as err:
            return i, err, before
    pytest.fail(f"no NonFiniteError in {steps} steps")


def assert_untouched(before: StateBefore, model: torch.nn.Module | None = None, optimizer: Any = None) -> None:
    """Parameters, floating buffers and optimizer state are as they were before the step."""
    changed = before.changed(model, optimizer)
    assert changed == [], f"the refused step changed {changed[:8]}"


def assert_incident_holds(err: nanguard.NonFiniteError, before: StateBefore, prefix: str = "") -> None:
    """The incident's model state is the state from before the step, buffers included."""
    from nanguard.incident import read_incident

    saved = read_incident(err.incident).rank_state(err.event.rank)["model"]
    differ = before.differs_from_saved(saved, prefix)
    assert differ == [], f"the incident's 'state from before step {err.event.step}' differs in {differ[:8]}"


def assert_fed_as_captured(report: dict) -> None:
    """A replay's notes say of nothing that the script fed in place of what was captured (the
    batch, the extra forwards, a scheduler's state: those notes name "the script's" own)."""
    differences = [note for note in report["notes"] if "script's" in note or "not captured" in note]
    assert differences == [], differences
