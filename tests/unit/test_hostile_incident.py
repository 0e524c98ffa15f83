"""Hostile incident folders: whatever a damaged or crafted folder holds, ``nanguard inspect`` and a
replay refuse it with one IncidentError that names the file, before anything is loaded or
changed, never a traceback, and nothing from the folder reaches the terminal unescaped.

Every folder here starts as a real incident (``test_replay.train``: a real script with
``nanguard.init``) and is then damaged, or crafted with its sizes and sha256 rewritten to match.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_capture import edit_manifest
from test_replay import REPO, Sqrt, scaled_and_scheduled, train

import nanguard
from nanguard.incident import IncidentError, inspection as report, read_incident
from nanguard.incident.reader import _check_state
from nanguard.incident.rng import check_record, rng_record, rng_restore, rng_snapshot

EXAMPLES = int(os.environ.get("NANGUARD_FUZZ_EXAMPLES", "150"))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A real incident, made once: a script that goes NaN at a deterministic bug."""
    root = tmp_path_factory.mktemp("original")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NANGUARD_DIR", str(root))
        _, err = train(Sqrt(16))
    assert err is not None and os.path.isfile(os.path.join(err.incident, "manifest.json"))
    return err.incident


@pytest.fixture
def incident(original, tmp_path):
    """A fresh copy of the real incident, to damage."""
    path = str(tmp_path / "incident")
    shutil.copytree(original, path, symlinks=True)
    return path


def rehash(path: str) -> None:
    """Rewrites every listed file's size and sha256 in the manifest: a crafted folder."""
    def change(manifest):
        for record in manifest["ranks"]:
            for relpath, entry in record["files"].items():
                with open(os.path.join(path, relpath), "rb") as f:
                    data = f.read()
                entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    edit_manifest(path, change)


def inspect(path: str, *args: str) -> subprocess.CompletedProcess:
    """The real command, in its own process; output as bytes (escape bytes must not hide)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "nanguard", "inspect", path, *args], env=env,
                          capture_output=True, timeout=120)


def assert_refused(result: subprocess.CompletedProcess, *expected: str) -> str:
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "Traceback" not in err and result.stdout == b""
    assert err.startswith("nanguard inspect: ") and err.count("\n") == 1, err
    for text in expected:
        assert text in err, err
    return err


def replay_init(monkeypatch, path: str) -> IncidentError:
    """``nanguard.init`` of a replay of ``path``, which must refuse it having changed nothing: not
    the model's weights, not the process's random states."""
    torch.manual_seed(5)
    random.seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), Sqrt(16), torch.nn.Linear(16, 4))
    weights = copy.deepcopy(model.state_dict())
    rng = (torch.get_rng_state(), random.getstate())
    monkeypatch.setenv("NANGUARD_REPLAY", path)
    with pytest.raises(IncidentError) as info:
        nanguard.init(model, torch.optim.Adam(model.parameters()))
    monkeypatch.delenv("NANGUARD_REPLAY")
    assert all(torch.equal(value, weights[name]) for name, value in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    assert "weights_only=False" not in str(info.value)
    return info.value


# ---------------------------------------------------------------------- the manifest
def test_a_huge_world_size_is_the_ranks_error_not_a_memory_error(incident):
    edit_manifest(incident, lambda m: m.update(world_size=10**12))
    assert_refused(inspect(incident), "manifest.json: lists ranks [0] for a world size of 1000000000000",
                   "every rank must appear once")


@pytest.mark.parametrize("notes", [[1, 2], "policy", 3])
def test_notes_that_are_not_an_object_are_refused(incident, notes):
    edit_manifest(incident, lambda m: m.update(notes=notes))
    for args in ((), ("--json",)):
        assert_refused(inspect(incident, *args), "manifest.json: field 'notes'", "wrong type")


def test_a_replay_entry_without_size_and_sha256_is_refused(incident, monkeypatch):
    with open(os.path.join(incident, "replay.json"), "w") as f:
        f.write("{}")
    edit_manifest(incident, lambda m: m.update(replay={"file": "replay.json", "verdict": "reproducible"}))
    assert_refused(inspect(incident), "manifest.json: field 'replay' has no valid size and sha256")
    err = replay_init(monkeypatch, incident)
    assert "has no valid size and sha256" in str(err)


@pytest.mark.parametrize("change, expected", [
    (lambda m: m["ranks"][0].update(rank=False), "lists ranks [False]"),
    (lambda m: m.update(step=-3), "field 'step' is -3"),
    (lambda m: m.update(step=2.5), "field 'step'"),
])
def test_a_rank_that_is_a_bool_or_a_step_that_is_not_a_count_is_refused(incident, change, expected):
    edit_manifest(incident, change)
    assert_refused(inspect(incident), expected)


def test_a_manifest_nested_too_deep_is_not_json(incident):
    with open(os.path.join(incident, "manifest.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    assert_refused(inspect(incident), "manifest.json: is not valid JSON (nested too deep)")


@pytest.mark.parametrize("name", ["events.json", "environment.json", "flight.json"])
def test_a_rank_file_nested_too_deep_is_an_incident_error(incident, name):
    with open(os.path.join(incident, "rank0", name), "w") as f:
        f.write("{\"a\": " * 100_000 + "1" + "}" * 100_000)
    rehash(incident)
    opened = read_incident(incident)
    read = {"events.json": opened.rank_events, "environment.json": opened.environment,
            "flight.json": opened.rank_flight}[name]
    with pytest.raises(IncidentError, match=f"rank0/{name}: could not be read as JSON \\(nested too deep\\)"):
        read(0)
    result = inspect(incident)
    assert result.returncode == 0 and b"Traceback" not in result.stderr
    if name == "flight.json":
        assert b"not drawn" in result.stdout and b"nested too deep" in result.stdout


def test_a_replay_report_nested_too_deep_is_refused(incident):
    path = os.path.join(incident, "replay.json")
    with open(path, "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    with open(path, "rb") as f:
        data = f.read()
    edit_manifest(incident, lambda m: m.update(replay={"file": "replay.json", "verdict": "reproducible",
                                                       "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    assert_refused(inspect(incident, "--json"), "replay.json: could not be read as JSON (nested too deep)")


def test_a_folder_that_is_no_incident_is_said_to_be_none(tmp_path, monkeypatch):
    folder = tmp_path / "etc"
    folder.mkdir()
    (folder / "hostname").write_text("x")
    (folder / "passwd").write_text("x")
    err = assert_refused(inspect(str(folder)), "is not an incident folder")
    assert "unfinished" not in err and "incomplete" not in err
    monkeypatch.setenv("NANGUARD_REPLAY", str(folder))
    with pytest.raises(IncidentError, match="is not an incident folder"):
        nanguard.init(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------- links out of the incident
def test_a_rank_file_linked_outside_the_incident_is_refused(incident, tmp_path, monkeypatch):
    outside = tmp_path / "elsewhere.json"
    shutil.copy(os.path.join(incident, "rank0", "environment.json"), outside)
    os.remove(os.path.join(incident, "rank0", "environment.json"))
    os.symlink(outside, os.path.join(incident, "rank0", "environment.json"))
    assert_refused(inspect(incident), "rank0/environment.json: is a link to", "outside the incident folder")
    assert "outside the incident folder" in str(replay_init(monkeypatch, incident))


def test_a_rank_folder_linked_outside_the_incident_is_refused(incident, tmp_path):
    shutil.move(os.path.join(incident, "rank0"), tmp_path / "rank0-elsewhere")
    os.symlink(tmp_path / "rank0-elsewhere", os.path.join(incident, "rank0"))
    assert_refused(inspect(incident), "/rank0: is a link to", "outside the incident folder")


def test_a_manifest_linked_outside_the_incident_is_refused(incident, tmp_path):
    shutil.move(os.path.join(incident, "manifest.json"), tmp_path / "manifest-elsewhere.json")
    os.symlink(tmp_path / "manifest-elsewhere.json", os.path.join(incident, "manifest.json"))
    assert_refused(inspect(incident), "manifest.json: is a link to", "outside the incident folder")


def test_a_link_that_stays_inside_the_incident_is_read(incident):
    os.rename(os.path.join(incident, "rank0", "events.json"), os.path.join(incident, "events-copy.json"))
    os.symlink(os.path.join("..", "events-copy.json"), os.path.join(incident, "rank0", "events.json"))
    assert read_incident(incident).rank_events(0)


# ---------------------------------------------------------------------- what a replay loads
@pytest.mark.parametrize("name, content, expected", [
    ("state.pt", {"optimizer": None, "extra": {}}, "does not hold a model's and an optimizer's states"),
    ("state.pt", [1, 2, 3], "does not hold a model's and an optimizer's states"),
    ("state.pt", {"model": {1: torch.zeros(2)}, "optimizer": None, "extra": {}}, "does not hold a model's"),
    ("state.pt", {"model": {}, "optimizer": {"param_groups": 3}, "extra": {}}, "does not hold a model's"),
    ("rng.pt", {"python": 5, "torch": "x"}, "does not hold random states"),
    ("rng.pt", {"python": 5, "torch": torch.get_rng_state()}, "does not hold random states"),
    ("rng.pt", [1], "does not hold random states"),
    ("rng.pt", {"python": None, "torch": torch.zeros(3, dtype=torch.uint8)}, "does not hold random states"),
    ("batches.pt", [{"args": "abc", "kwargs": {}}], "does not hold a list of {args: list, kwargs: dict}"),
    ("batches.pt", [{"args": [], "kwargs": [1]}], "does not hold a list of {args: list, kwargs: dict}"),
])
def test_a_torch_file_of_the_wrong_structure_is_refused_before_anything_changes(incident, monkeypatch, name,
                                                                                content, expected):
    torch.save(content, os.path.join(incident, "rank0", name))
    rehash(incident)
    err = replay_init(monkeypatch, incident)
    assert err.path.endswith(f"rank0/{name}") and expected in err.reason
    assert "the folder is damaged or was crafted; nothing was loaded" in err.reason


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PAYLOAD-RAN",))


@pytest.mark.parametrize("name", ["state.pt", "rng.pt", "batches.pt"])
@pytest.mark.parametrize("damage", ["truncated", "empty", "not torch", "malicious pickle"])
def test_a_file_torch_cannot_load_is_damaged_or_crafted_and_no_unpickling_is_advised(
        incident, monkeypatch, tmp_path, name, damage):
    import pickle

    path = os.path.join(incident, "rank0", name)
    with open(path, "rb") as f:
        data = f.read()
    content = {"truncated": data[:100], "empty": b"", "not torch": b"not a torch file\n" * 10,
               "malicious pickle": pickle.dumps(Payload())}[damage]
    with open(path, "wb") as f:
        f.write(content)
    rehash(incident)
    monkeypatch.chdir(tmp_path)
    err = replay_init(monkeypatch, incident)
    assert err.path == path and "could not be loaded as data" in err.reason
    assert "the folder is damaged or was crafted; nanguard does not unpickle incident files" in err.reason
    assert "weights_only" not in err.reason and "trust" not in err.reason
    assert not os.path.exists(tmp_path / "PAYLOAD-RAN")


def test_an_environment_that_is_not_an_object_is_refused_before_the_step(incident, monkeypatch):
    with open(os.path.join(incident, "rank0", "environment.json"), "w") as f:
        f.write("[1, 2]")
    rehash(incident)
    err = replay_init(monkeypatch, incident)
    assert err.path.endswith("rank0/environment.json") and "is not an object" in err.reason


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    root = tmp_path_factory.mktemp("scheduled")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NANGUARD_DIR", str(root))
        err = scaled_and_scheduled()[0]
    assert err is not None
    return err.incident


@pytest.mark.parametrize("name, craft, expected", [
    ("scheduler", lambda state: {**state, "optimizer": 5}, "(keys optimizer it does not have)"),
    ("scheduler", lambda state: {**state, "base_lrs": "abc"}, "(base_lrs is a str, not a list like its own)"),
    ("scheduler", lambda state: {**state, "base_lrs": [0.1] * 3}, "(base_lrs holds 3 values, not 1 like its own)"),
    ("scheduler", lambda state: {**state, "last_epoch": {"a": 1}}, "(last_epoch is a dict, not a int like its own)"),
    ("scaler", lambda state: {**state, "scale": "big"}, "(scale is a str, not a float like its own)"),
    ("scaler", lambda state: "not a state", "(a str, not a dict)"),
    ("scaler", lambda state: {k: v for k, v in state.items() if k != "scale"},
     "holds a scaler state that does not fit the script's GradScaler (KeyError: 'scale')"),
])
def test_a_crafted_scaler_or_scheduler_state_is_refused_and_the_scripts_own_is_kept(
        scheduled, tmp_path, monkeypatch, name, craft, expected):
    incident = str(tmp_path / "incident")
    shutil.copytree(scheduled, incident)
    path = os.path.join(incident, "rank0", "state.pt")
    state = torch.load(path, weights_only=True)
    state["extra"][name] = craft(state["extra"][name])
    torch.save(state, path)
    rehash(incident)
    monkeypatch.setenv("NANGUARD_REPLAY", incident)
    made = {}
    with pytest.raises(IncidentError) as info:
        scaled_and_scheduled(made)
    assert info.value.path == path and f"holds a {name} state that " in info.value.reason
    assert expected in info.value.reason and "no state was loaded" in info.value.reason
    # the script's own states, as it made them: nothing of the crafted one was set
    assert made["scaler"].state_dict()["scale"] == 2.0**10
    assert made["scheduler"].state_dict() == {**made["fresh"], "_last_lr": made["scheduler"].state_dict()["_last_lr"]}


# ---------------------------------------------------------------------- the terminal
ESC = "\x1b[2J\x1b[31mPWN\x1b[0m\r\n\x07\x9b\u202e"


def assert_clean(output: bytes) -> None:
    for byte in (b"\x1b", b"\x07", b"\r", b"\xc2\x9b", "\u202e".encode()):
        assert byte not in output, (byte, output[:400])


def test_strings_from_the_folder_reach_the_terminal_escaped(incident):
    def change(manifest):
        manifest["incident"] = ESC
        manifest["first_event"].update(host="h\x1b]0;TITLE\x07", layer="lay\x1ber")
        manifest["notes"] = {"n\x1bote": "v\x1b[1m"}
        manifest["created"] = ESC
    edit_manifest(incident, change)
    result = inspect(incident)
    assert result.returncode == 0 and b"Traceback" not in result.stderr
    assert_clean(result.stdout)
    assert b"\\x1b[2J\\x1b[31mPWN" in result.stdout and b"h\\x1b]0;TITLE\\x07" in result.stdout
    result = inspect(incident, "--json")
    assert result.returncode == 0
    assert_clean(result.stdout)
    assert json.loads(result.stdout)["incident"] == ESC


def test_the_plot_of_a_crafted_folder_has_its_names_escaped(incident, tmp_path):
    flight_path = os.path.join(incident, "rank0", "flight.json")
    with open(flight_path) as f:
        flight = json.load(f)
    flight["columns"] = ["step", "l$o\x1bss$\\frac{", "g\x07$n"]  # neither loss nor grad_norm: these are drawn
    flight["rows"] = [row[:3] for row in flight["rows"]]
    with open(flight_path, "w") as f:
        json.dump(flight, f)
    rehash(incident)
    edit_manifest(incident, lambda m: m.update(incident="x$\\sqrt{\x1b"))
    result = inspect(incident, "--plot", str(tmp_path / "plot.png"))
    assert result.returncode == 0, result.stderr.decode()
    assert_clean(result.stdout)
    assert os.path.getsize(tmp_path / "plot.png") > 0


def test_an_error_about_a_crafted_name_reaches_the_terminal_escaped(incident, tmp_path):
    named = str(tmp_path / f"x{ESC}")  # a folder name from a tarball, tab-completed by the operator
    os.rename(incident, named)
    with open(os.path.join(named, "manifest.json"), "w") as f:
        f.write("{")
    result = inspect(named)
    assert_refused(result, "manifest.json: is not valid JSON")
    assert_clean(result.stderr)


def test_a_plot_problem_about_a_crafted_name_reaches_the_terminal_escaped(incident, tmp_path):
    flight_path = os.path.join(incident, "rank0", "flight.json")
    with open(flight_path) as f:
        flight = json.load(f)
    flight["top_params"] = [{"step": 0, "params": {f"p{ESC}": "not a number"}}]
    with open(flight_path, "w") as f:
        json.dump(flight, f)
    rehash(incident)
    result = inspect(incident, "--plot", str(tmp_path / "plot.png"))
    assert result.returncode == 1 and b"Traceback" not in result.stderr
    assert b"not plotted" in result.stderr and b"not drawn" in result.stdout
    assert_clean(result.stdout)
    assert_clean(result.stderr)


# ---------------------------------------------------------------------- properties
@pytest.fixture(scope="module")
def scratch(original, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("scratch") / "incident")
    shutil.copytree(original, path)
    with open(os.path.join(path, "manifest.json")) as f:
        return path, json.load(f)


FIELDS = ["incident", "step", "world_size", "first_event", "ranks", "capture_batch", "sharded", "replay", "notes",
          "version", "format", ("ranks", 0, "rank"), ("ranks", 0, "files"), ("first_event", "rank")]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=JSON)
def test_any_manifest_field_of_any_value_is_read_or_refused_with_an_incident_error(scratch, field, value):
    path, manifest = scratch
    changed = copy.deepcopy(manifest)
    *parents, key = field if isinstance(field, tuple) else (field,)
    target = changed
    for parent in parents:
        target = target[parent]
    target[key] = value
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(changed, f)
    try:
        opened = read_incident(path)
    except IncidentError:
        return
    report.summary(opened)  # what a manifest that passed holds, inspect can show
    json.dumps(report.as_json(opened), allow_nan=False)


ATOMS = st.none() | st.integers() | st.text(max_size=4) | st.floats() | st.builds(torch.zeros, st.integers(0, 700))
VALUES = st.recursive(ATOMS, lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                      | st.dictionaries(st.sampled_from(["python", "numpy", "torch", "cuda", "key", "pos"]), inner,
                                        max_size=3), max_leaves=6)


@settings(max_examples=EXAMPLES, deadline=None)
@given(key=st.sampled_from(["python", "numpy", "torch", "cuda", "other"]), value=VALUES)
def test_an_rng_record_that_check_record_passes_restores(key, value):
    import numpy

    numpy.random.rand()  # so that the record holds numpy's state
    record = {**rng_record(rng_snapshot()), key: value}
    saved = rng_snapshot()
    problem = check_record(record)  # never raises
    try:
        if problem is None:
            rng_restore(record)
    finally:
        rng_restore(saved)
    assert problem is None or isinstance(problem, str)


@settings(max_examples=EXAMPLES, deadline=None)
@given(key=st.sampled_from(["model", "optimizer", "extra"]), value=VALUES)
def test_a_state_is_a_checked_dict_or_an_incident_error(key, value):
    state = {"model": {"w": torch.zeros(2)}, "optimizer": {"state": {}, "param_groups": [{"params": [0]}]},
             "extra": {}, key: value}
    try:
        checked = _check_state(state, "state.pt")
    except IncidentError:
        return
    assert isinstance(checked["model"], dict) and all(isinstance(k, str) for k in checked["model"])
    assert checked["optimizer"] is None or isinstance(checked["optimizer"]["param_groups"], list)

