"""torch's private symbols are nanguard's only in nanguard/_torch/: each one taken away costs a
warning that names it, never ``import nanguard``, ``init`` or the stop before a bad update.

A rename in a later torch is simulated in a fresh interpreter: the symbol is taken from torch while
nanguard looks it up (torch's own code, which uses it under its new name, gets it back after)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nanguard import _torch

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import importlib, sys
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # (torch's own code: before the symbol goes)
    path = sys.argv[1]
    parent_path, name = path.rsplit(".", 1)
    parts = parent_path.split(".")
    parent = importlib.import_module(parts[0])
    for part in parts[1:]:
        parent = getattr(parent, part)
    engine = name == "queue_callback"  # (a method of torch's autograd engine: a stand-in without it)
    if engine:
        real = torch.autograd.Variable._execution_engine

        class Engine:
            def __getattr__(self, attr):
                if attr == "queue_callback":
                    raise AttributeError(attr)
                return getattr(real, attr)

        torch.autograd.Variable._execution_engine = Engine()
    else:
        held = getattr(parent, name)
        delattr(parent, name)

    def give_back():
        if engine:
            torch.autograd.Variable._execution_engine = real
        else:
            setattr(parent, name, held)

    import nanguard
    from nanguard import _torch
    at_import = _torch.PRIVATE.index(path) < 7  # (the others are looked up as a guard starts)
    if at_import:
        give_back()
    guard = nanguard.init(model, optimizer)
    if not at_import:
        give_back()
    assert _torch.MISSING == [path], _torch.MISSING
    x = torch.randn(3, 4)
    for step in range(3):
        if step == 2:
            x[0, 0] = float("nan")
        try:
            model(x).square().mean().backward()
            optimizer.step()
        except nanguard.NonFiniteError as error:
            assert step == 2 and error.event.step == 2, error
            print("stopped at step", error.event.step)
            break
        optimizer.zero_grad()
    else:
        raise SystemExit("no stop")
    guard.close()
""")


def test_every_private_lookup_is_listed():
    source = (REPO / "nanguard" / "_torch" / "__init__.py").read_text()
    looked_up = set(re.findall(r'_private\(\s*"(torch\.[\w.]+)"', source))
    assert looked_up == set(_torch.PRIVATE)
    assert _torch.MISSING == []  # (this torch has them all)


@pytest.mark.parametrize("path", _torch.PRIVATE)
def test_a_private_symbol_taken_away_costs_a_warning_not_the_guard(path, tmp_path):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, path], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stopped at step 2" in done.stdout
    warned = [line for line in done.stderr.splitlines() if f"has no {path}:" in line]
    assert len(warned) == 1, done.stderr[-3000:]
