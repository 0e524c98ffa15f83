"""Replay, items 3 and 4: the device comparison (NANGUARD_REPLAY_DEVICE), and one rank's part of
a larger incident replayed alone (NANGUARD_REPLAY_RANK), or refused when the model is sharded."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import nanguard
from nanguard import incident as capture
from nanguard.errors import IncidentError, NanguardError
from nanguard.incident import read_incident, writer
from nanguard.replay import devices
from replay_script import replay, run

GPU = {"host": "gpu-node-7", "devices": ["NVIDIA H100 80GB HBM3"] * 4, "current_device": 3,
       "device_uuids": [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]}


class FlakyKernel(nn.Module):
    """A Linear whose output a faulty device corrupts: one NaN, wherever ``broken`` is set."""

    broken = False

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        if FlakyKernel.broken:
            y = y.clone()
            y[0, 0] = math.nan
        return y


def model():
    return nn.Sequential(nn.Linear(8, 16), FlakyKernel(), nn.Linear(16, 4))


def batch(step: int):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)


@pytest.fixture
def on_a_gpu_node(monkeypatch):
    """The original run's environment.json says it ran on cuda:3 of gpu-node-7 (a CPU stand-in
    for a GPU node, so the comparison can be tested where there is none)."""
    real = writer.environment_record
    monkeypatch.setattr(writer, "environment_record", lambda **kw: {**real(**kw), **GPU})


def test_bad_on_the_original_device_and_clean_elsewhere_points_at_that_device(monkeypatch, on_a_gpu_node,
                                                                              capsys):
    FlakyKernel.broken = True  # the faulty GPU
    err = run(model, batch)
    FlakyKernel.broken = False  # the CPU computes it right
    assert err is not None and err.event.layer == "1"
    report = replay(monkeypatch, err.incident, model, batch, env={"NANGUARD_REPLAY_DEVICE": "cpu"})
    assert report["verdict"] == "not_reproducible" and report["first_event"] is None
    found = report["devices"]
    assert found["finding"] == "device" and found["same_device"] is False
    assert found["original"] == {"rank": 0, "host": "gpu-node-7", "device": "cuda:3",
                                 "name": "NVIDIA H100 80GB HBM3", "uuid": GPU["device_uuids"][3]}
    assert found["replayed"]["device"] == "cpu" and found["replayed"]["bad"] is False
    assert "bad only on the original device, cuda:3 (NVIDIA H100 80GB HBM3) on host gpu-node-7, GPU-00000003" \
        in found["message"]
    assert "CPU and GPU kernels round differently" in found["message"]  # what a CPU-vs-GPU result is worth
    assert report["suspects"] == [{"rank": 0, "host": "gpu-node-7", "device": "NVIDIA H100 80GB HBM3"}]
    assert "device: bad only on the original device" in capsys.readouterr().out


def test_bad_everywhere_points_at_the_code_or_the_data(monkeypatch, on_a_gpu_node):
    FlakyKernel.broken = True  # a bug of the code this time: it corrupts on every device
    try:
        err = run(model, batch)
        report = replay(monkeypatch, err.incident, model, batch, env={"NANGUARD_REPLAY_DEVICE": "cpu"})
    finally:
        FlakyKernel.broken = False
    assert report["verdict"] == "reproducible"
    assert report["devices"]["finding"] == "code_or_data"
    assert "the code or the data, not the device" in report["devices"]["message"]
    # the next replay keeps this one in the incident's history of replays
    report = replay(monkeypatch, err.incident, model, batch)
    assert [r["bad"] for r in report["devices"]["replays"]] == [True, False]
    assert report["devices"]["finding"] == "code_or_data"  # bad on the CPU once is enough


def test_what_the_replays_say_of_the_device():
    original = {"host": "a", "device": "cuda:0", "uuid": "GPU-1"}
    there = {"host": "a", "device": "cuda:0", "name": "H100", "uuid": "GPU-1"}
    elsewhere = {"host": "b", "device": "cuda:1", "name": "H100", "uuid": "GPU-2"}
    cases = [([{**there, "bad": True}, {**elsewhere, "bad": False}], "device", "bad again on the original"),
             ([{**there, "bad": True}], "undecided", "replay on another device"),
             ([{**there, "bad": False}], "undecided", "a transient fault or non-determinism"),
             ([{**elsewhere, "bad": True}], "code_or_data", "not the device"),
             # a replay that ran clean is never said to be bad again (the script was mended between)
             ([{**there, "bad": True}, {**there, "bad": False}], "undecided", "this time; an earlier replay"),
             ([{**elsewhere, "bad": True}, {**elsewhere, "bad": False}], "code_or_data", "(an earlier replay)")]
    for runs, finding, words in cases:
        result = devices.compare(original, runs, near_limit=False)
        assert result["finding"] == finding and words in result["message"], result["message"]
    near = devices.compare({"host": "a", "device": "cuda:0"}, [{**elsewhere, "device": "cpu", "bad": False}],
                           near_limit=True)
    assert "numerics alone may explain it" in near["message"]
    assert devices.earlier_runs({"devices": {"replays": [{"bad": "yes"}, 3, {**there, "bad": True}]}}) == [
        {**there, "bad": True}]
    assert devices.earlier_runs({"devices": []}) == [] and devices.earlier_runs(None) == []


def test_a_device_that_cannot_be_used_is_refused_clearly(monkeypatch):
    with pytest.raises(nanguard.ConfigError, match="replay_device"):
        nanguard.init(nn.Linear(2, 2), replay_device="CPU!")
    with pytest.raises(NanguardError, match="not a device torch knows"):
        devices.parse("warp:0")
    if not torch.cuda.is_available():
        with pytest.raises(NanguardError, match="no CUDA device"):
            devices.parse("cuda:3")

    class DistributedDataParallel(nn.Module):  # what is_wrapper() knows DDP by
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(NanguardError, match="keeps its state on cpu"):
        devices.move(DistributedDataParallel(nn.Linear(2, 2)), torch.device("meta"))
    assert devices.move(nn.Linear(2, 2), torch.device("cpu")) is None  # already there


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_script_replayed_on_the_cpu(monkeypatch):
    def on_gpu():
        return model().cuda()

    def gpu_batch(step):
        x, y = batch(step)
        return x.cuda(), y.cuda()

    FlakyKernel.broken = True
    err = run(on_gpu, gpu_batch)
    FlakyKernel.broken = False
    report = replay(monkeypatch, err.incident, on_gpu, gpu_batch, env={"NANGUARD_REPLAY_DEVICE": "cpu"})
    found = report["devices"]
    assert found["original"]["device"].startswith("cuda:") and found["replayed"]["device"] == "cpu"
    assert found["finding"] == "device" and report["first_event"] is None
    assert any("where its outputs were handed back" in note for note in report["notes"])
    run_on_device = replay(monkeypatch, err.incident, on_gpu, gpu_batch)  # on the original GPU: clean too
    assert run_on_device["devices"]["replayed"]["uuid"].startswith("GPU-")


# ---------------------------------------------------------------------- one rank alone
def poisoned(step: int):
    x, y = batch(step)
    if step == 2:
        x[2, 3] = math.nan
    return x, y


def two_rank_incident(tmp_path, sharded: str | None = None) -> str:
    """A 2-rank incident whose rank 1 saw a NaN in its batch, built from a 1-rank capture of
    rank 1's part (same weights on both ranks: the model is not sharded)."""
    err = run(model, poisoned)
    one = read_incident(err.incident)
    path = capture.new_incident_dir(str(tmp_path), "two-ranks")
    records = []
    for rank in (0, 1):
        batches = one.rank_batches(0) if rank == 1 else [{"args": (batch(2)[0],), "kwargs": {}}]
        events = [dataclasses.replace(e, rank=rank) for e in one.rank_events(0)] if rank == 1 else []
        records.append(capture.write_rank(path, rank, model_state=one.rank_state(0)["model"],
                                          optimizer_state=one.rank_state(0)["optimizer"], batches=batches,
                                          rng=one.rank_rng(0), events=events,
                                          environment={**one.environment(0), "rank": rank, "world_size": 2}))
    capture.finalize(path, world_size=2, step=one.step, first_event=dataclasses.replace(one.first_event, rank=1),
                     rank_records=records, capture_batch=True, sharded=sharded)
    return path


def test_one_rank_of_a_larger_incident_replays_alone(monkeypatch, tmp_path):
    path = two_rank_incident(tmp_path)
    report = replay(monkeypatch, path, model, batch)
    assert report["verdict"] == "reproducible", report["message"]
    assert report["first_event"]["rank"] == 1  # the rank whose part ran, not this process's
    assert report["layout"] == {"incident_world_size": 2, "replayed_ranks": [1], "alone": True}
    assert sorted(report["trace"]) == ["1"]
    assert any("rank 1's part was replayed alone" in note and "all-reduce" in note for note in report["notes"])
    assert report["samples"]["1"]["micro_batches"][0]["bad"] == [2]
    # another rank, by choice: it cannot reproduce rank 1's event, and does not blame the hardware
    report = replay(monkeypatch, path, model, batch, env={"NANGUARD_REPLAY_RANK": "0"})
    assert report["verdict"] == "not_reproducible" and report["suspects"] == []
    assert "rank 0 was replayed alone and the original" in report["message"]
    assert report["devices"]["finding"] == "not_compared"


def test_a_sharded_or_misfitting_layout_is_refused(monkeypatch, tmp_path):
    path = two_rank_incident(tmp_path, sharded="fsdp2: each rank's state.pt holds its own shards")
    monkeypatch.setenv("NANGUARD_REPLAY", path)
    with pytest.raises(IncidentError, match="sharded model .fsdp2.*cannot run alone.*--nproc-per-node 2"):
        nanguard.init(nn.Linear(2, 2))
    monkeypatch.delenv("NANGUARD_REPLAY")
    path = two_rank_incident(tmp_path)
    monkeypatch.setenv("NANGUARD_REPLAY", path)
    monkeypatch.setenv("NANGUARD_REPLAY_RANK", "5")
    with pytest.raises(IncidentError, match="has no rank 5"):
        nanguard.init(nn.Linear(2, 2))
    monkeypatch.delenv("NANGUARD_REPLAY_RANK")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(IncidentError, match="one of 3.*or with one process"):
        nanguard.init(nn.Linear(2, 2))
