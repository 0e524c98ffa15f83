"""Batches on disk are data: a crafted incident cannot run code, and what a script feeds comes back
as it was fed, or a note says how it differs."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import pickle
import typing
from collections import OrderedDict, UserDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_capture import first_event, make_incident

from nanguard.incident import IncidentError, read_incident
from nanguard.incident.batches import TAG, Missing, decode, encode
from nanguard.replay.fill import fill, incomplete


class Encoding(UserDict):
    """Shaped like Hugging Face's BatchEncoding: a UserDict with attributes of its own."""

    def __init__(self, data=None, n_sequences=None):
        super().__init__(data)
        self._n_sequences = n_sequences

    def __getattr__(self, item):
        try:
            return self.data[item]
        except KeyError:
            raise AttributeError(item) from None


@dataclasses.dataclass
class Output(OrderedDict):
    """Shaped like transformers' ModelOutput: an OrderedDict and a dataclass at once."""

    logits: torch.Tensor = None
    loss: torch.Tensor | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)


Old = collections.namedtuple("Old", "a")


class Point(typing.NamedTuple):
    x: torch.Tensor
    y: float


@dataclasses.dataclass(frozen=True)
class Frozen:
    ids: torch.Tensor
    tag: str


def round_trip(obj):
    notes = []
    path_free = decode(torch_round_trip(encode(obj)), notes)
    return path_free, notes


def torch_round_trip(data, tmp=None):
    import io

    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_the_containers_models_are_fed_come_back_as_they_were():
    shared = torch.randn(3)
    batch = {"args": (Encoding({"input_ids": torch.arange(4), "mask": shared}, n_sequences=1),
                      Point(shared, 0.5), Frozen(torch.ones(2), "t"), np.arange(3.0), torch.Size([2, 3])),
             "kwargs": {"out": Output(logits=torch.zeros(2)), "order": OrderedDict(a=1), 7: "int key",
                        "dtype": torch.float16}}
    back, notes = round_trip(batch)
    assert notes == []
    encoding, point, frozen, array, size = back["args"]
    assert type(encoding) is Encoding and encoding.input_ids.tolist() == [0, 1, 2, 3] and encoding._n_sequences == 1
    assert type(point) is Point and point.y == 0.5 and point.x is encoding["mask"]  # aliasing kept
    assert type(frozen) is Frozen and frozen.tag == "t"
    assert isinstance(array, np.ndarray) and array.tolist() == [0.0, 1.0, 2.0]
    assert size == torch.Size([2, 3])
    out = back["kwargs"]["out"]
    assert type(out) is Output and out.logits.tolist() == [0.0, 0.0] and list(out) == ["logits"]
    assert back["kwargs"]["order"] == OrderedDict(a=1) and back["kwargs"][7] == "int key"
    assert back["kwargs"]["dtype"] is torch.float16


def test_what_cannot_be_kept_is_named_and_read_back_as_missing():
    back, notes = round_trip({"args": (torch.ones(1), object()), "kwargs": {"fn": len}})
    assert type(back["args"][1]) is Missing and type(back["kwargs"]["fn"]) is Missing
    assert "builtins.object" in back["args"][1].what and "builtin_function_or_method" in back["kwargs"]["fn"].what
    assert len(notes) == 2 and "builtins.object" in notes[0] and "the script's own value" in notes[0]


def test_a_missing_value_is_filled_from_the_same_place_in_the_scripts_call():
    point = Point(torch.zeros(1), Missing("a lost tensor"))
    captured = (torch.ones(2), Missing("an object"), {"mask": Missing("a mask"), "ids": torch.arange(3)}, point)
    own = (torch.zeros(2), "own object", {"mask": "own mask", "ids": torch.zeros(3)}, Point(1, 2))
    filled = fill(captured, own)
    assert filled[0] is captured[0] and filled[1] == "own object"
    assert filled[2]["mask"] == "own mask" and filled[2]["ids"] is captured[2]["ids"]
    assert filled[3] is own[3]  # another kind of container lacking a value: the script's, whole
    # where the script's call has nothing at that place (or another shape), None
    assert fill(captured, ()) == (captured[0], None, {"mask": None, "ids": captured[2]["ids"]}, None)
    assert fill({"mask": Missing("m")}, [1]) == {"mask": None}
    complete = (torch.ones(1), {"a": 1})
    assert fill(complete, ()) is complete and not incomplete(complete) and incomplete(captured)


def test_a_class_the_script_has_not_imported_is_fed_as_its_plain_equivalent():
    data = encode(Point(torch.ones(1), 2.0))
    data["type"] = "not_imported_anywhere:Point"
    notes = []
    back = decode(data, notes)
    assert type(back) is tuple and back[1] == 2.0
    assert "has not imported" in notes[0] and "plain tuple" in notes[0]


_ATOM = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6) | st.binary(max_size=6)
_TYPE = st.text(max_size=12) | st.sampled_from(
    ["builtins:dict", "builtins:tuple", "collections:OrderedDict", "collections:Counter", "os:system",
     "torch:Tensor", "test_incident_batches:Point", "test_incident_batches:Frozen",
     "test_incident_batches:Output", "test_incident_batches:Encoding", "typing:NamedTuple"])


def _tagged(children):
    """A dict shaped like an entry ``encode`` writes, with any tag and any (or missing) fields."""
    return st.fixed_dictionaries(
        {TAG: st.sampled_from(["tuple", "list", "mapping", "dataclass", "ndarray", "unsupported", "other"])},
        optional={"type": _TYPE, "items": st.lists(children, max_size=3), "keys": st.lists(children, max_size=3),
                  "values": st.lists(children, max_size=3), "repr": _ATOM, "why": _ATOM,
                  "state": st.dictionaries(st.text(max_size=4), children, max_size=2),
                  "fields": st.dictionaries(st.text(max_size=4), children, max_size=3),
                  "tensor": st.just(torch.zeros(2)) | _ATOM})


@settings(max_examples=int(os.environ.get("NANGUARD_FUZZ_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@example({TAG: "mapping", "type": "builtins:dict", "keys": [None], "values": [None], "state": {"a": 1}})
@example({TAG: "mapping", "type": "test_incident_batches:Encoding", "keys": [], "values": [], "state": {"x": []}})
@given(st.recursive(_ATOM, lambda children: st.lists(children, max_size=3) | st.tuples(children)
                    | st.dictionaries(st.text(max_size=4), children, max_size=3) | _tagged(children), max_leaves=25))
def test_any_data_in_a_batches_file_decodes_or_is_refused(data):
    # what rank_batches turns into an IncidentError ("damaged or crafted") is ValueError and
    # TypeError; anything else would escape as a crash of `nanguard replay`
    notes = []
    try:
        back = decode(data, notes)
    except (ValueError, TypeError):
        return
    assert all(isinstance(note, str) for note in notes)
    # and what a replay feeds from it, filled from a script's call of any shape, lacks nothing
    for own in (back, (), {"x": 1}, [None] * 3):
        assert not incomplete(fill(back, own)) or incomplete(own)


def test_a_crafted_entry_never_builds_an_unrelated_class():
    # a tag naming a class that is imported but not a tuple: nothing is constructed
    data = {"__nanguard__": "tuple", "type": "subprocess:Popen", "items": [["touch", "/tmp/pwned"]]}
    notes = []
    assert decode(data, notes) == (["touch", "/tmp/pwned"],)
    assert "not a tuple" in notes[0]
    with pytest.raises(ValueError, match="unknown batch tag"):
        decode({"__nanguard__": "exec", "code": "x"}, [])
    with pytest.raises(ValueError, match="no valid 'items'"):
        decode({"__nanguard__": "tuple", "type": "builtins:tuple"}, [])


class Boom:
    def __reduce__(self):
        return (os.system, ("touch boom-ran",))


def replace_batches(path, rank, payload: bytes, version=None):
    """Swap a rank's batches.pt and make the manifest vouch for it, as someone with write access
    to the folder could."""
    file = os.path.join(path, f"rank{rank}", "batches.pt")
    with open(file, "wb") as f:
        f.write(payload)
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    entry = manifest["ranks"][rank]["files"][f"rank{rank}/batches.pt"]
    entry.update(size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    if version is not None:
        manifest["version"] = version
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("version", [1, 2])
def test_a_crafted_batches_file_is_refused_and_runs_nothing(tmp_path, monkeypatch, version):
    monkeypatch.chdir(tmp_path)
    path, _ = make_incident(tmp_path / "incidents")
    replace_batches(path, 0, pickle.dumps([{"args": (Boom(),), "kwargs": {}}]), version=version)
    incident = read_incident(path)  # the sha256 values match: they are no signature
    with pytest.raises(IncidentError, match="nothing was loaded"):
        incident.rank_batches(0)
    assert not (tmp_path / "boom-ran").exists()


def test_an_old_incident_with_pickled_batches_says_why_it_is_not_loaded(tmp_path):
    path, _ = make_incident(tmp_path)
    old = pickle.dumps([{"args": (Old(1),), "kwargs": {}}])
    replace_batches(path, 1, old, version=1)
    with pytest.raises(IncidentError, match="nanguard 0.1.*does not unpickle.*nothing was loaded"):
        read_incident(path).rank_batches(1)


def test_an_incident_of_this_version_reads_back_with_first_event(tmp_path):
    path, inputs = make_incident(tmp_path)
    notes = []
    batches = read_incident(path).rank_batches(0, notes)
    assert notes == [] and len(batches) == len(inputs[0]["batches"])
    assert read_incident(path).first_event.to_dict() == first_event().to_dict()
