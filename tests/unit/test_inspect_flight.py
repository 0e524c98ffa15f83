"""`nanguard inspect` draws the flight recorder (rank<k>/flight.json): sparklines by default,
``--plot FILE.png`` with matplotlib; a malformed file is reported, a missing one is normal."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from nanguard.incident import flight_chart as flight, read_incident
from nanguard.incident import inspection as inspect
from nanguard.incident.fsio import digest, write_json
from test_capture import make_incident

COLUMNS = ["step", "loss", "grad_norm", "scale", "lr", "step_time_s"]


def recorder(steps: int = 8, incident_step: int = 7) -> dict:
    rows = []
    for step in range(steps):
        loss = 2.3 * 0.8 ** step
        norm = 0.5 if step < steps - 2 else 80.0 * (step - steps + 3)
        rows.append([step, loss, norm, 65536.0, 1e-3, 0.12])
    rows[-1] = [incident_step, "nan", None, 65536.0, 1e-3, None]  # the incident step: the loss went NaN
    return {"version": 1, "columns": COLUMNS, "rows": rows,
            "top_params": [{"step": incident_step - 1, "params": {"blocks.1.fc.weight": 159.0,
                                                                 "blocks.1.fc.bias": 12.5, "head.bias": 0.1}}]}


def add_flight(path: str, rank: int, content) -> None:
    """Puts a flight.json into rank ``rank``'s folder and lists it in the manifest, as the
    incident writer does; ``content``: JSON data, or raw text for a damaged file."""
    relpath = f"rank{rank}/flight.json"
    with open(os.path.join(path, relpath), "w") as f:
        f.write(content if isinstance(content, str) else json.dumps(content))
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["ranks"][rank]["files"][relpath] = digest(os.path.join(path, relpath))
    write_json(manifest_path, manifest)


def test_sparklines_of_loss_and_grad_norm_with_the_incident_step_marked(tmp_path):
    path, _ = make_incident(tmp_path)  # its first event is on rank 1, at step 7
    add_flight(path, 1, recorder())
    lines = inspect.summary(read_incident(path)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("flight"))
    head, loss, norm, mark, top = lines[start:start + 5]
    assert head == "flight       rank 1 (the first event's): 8 step(s) recorded"
    spark = loss.split()[1]
    assert loss.startswith("  loss       ") and spark[0] == "█" and spark[-1] == "!" and len(spark) == 8
    assert "0.6029 .. 2.3, last finite 0.6029; 1 non-finite (!)" in loss
    assert norm.split()[1] == "▁▁▁▁▁▁█·" and norm.endswith("(log scale)")
    column = loss.index(spark) + 7
    assert mark.index("^") == column and mark.endswith("^ step 7, the incident")
    assert top == " " * 13 + "largest gradient norms, step 6: blocks.1.fc.weight 159, blocks.1.fc.bias 12.5, head.bias 0.1"


def test_what_the_recorder_writes_for_non_finite_values_is_drawn_as_such(tmp_path):
    """The recorder writes NaN and Inf as null: a parameter's null norm at the incident step is
    a non-finite one (it ranks them first), and a column it never filled says so."""
    path, _ = make_incident(tmp_path)
    data = recorder()
    data["rows"] = [[s, None, 0.5, None, 1e-3, 0.1] for s in range(7)] + [[7, None, None, None, 1e-3, 0.1]]
    data["top_params"] = [{"step": 6, "params": {"a.weight": 3.0, "b.weight": 1.0}},
                          {"step": 7, "params": {"a.weight": None, "b.weight": 2.0}}]
    add_flight(path, 1, data)
    lines = [line for line in inspect.summary(read_incident(path)).splitlines() if line.startswith("  ")]
    assert lines[0].startswith("  loss       ········") and lines[0].endswith("none recorded")
    assert lines[-1] == " " * 13 + "largest gradient norms, step 7: a.weight non-finite, b.weight 2"


def test_json_keeps_its_keys_and_adds_the_flight(tmp_path, capsys):
    path, _ = make_incident(tmp_path)
    assert inspect.main([path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["flight"] == {}  # an incident from before the recorder: nothing, and no error
    add_flight(path, 1, recorder())
    add_flight(path, 0, {"version": 1, "columns": ["step"], "rows": [[0], ["x"]]})
    assert inspect.main([path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"incident", "step", "first_event", "ranks", "replay", "flight"} <= set(data)
    assert data["flight"]["1"]["rows"][-1][:3] == [7, "nan", None]
    assert data["flight"]["0"] == {"problem": "rank0/flight.json is malformed: row 1, step is 'x', not a number or null"}


@pytest.mark.parametrize("content, problem", [
    ("{not json", "could not be read as JSON"),
    ([1, 2], "it is not a JSON object"),
    ({"version": 2, "columns": COLUMNS, "rows": []}, "version 2 is not 1"),
    ({"version": 1, "columns": ["loss"], "rows": []}, "holds \"step\""),
    ({"version": 1, "columns": COLUMNS, "rows": [[0, 1.0]]}, "row 0 is not a list of 6 values"),
    ({"version": 1, "columns": COLUMNS, "rows": [[0, True, 1, 1, 1, 1]]}, "row 0, loss is True"),
    ({"version": 1, "columns": COLUMNS, "rows": [[1.5, 1, 1, 1, 1, 1]]}, "row 0 has no step"),
    ({"version": 1, "columns": COLUMNS, "rows": [[2, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]}, "not oldest first"),
    ({"version": 1, "columns": COLUMNS, "rows": [], "top_params": [{"step": 1, "params": [1]}]},
     "top_params entry 0"),
])
def test_a_malformed_recorder_is_reported_never_a_crash(tmp_path, content, problem, capsys):
    path, _ = make_incident(tmp_path)
    add_flight(path, 1, content)
    text = inspect.summary(read_incident(path))
    (line,) = [line for line in text.splitlines() if line.startswith("flight")]
    assert line.startswith("flight       not drawn: ") and problem in line, line
    assert inspect.main([path, "--plot", str(tmp_path / "f.png")]) == 1
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "f.png").exists()


def test_long_records_are_bucketed_and_the_mark_follows():
    values = [float(i) for i in range(1, 601)]
    values[450] = math.inf
    spark, log = flight.sparkline(values, width=60)
    assert len(spark) == 60 and spark[45] == "!" and log
    steps = list(range(1000, 1600))
    assert flight.column_of(steps, 1450) == 45
    assert flight.column_of(steps, 5000) == 60  # after the last row: one past the end
    assert flight.sparkline([None, 1.0, 1.0]) == ("·▁▁", False)


@pytest.mark.processes  # matplotlib runs fc-list on a machine with no font cache yet
def test_plot_draws_a_png_with_the_incident_step(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, _ = make_incident(tmp_path)
    add_flight(path, 1, recorder())
    image = tmp_path / "flight.png"
    assert inspect.main([path, "--plot", str(image)]) == 0
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 10_000
    assert f"plot         {image}" in capsys.readouterr().out


def test_plot_says_why_it_cannot_draw(tmp_path, capsys, monkeypatch):
    path, _ = make_incident(tmp_path)
    assert inspect.main([path, "--plot", str(tmp_path / "f.png")]) == 1
    assert "has no flight recorder" in capsys.readouterr().err
    add_flight(path, 1, recorder())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert inspect.main([path, "--plot", str(tmp_path / "f.png")]) == 1
    assert "pip install 'nanguard[plot]'" in capsys.readouterr().err
