"""How an uncaught stop ends a rank (nanguard/rank/ending.py): torchrun's error file, read back by
torch's own reader, one short line on the console, and every other exception left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

import nanguard
from nanguard.events import Event
from nanguard.rank import ending

REPO = Path(__file__).resolve().parents[2]


def _error(rank: int = 1, time: float = 1_700_000_000.5, incident: str | None = "/tmp/inc/job-step7"):
    event = Event(kind="forward", rank=rank, step=7, layer="blocks.1.ffn", module_type="Linear",
                  has_inf=True, time=time)
    return nanguard.NonFiniteError(str(event), event, incident)


def _read_back(tmp_path: Path, record: dict) -> ProcessFailure:
    path = str(tmp_path / "error.json")
    assert ending.write_error_file(path, record)
    return ProcessFailure(local_rank=0, pid=os.getpid(), exitcode=1, error_file=path)


def test_torchrun_reads_the_finding_and_names_the_rank_where_it_was_born(tmp_path):
    error = _error(rank=1)
    born = _read_back(tmp_path, ending.error_record(error, rank=1, now=error.event.time + 0.2))
    heard = _read_back(tmp_path, ending.error_record(error, rank=0, now=error.event.time + 0.2))
    # torchrun shows extraInfo.py_callstack as the "traceback" of the root cause
    shown = born.message["extraInfo"]["py_callstack"]
    assert shown == ("nanguard: non-finite output in blocks.1.ffn (Linear) at step 7, rank 1; every rank "
                     "stopped before the update; state saved in /tmp/inc/job-step7")
    assert born.message["message"].startswith("NonFiniteError: non-finite output in blocks.1.ffn")
    assert heard.message["extraInfo"]["py_callstack"] == shown
    assert born.timestamp == int(error.event.time) < heard.timestamp  # the first observed failure


def test_a_stop_request_reads_as_a_stop(tmp_path):
    error = nanguard.StopRequested("stop requested", step=12, reason="loss diverged")
    failure = _read_back(tmp_path, ending.error_record(error, rank=0, now=1_700_000_000.0))
    assert failure.message["extraInfo"]["py_callstack"] == (
        "nanguard: stop requested (loss diverged) at step 12; every rank stopped before the update")
    assert failure.timestamp == 1_700_000_000


def test_an_unwritable_error_file_is_said_not_raised(tmp_path, caplog):
    assert not ending.write_error_file(str(tmp_path / "missing" / "error.json"), {"message": "x"})
    assert "could not write torchrun's error file" in caplog.text


def test_the_hook_chains_to_the_previous_one_and_goes_with_the_last_guard(monkeypatch):
    # (guards of this test only: one that another test left open would hold the hook too)
    monkeypatch.setattr(ending, "_holds", weakref.WeakSet())
    monkeypatch.setattr(ending, "_previous", ending._previous)  # (put back after, with the hook)
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[1]))
    guard = nanguard.init(torch.nn.Linear(2, 2), None)  # installs the hook over the recorder
    other = nanguard.init(torch.nn.Linear(2, 2), None)
    hook = sys.excepthook
    error = ValueError("the script's own")
    hook(ValueError, error, None)
    assert seen == [error]  # another exception goes on to the hook that was there before
    other.close()
    assert sys.excepthook is hook  # a guard is still open
    with pytest.raises(nanguard.StopRequested):
        try:
            raise nanguard.StopRequested("stop requested", step=3)
        finally:
            guard.close()  # the last guard, closed while a stop is on its way out: the hook stays
    assert sys.excepthook is hook
    again = nanguard.init(torch.nn.Linear(2, 2), None)
    again.close()
    assert sys.excepthook is not hook  # the last guard closed with nothing on its way out
    sys.excepthook(ValueError, error, None)
    assert seen == [error, error]


_SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn

    import nanguard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    nanguard.init(model, optimizer)
    for step in range(4):
        x = torch.randn(4, 8)
        if step == 2:
            x[0, 0] = float("nan")
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
""")


@pytest.mark.timeout(120)
def test_an_uncaught_stop_ends_a_process_with_a_line_and_an_error_file(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    error_file = tmp_path / "error.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANGUARD_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NANGUARD_DIR=str(tmp_path / "incidents"),
               TORCHELASTIC_ERROR_FILE=str(error_file))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=100, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("nanguard: NonFiniteError ended the job at step 2, before the update, on every "
                             "rank; to replay that step, run the same command with NANGUARD_REPLAY=") == 1, done.stderr
    record = json.loads(error_file.read_text())
    assert record["message"]["extraInfo"]["py_callstack"].startswith(
        "nanguard: non-finite input to 0 (Linear) at step 2, rank 0")
