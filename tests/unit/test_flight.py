"""The flight recorder: the last steps before an incident, kept with it, memory fixed."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_mlp, train_step

import nanguard
from nanguard.incident import read_incident
from nanguard.rank.flight import FlightRecorder


def test_the_steps_before_an_incident_are_kept_with_it():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with nanguard.init(model, optimizer, flight_steps=8) as guard:
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(20):
                model[2].armed = step == 14
                train_step(model, optimizer, guard)
    flight = read_incident(info.value.incident).rank_flight(0)
    assert flight["version"] == 1 and flight["columns"] == ["step", "loss", "grad_norm", "scale", "lr", "step_time_s"]
    steps = [row[0] for row in flight["rows"]]
    assert steps == list(range(7, 15))  # the last eight, the incident's step last
    clean, bad = flight["rows"][-2], flight["rows"][-1]
    assert clean[1] > 0 and clean[2] > 0 and clean[4] == 0.05 and clean[3] is None
    assert bad[2] is None  # no gradient norm on the bad step
    assert [entry["step"] for entry in flight["top_params"]] == list(range(7, 15))  # the bad step too
    assert set(flight["top_params"][-1]["params"]) <= {"0.weight", "0.bias", "2.lin.weight", "2.lin.bias",
                                                       "4.weight", "4.bias"}


def test_the_gradscaler_scale_is_recorded():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with nanguard.init(model, optimizer, scaler=scaler) as guard:
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(4):
                model[2].armed = step == 3
                loss = torch.nn.functional.cross_entropy(model(torch.randn(5, 8)), torch.randint(0, 4, (5,)))
                guard.check(loss)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
    rows = read_incident(info.value.incident).rank_flight(0)["rows"]
    assert [row[3] for row in rows[:3]] == [1024.0, 1024.0, 1024.0]


def test_no_recorder_no_file(tmp_path):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model[2].armed = True
    with nanguard.init(model, optimizer, flight_steps=0), pytest.raises(nanguard.NonFiniteError) as info:
        train_step(model, optimizer)
    assert read_incident(info.value.incident).rank_flight(0) is None


def test_memory_is_fixed_and_nan_norms_rank_first():
    recorder = FlightRecorder(3)
    params = [torch.zeros(1), torch.zeros(1)]
    names = {id(params[0]): "a", id(params[1]): "b"}
    for step in range(10):
        recorder.record(step, loss=1.0, grad_norm=2.0, scale=None, lr=None, step_time_s=0.1,
                        norms=[1.0, math.nan if step == 9 else 0.5], params=params, name=lambda p: names[id(p)])
    data = recorder.to_dict()
    assert len(recorder) == 3 and [row[0] for row in data["rows"]] == [7, 8, 9]
    last = data["top_params"][-1]["params"]
    assert list(last.values())[0] is None  # the NaN norm, first, written as null
