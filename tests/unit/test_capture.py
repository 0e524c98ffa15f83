"""Incident folders: round trip, never overwriting, and every way a folder can be bad."""

import collections
import dataclasses
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import time
import typing

import numpy as np
import pytest
import torch
from torch import nn

from nanguard import Event
from nanguard import incident as capture
from nanguard.incident import IncidentError, finalize, fsio, new_incident_dir, read_incident, write_rank
from nanguard.incident import inspection as inspect


class Pair(typing.NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass(frozen=True)
class Sample:
    tokens: torch.Tensor
    mask: torch.Tensor | None
    meta: dict


def first_event(**kw):
    base = dict(kind="forward", rank=1, step=7, layer="blocks.2.mlp", module_type="Linear", has_nan=True,
                input_nonfinite=False, output_nonfinite=True, shape=(4, 16), numel=64, bad_count=3,
                nan_count=3, inf_count=0, first_index=(0, 5), first_value=math.nan, host="node-b")
    base.update(kw)
    return Event(**base)


def rank_inputs(rank):
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    # an AdamW state_dict's shape, built by hand: a real optimizer's first use imports
    # torch._dynamo, seconds that this test file need not pay
    optimizer_state = {
        "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(3, 4),
                      "exp_avg_sq": torch.rand(3, 4)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                          "amsgrad": False, "foreach": None, "params": [0, 1, 2, 3]}],
    }
    shared = torch.randn(2, 4, dtype=torch.float16)
    batches = capture.to_cpu([
        {"args": (Pair(torch.randn(3, 4), "a"), [1, 2.5, None]), "kwargs": {"mask": shared, "again": shared}},
        {"args": (Sample(torch.arange(6), None, {"ids": [torch.ones(2, dtype=torch.int64)], "n": 3}),),
         "kwargs": {"mode": "train", "scale": 0.5}},
    ])
    return dict(
        model_state=model.state_dict(),
        optimizer_state=optimizer_state,
        extra_states={"scaler": {"scale": 65536.0, "_growth_tracker": 3}},
        batches=batches,
        rng=capture.rng_snapshot(),
        events=[first_event(rank=rank)],
        environment=capture.environment_record(rank=rank, world_size=2, settings={"on_nan": "raise",
                                                                                  "spike": math.inf}),
    )


def make_incident(root, world_size=2, capture_batch=True, name="job-step7"):
    """A complete incident on disk; returns (folder, the inputs each rank wrote)."""
    path = new_incident_dir(str(root), name)
    inputs, records = [], []
    for rank in range(world_size):
        kw = rank_inputs(rank)
        if not capture_batch:
            kw["batches"] = None
        inputs.append(kw)
        records.append(write_rank(path, rank, **kw))
    finalize(path, world_size=world_size, step=7, first_event=first_event().to_dict(), rank_records=records,
             capture_batch=capture_batch, sharded=None, notes={"policy": "raise"})
    return path, inputs


def assert_equal_tree(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.device.type == "cpu" and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_equal_tree(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_tree(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_equal_tree(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


def test_two_rank_round_trip(tmp_path):
    path, inputs = make_incident(tmp_path)
    incident = read_incident(path)
    assert (incident.name, incident.step, incident.world_size) == ("job-step7", 7, 2)
    assert incident.first_event.to_dict() == first_event().to_dict()  # to_dict: NaN != NaN
    assert sorted(os.listdir(path)) == ["manifest.json", "rank0", "rank1"]
    for rank, kw in enumerate(inputs):
        state = incident.rank_state(rank)
        assert_equal_tree(state["model"], kw["model_state"])
        assert_equal_tree(state["optimizer"], kw["optimizer_state"])
        assert state["extra"] == kw["extra_states"]
        batches = incident.rank_batches(rank)
        assert_equal_tree(batches, kw["batches"])
        assert batches[0]["kwargs"]["mask"] is batches[0]["kwargs"]["again"]  # aliasing survives
        assert [e.to_dict() for e in incident.rank_events(rank)] == [e.to_dict() for e in kw["events"]]
        env = incident.environment(rank)
        assert env["rank"] == rank and env["world_size"] == 2 and env["torch"] == torch.__version__
        assert env["settings"] == {"on_nan": "raise", "spike": "inf"}
    manifest = incident.manifest
    assert manifest["format"] == "nanguard-incident" and manifest["version"] == capture.FORMAT_VERSION
    assert manifest["capture_batch"] is True and manifest["replay"] is None
    names = ("state.pt", "batches.pt", "rng.pt", "events.json", "environment.json")
    assert set(manifest["ranks"][1]["files"]) == {f"rank1/{name}" for name in names}


def test_rng_restore_reproduces_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    kw = rank_inputs(0)  # draws from the generators before the snapshot is taken
    snapshot = capture.rng_snapshot()
    expected = (torch.rand(4), random.random(), np.random.rand(3), np.random.randn())
    path = new_incident_dir(str(tmp_path), "rng")
    write_rank(path, 0, **{**kw, "rng": snapshot})
    torch.rand(10), random.random(), np.random.rand(5)  # move every generator on
    loaded = torch.load(os.path.join(path, "rank0", "rng.pt"), weights_only=True)
    assert capture.rng_restore(loaded) == []
    again = (torch.rand(4), random.random(), np.random.rand(3), np.random.randn())
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]
    assert np.array_equal(expected[2], again[2]) and expected[3] == again[3]


def test_rng_restore_notes_missing_gpus():
    snapshot = capture.rng_snapshot()
    snapshot["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    notes = capture.rng_restore(snapshot)
    assert len(notes) == 1 and "2 of 2 device(s)" in notes[0]


def test_to_cpu_copies_tensors_and_keeps_containers():
    grad = torch.ones(3, requires_grad=True)
    ordered = collections.OrderedDict(b=grad * 2, a=1)
    counts = collections.defaultdict(list, {"x": [torch.zeros(1)]})
    view = torch.arange(100.0)[10:12]
    out = capture.to_cpu((ordered, counts, Pair(view, "v"), torch.Size([2, 3]), "text", 4, None))
    assert type(out[0]) is collections.OrderedDict and list(out[0]) == ["b", "a"]
    assert not out[0]["b"].requires_grad and torch.equal(out[0]["b"], grad * 2)
    assert type(out[1]) is collections.defaultdict and out[1].default_factory is list
    assert type(out[2]) is Pair and out[2].label == "v"
    assert out[2].x.untyped_storage().nbytes() == 2 * 4  # a copy, not the 100-element storage
    assert out[3] == torch.Size([2, 3]) and out[4:] == ("text", 4, None)
    view.add_(1)  # the training code changes its batch later: the capture does not move
    assert torch.equal(out[2].x, torch.tensor([10.0, 11.0]))


def test_incident_id_is_a_safe_folder_name():
    assert capture.incident_id("run/ 42:x", 7) == "run_42_x-step7"
    assert capture.incident_id(None, 3) == "step3" and capture.incident_id("", 3) == "step3"
    assert capture.incident_id("../..", 1) == "step1"
    assert capture.incident_id("a" * 500, 12) == "a" * 64 + "-step12"


def test_never_overwrites_an_incident(tmp_path):
    path, _ = make_incident(tmp_path, world_size=1, name="job-step7")
    incomplete = new_incident_dir(str(tmp_path), "job-step7")
    later = new_incident_dir(str(tmp_path), "job-step7")
    names = [os.path.basename(p) for p in (path, incomplete, later)]
    assert names == ["job-step7", "job-step7-2", "job-step7-3"]
    with pytest.raises(IncidentError, match="already exists") as info:
        write_rank(path, 0, **rank_inputs(0))
    assert info.value.path == os.path.join(path, "rank0")
    with pytest.raises(IncidentError, match="already exists"):
        finalize(path, world_size=1, step=7, first_event=first_event(), rank_records=[], capture_batch=True,
                 sharded=None)
    read_incident(path)  # untouched


def test_finalize_needs_every_rank(tmp_path):
    path = new_incident_dir(str(tmp_path), "job-step7")
    record = write_rank(path, 0, **rank_inputs(0))
    with pytest.raises(IncidentError, match=r"ranks \[0\] for a world size of 2.*no manifest was written"):
        finalize(path, world_size=2, step=7, first_event=first_event(), rank_records=[record],
                 capture_batch=True, sharded=None)
    fake = {"rank": 1, "files": {k.replace("rank0", "rank1"): v for k, v in record["files"].items()}}
    with pytest.raises(IncidentError, match="rank1.*missing.*filesystem every node shares") as info:
        finalize(path, world_size=2, step=7, first_event=first_event(), rank_records=[record, fake],
                 capture_batch=True, sharded=None)
    assert info.value.path == os.path.join(path, "rank1")
    assert not os.path.exists(os.path.join(path, "manifest.json"))


def test_capture_batch_false_writes_no_batch(tmp_path):
    path, _ = make_incident(tmp_path, capture_batch=False)
    incident = read_incident(path)
    assert incident.manifest["capture_batch"] is False and incident.rank_batches(0) is None
    assert "batches.pt" not in os.listdir(os.path.join(path, "rank0"))


def test_a_failed_write_leaves_nothing(tmp_path):
    path = new_incident_dir(str(tmp_path), "job-step7")
    kw = rank_inputs(0)
    kw["model_state"] = {"w": lambda x: x}  # cannot be pickled (batches are kept as data: a lambda there is only named)
    with pytest.raises(IncidentError, match="could not be written.*nothing of it was left behind"):
        write_rank(path, 0, **kw)
    assert os.listdir(path) == []


def test_sharded_note_is_kept(tmp_path):
    path = new_incident_dir(str(tmp_path), "fsdp")
    note = "fsdp2: each rank holds its shard; load rank k's state.pt on rank k with the same world size"
    finalize(path, world_size=1, step=7, first_event=first_event(rank=0), sharded=note, capture_batch=True,
             rank_records=[write_rank(path, 0, **rank_inputs(0))])
    assert read_incident(path).manifest["sharded"] == note


# --- bad folders ------------------------------------------------------------------------------


def flip_byte(path, offset=-10):
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_tampered_file_is_named(tmp_path):
    path, _ = make_incident(tmp_path)
    target = os.path.join(path, "rank1", "state.pt")
    flip_byte(target)
    with pytest.raises(IncidentError, match="sha256.*tampered or truncated") as info:
        read_incident(path)
    assert info.value.path == target and "rank1/state.pt" in str(info.value)
    read_incident(path, verify=False)  # same size: only the hash tells


def test_truncated_file_is_named(tmp_path):
    path, _ = make_incident(tmp_path)
    target = os.path.join(path, "rank0", "batches.pt")
    os.truncate(target, 100)
    with pytest.raises(IncidentError, match="is 100 bytes, the manifest says .*truncated") as info:
        read_incident(path, verify=False)
    assert info.value.path == target


def test_missing_rank_folder(tmp_path):
    path, _ = make_incident(tmp_path)
    shutil.rmtree(os.path.join(path, "rank1"))
    with pytest.raises(IncidentError, match="missing: the manifest lists rank 1") as info:
        read_incident(path)
    assert info.value.path.endswith("rank1")


def test_missing_file(tmp_path):
    path, _ = make_incident(tmp_path)
    os.remove(os.path.join(path, "rank0", "rng.pt"))
    with pytest.raises(IncidentError, match="rng.pt: missing"):
        read_incident(path)


def edit_manifest(path, change):
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    change(manifest)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(version=3), "format version 3 is not supported.*upgrade nanguard"),
    (lambda m: m.update(version="1"), "format version '1' is not supported"),
    (lambda m: m.update(format="other"), "not a nanguard incident manifest"),
    (lambda m: m.pop("ranks"), "field 'ranks' is missing"),
    (lambda m: m["ranks"][0]["files"].update({"rank0/../../etc": m["ranks"][0]["files"]["rank0/rng.pt"]}),
     "unexpected file"),
    (lambda m: m["ranks"][0]["files"].pop("rank0/state.pt"), "rank 0's record lacks state.pt"),
    (lambda m: m["first_event"].update(kind="boom"), "first_event is not a valid event"),
])
def test_bad_manifest(tmp_path, change, message):
    path, _ = make_incident(tmp_path, world_size=1)
    edit_manifest(path, change)
    with pytest.raises(IncidentError, match=message) as info:
        read_incident(path)
    assert info.value.path.endswith("manifest.json")


def test_manifest_not_json(tmp_path):
    path, _ = make_incident(tmp_path, world_size=1)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write('{"format": "nanguard-inc')
    with pytest.raises(IncidentError, match="is not valid JSON"):
        read_incident(path)


def test_missing_folder(tmp_path):
    with pytest.raises(IncidentError, match="no such incident folder"):
        read_incident(str(tmp_path / "nope"))


def test_record_replay(tmp_path):
    path, _ = make_incident(tmp_path)
    report = {"verdict": "reproducible", "first_event": first_event().to_dict(), "max": math.inf}
    capture.record_replay(path, report)
    incident = read_incident(path)
    assert incident.manifest["replay"]["verdict"] == "reproducible"
    assert incident.replay_report() == {**report, "max": "inf"}
    with pytest.raises(IncidentError, match="verdict 'maybe' is not one of"):
        capture.record_replay(path, {"verdict": "maybe"})
    flip_byte(os.path.join(path, "replay.json"), offset=-3)
    with pytest.raises(IncidentError, match="replay.json: sha256"):
        read_incident(path)


# --- a process killed mid-capture ------------------------------------------------------------
# A forked child rather than `python -c`: importing torch takes seconds, a fork milliseconds.
# The child only writes files (no torch compute: OpenMP's thread pool does not survive a fork),
# so its inputs are built here, before the fork.


def _crash_child(path, stage, inputs, ready):
    def hang():
        ready.set()
        time.sleep(60)

    records = [write_rank(path, 0, **inputs[0])]
    if stage == "rank":
        real = fsio.atomic_write

        def slow(file, write):  # hangs after the first file of rank 1
            record = real(file, write)
            hang()
            return record

        fsio.atomic_write = slow
        write_rank(path, 1, **inputs[1])
    else:
        records.append(write_rank(path, 1, **inputs[1]))
        real = os.replace

        def slow(src, dst):  # hangs with the manifest written, before its rename
            if dst.endswith("manifest.json"):
                hang()
            return real(src, dst)

        os.replace = slow
        finalize(path, world_size=2, step=7, first_event=first_event(), rank_records=records,
                 capture_batch=True, sharded=None)


def kill_during(tmp_path, stage):
    path = new_incident_dir(str(tmp_path), "job-step7")
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_crash_child, args=(path, stage, [rank_inputs(0), rank_inputs(1)], ready))
    child.start()
    try:
        deadline = time.monotonic() + 20
        while not ready.wait(0.05):
            assert child.is_alive(), f"the child died (exit code {child.exitcode}) before the kill point"
            assert time.monotonic() < deadline, "the child never reached the kill point"
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    assert child.exitcode == -signal.SIGKILL
    return path, child.pid


@pytest.mark.parametrize("stage", ["rank", "manifest"])
def test_killed_mid_capture_is_incomplete(tmp_path, stage, capsys):
    path, pid = kill_during(tmp_path, stage)
    left = sorted(os.listdir(path))
    if stage == "rank":
        assert left == [f".rank1.tmp-{pid}", "rank0"]
        assert os.listdir(os.path.join(path, f".rank1.tmp-{pid}")) == ["state.pt"]
    else:
        assert left == [f"manifest.json.tmp-{pid}", "rank0", "rank1"]
    incomplete = "incomplete: no manifest.json; the capture did not finish"
    with pytest.raises(IncidentError, match=incomplete) as info:
        read_incident(path)
    assert info.value.path == os.path.join(path, "manifest.json") and left[0] in info.value.reason
    assert inspect.main([path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nanguard inspect: {path}/manifest.json: incomplete") and err.count("\n") == 1


def test_the_incident_package_exports_exactly_its_public_names():
    assert capture.__all__ == sorted(capture.__all__)
    assert set(capture.__all__) == {
        "BATCHES", "ENVIRONMENT", "EVENTS", "FORMAT", "FORMAT_VERSION", "MANIFEST", "REPLAY", "RNG", "STATE",
        "VERDICTS", "Collectives", "Incident", "IncidentError", "RankPart", "capture_incident",
        "environment_record", "finalize", "incident_id", "new_incident_dir", "read_incident", "record_replay",
        "rng_restore", "rng_snapshot", "to_cpu", "to_device", "write_rank"}
    assert all(hasattr(capture, name) for name in capture.__all__)
