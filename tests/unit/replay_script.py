"""A small training "script" that the replay tests run twice: once to make an incident, once
with ``NANGUARD_REPLAY`` set (which ends in SystemExit(0) at the replayed step)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanguard
from nanguard.incident import read_incident


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def run(make_model: Callable[[], nn.Module], batch: Callable[[int], tuple[Any, torch.Tensor]], *,
        steps: int = 4, loss: Callable = cross_entropy, init_kwargs: dict | None = None,
        keep: dict | None = None, region: Callable[[], Any] = contextlib.nullcontext
        ) -> nanguard.NonFiniteError | None:
    """Trains ``make_model()`` on ``batch(step) -> (model input, labels)``; returns how it ended.
    ``keep`` (a dict) receives the model and the optimizer, for a test to look at afterwards;
    ``region()``: a context the model's forward runs in (an autocast)."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if keep is not None:
        keep.update(model=model, optimizer=optimizer)
    guard = nanguard.init(model, optimizer, **(init_kwargs or {}))
    try:
        for step in range(steps):
            x, y = batch(step)
            with region():
                out = model(x)
            loss(out, y).backward()
            optimizer.step()
            optimizer.zero_grad()
    except nanguard.NonFiniteError as err:
        return err
    finally:
        guard.close()
    return None


def replay(monkeypatch: pytest.MonkeyPatch, incident: str, *args: Any, env: dict[str, str] | None = None,
           **kwargs: Any) -> dict:
    """``run(*args, **kwargs)`` again with NANGUARD_REPLAY=incident (and ``env``): the report."""
    for name, value in {"NANGUARD_REPLAY": incident, **(env or {})}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        run(*args, **kwargs)
    assert exit_info.value.code == 0
    for name in ["NANGUARD_REPLAY", *(env or {})]:
        monkeypatch.delenv(name)
    report = read_incident(incident).replay_report()
    assert report is not None, "the replay wrote no report"
    return report


def line_of(function: Callable, marker: str) -> int:
    """The line number of the source line of ``function`` that holds ``marker``."""
    import inspect

    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if marker in line)
