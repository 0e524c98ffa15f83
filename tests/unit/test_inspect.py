"""`nanguard inspect DIR [--json]`: readable without the training code, one error line when bad."""

import json
import os

from nanguard import incident as capture
from nanguard.incident import read_incident
from nanguard.incident import inspection as inspect
from test_capture import first_event, flip_byte, make_incident, rank_inputs


def test_summary_says_where_who_and_what(tmp_path):
    path, _ = make_incident(tmp_path)
    text = inspect.summary(read_incident(path))
    for expected in ("job-step7", "step         7, world size 2", "first seen   by rank 1 on node-b",
                     "kind         forward", "layer        blocks.2.mlp (Linear)", "producer",
                     "3 NaN of 64, first at [0, 5] (nan)", "replay       not run yet", "rank 0 ", "rank 1 ",
                     "state.pt", "batches.pt", "note         policy: raise"):
        assert expected in text, expected


def test_summary_shows_the_replay_verdict(tmp_path):
    path, _ = make_incident(tmp_path, capture_batch=False)
    capture.record_replay(path, {"verdict": "not_reproducible", "first_event": None,
                                 "message": "suspect a transient fault on node-b (GPU 3)"})
    text = inspect.summary(read_incident(path))
    assert "replay       not_reproducible: no non-finite value the second time" in text
    assert "suspect a transient fault on node-b" in text and "batches      not captured" in text


def test_propagator(tmp_path):
    path = capture.new_incident_dir(str(tmp_path), "p")
    record = capture.write_rank(path, 0, **rank_inputs(0))
    capture.finalize(path, world_size=1, step=7, first_event=first_event(rank=0, input_nonfinite=True),
                     rank_records=[record], capture_batch=True, sharded=None)
    assert "passed on: its inputs were already non-finite" in inspect.summary(read_incident(path))


def test_the_root_module_is_called_the_model(tmp_path):
    # one name for the model's own output in every line of an incident (the live message says "the model")
    path = capture.new_incident_dir(str(tmp_path), "r")
    record = capture.write_rank(path, 0, **rank_inputs(0))
    capture.finalize(path, world_size=1, step=7, first_event=first_event(rank=0, layer="", module_type="TinyLM"),
                     rank_records=[record], capture_batch=True, sharded=None)
    assert "layer        the model (TinyLM)" in inspect.summary(read_incident(path))


def test_json_is_one_object_with_the_contract_keys(tmp_path, capsys):
    path, _ = make_incident(tmp_path)
    assert inspect.main([path, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    data = json.loads(out)
    assert {"incident", "step", "first_event", "ranks", "replay"} <= set(data)
    assert data["incident"] == "job-step7" and data["step"] == 7 and data["replay"] is None
    assert data["first_event"]["layer"] == "blocks.2.mlp" and data["first_event"]["first_value"] == "nan"
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["ranks"][1]["files"]["rank1/state.pt"]["size"] > 0

    replayed = first_event(rank=1).to_dict()
    capture.record_replay(path, {"verdict": "reproducible", "first_event": replayed})
    assert inspect.main([path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["replay"]["verdict"] == "reproducible" and data["replay"]["first_event"] == replayed


def test_plain_summary_from_main(tmp_path, capsys):
    path, _ = make_incident(tmp_path, world_size=1)
    assert inspect.main([path]) == 0
    assert capsys.readouterr().out.startswith("incident     job-step7")


def test_bad_incident_is_one_error_line(tmp_path, capsys):
    path, _ = make_incident(tmp_path)
    flip_byte(os.path.join(path, "rank0", "events.json"), offset=-5)
    assert inspect.main([path, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"nanguard inspect: {path}/rank0/events.json: sha256 ")
    assert captured.err.count("\n") == 1

    empty = tmp_path / "empty"
    empty.mkdir()
    assert inspect.main([str(empty)]) == 2
    assert "incomplete: no manifest.json" in capsys.readouterr().err


def test_notes_that_are_not_text_are_refused(tmp_path):
    # found by the manifest fuzz run longer than CI: {"notes": {"": Infinity}} was read, then made --json fail
    import pytest

    from nanguard.errors import IncidentError

    path, _ = make_incident(tmp_path)
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["notes"] = {"": float("inf")}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(IncidentError, match="'notes' does not map names to text"):
        read_incident(path)
