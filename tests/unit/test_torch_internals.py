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
    assert looked_up == set(_torch.PRIVATE + _torch.PRIVATE_WHEN_MET)
    assert _torch.MISSING == []  # (this torch has them all)


@pytest.mark.parametrize("path", _torch.PRIVATE)
def test_a_private_symbol_taken_away_costs_a_warning_not_the_guard(path, tmp_path):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, path], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stopped at step 2" in done.stdout
    warned = [line for line in done.stderr.splitlines() if f"has no {path}:" in line]
    assert len(warned) == 1, done.stderr[-3000:]


def test_fsdp2s_private_reduce_scatter_taken_away_costs_a_warning_not_the_stop(gloo, monkeypatch, caplog):
    # looked up only once a guard meets a fully_shard-ed model: in this process, and forgotten after
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    import nanguard
    from test_guard import GradFault

    path = _torch.PRIVATE_WHEN_MET[0]
    monkeypatch.delattr(_fsdp_collectives, path.rsplit(".", 1)[1])
    monkeypatch.setattr(_torch, "_fsdp_default", _torch._UNSEEN)
    monkeypatch.setattr(_torch, "MISSING", [])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), GradFault(), nn.Linear(8, 2))
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="nanguard"), nanguard.init(model, optimizer) as guard:
        assert not guard._detector.backward.watches_buckets
        model[1].armed = True
        model(torch.randn(4, 8)).sum().backward()
        with pytest.raises(nanguard.NonFiniteError) as info:
            optimizer.step()
    assert info.value.event.kind == "grad" and info.value.event.layer == "0.weight", info.value.event
    assert _torch.MISSING == [path]
    warned = [r.getMessage() for r in caplog.records if f"has no {path}:" in r.getMessage()]
    assert len(warned) == 1 and "not watched before they are summed" in warned[0], warned


def test_a_scaler_that_keeps_no_scale_costs_a_warning_not_the_flight_recorder(monkeypatch, caplog):
    import torch
    from torch import nn

    import nanguard

    class Renamed:  # a torch whose GradScaler keeps its scale under another name (what the guard asks of one)
        def __init__(self):
            self._renamed = torch.full((), 1024.0)

        def is_enabled(self):
            return True

        def get_scale(self):
            return float(self._renamed)

        def update(self):
            pass

        def state_dict(self):
            return {"scale": self.get_scale()}

    path = _torch.PRIVATE_WHEN_MET[1]
    monkeypatch.setattr(_torch, "MISSING", [])
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = Renamed()
    with caplog.at_level("WARNING", logger="nanguard"), nanguard.init(model, optimizer, scaler=scaler) as guard:
        for _ in range(3):
            model(torch.randn(3, 4)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert guard.step == 3
    assert _torch.MISSING == [path]
    warned = [r.getMessage() for r in caplog.records if f"has no {path}:" in r.getMessage()]
    assert len(warned) == 1 and "scale" in warned[0], warned


def test_a_replay_on_a_torch_without_its_dispatch_mode_is_refused_clearly(monkeypatch, tmp_path):
    # a plain guard never imports the replay (its op checks subclass torch.utils._python_dispatch's mode)
    import torch

    import nanguard
    from nanguard.errors import ConfigError

    monkeypatch.setitem(sys.modules, "nanguard.replay", None)  # (what a failed import of it leaves)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        assert guard.step == 1
    monkeypatch.setenv("NANGUARD_REPLAY", str(tmp_path))
    with pytest.raises(ConfigError, match=r"lacks what a replay's op checks need .*nothing was replayed"):
        nanguard.init(model, optimizer)
