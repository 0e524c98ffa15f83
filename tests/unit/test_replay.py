"""Replay: a captured step run again from its incident, with the verdict it must reach.

Each test runs "the script" (``train``) twice in this process, as a user would run it twice:
once to make the incident, once with ``NANGUARD_REPLAY`` set, which ends with SystemExit(0)
at the replayed step's optimizer step.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import nanguard
from nanguard.incident import IncidentError, read_incident

REPO = pathlib.Path(__file__).resolve().parents[2]


class Sqrt(nn.Module):
    """sqrt of a linear map: NaN wherever the map goes negative (a deterministic bug)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.sqrt(self.lin(x))


class UnluckyDropout(nn.Module):
    """Drops to NaN (not zero) when a random draw falls under ``p``: the NaN depends on the RNG."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        draw = torch.rand(())
        return x * torch.where(draw < self.p, torch.tensor(math.nan), torch.tensor(1.0))


class Transient(nn.Module):
    """Writes a NaN once, the first time it is armed (a bit flip that never comes back)."""

    fired = False

    def __init__(self, width: int, at_step: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.at_step = at_step
        self.calls = 0

    def forward(self, x):
        y = self.lin(x)
        self.calls += 1
        if self.calls == self.at_step + 1 and not Transient.fired:
            Transient.fired = True
            y = y.clone()
            y[0, 0] = math.nan
        return y


class ByKeyword(nn.Module):
    """Hands its child a NaN by keyword, as transformers hands its attention ``hidden_states=``: its own
    code makes the NaN (a log of the tanh's negative outputs), the child only passes it on."""

    def __init__(self, width: int):
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x):
        return self.inner(input=torch.log(x))


def data(step: int, micro: int = 0, bad_sample_at: int | None = None, nan_at=None):
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(6, 8, generator=gen)
    y = torch.randint(0, 4, (6,), generator=gen)
    if bad_sample_at == step:
        x[3, 5] = math.nan  # one bad sample in the loader's batch
    if nan_at == (step, micro):
        x[1, 2] = math.nan  # one micro-batch's bad sample
    return x, y


def train(middle: nn.Module, *, steps: int = 12, accumulate: int = 1, init_kwargs=None,
          seed: int = 0, **data_kwargs):
    """The user's script: returns the weights before each step and how it ended."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), middle, nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = nanguard.init(model, optimizer, **(init_kwargs or {}))
    before = []
    try:
        for step in range(steps):
            before.append(copy.deepcopy(model.state_dict()))
            for micro in range(accumulate):
                x, y = data(step, micro, **data_kwargs)
                loss = nn.functional.cross_entropy(model(x), y) / accumulate
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return before, None
    except nanguard.NonFiniteError as err:
        return before, err
    finally:
        guard.close()


def replay(monkeypatch, incident: str, middle: nn.Module, capsys=None, **kwargs) -> dict:
    monkeypatch.setenv("NANGUARD_REPLAY", incident)
    with pytest.raises(SystemExit) as exit_info:
        train(middle, **kwargs)
    assert exit_info.value.code == 0
    monkeypatch.delenv("NANGUARD_REPLAY")
    report = read_incident(incident).replay_report()
    assert report is not None, "the replay wrote no report"
    return report


def assert_captured_before(err, before):
    """The incident holds the weights from before the bad step: finite, and equal to them."""
    state = read_incident(err.incident).rank_state(0)["model"]
    expected = before[err.event.step]
    assert set(state) == set(expected)
    for name, value in state.items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, expected[name]), f"{name} differs from the weights before step {err.event.step}"


def test_the_replays_trace_reads_a_modules_keyword_inputs(monkeypatch):
    before, err = train(ByKeyword(16))
    assert err is not None and (err.event.layer, err.event.input_nonfinite) == ("2.inner", True), err.event
    report = replay(monkeypatch, err.incident, ByKeyword(16))
    assert report["verdict"] == "reproducible"
    first = report["trace"]["0"]["forward"][0]
    assert (first["module"], first["inputs_finite"]) == ("2.inner", False)  # not its producer: it was handed it


def test_deterministic_bug_is_reproducible(monkeypatch, capsys):
    before, err = train(Sqrt(16))
    assert err is not None and err.event.kind == "forward"
    assert err.event.layer == "2" and err.event.input_nonfinite is False  # sqrt made it
    assert_captured_before(err, before)
    report = replay(monkeypatch, err.incident, Sqrt(16))
    assert report["verdict"] == "reproducible"
    assert report["first_event"]["layer"] == err.event.layer
    assert report["first_event"]["step"] == err.event.step
    assert report["suspects"] == []
    first = report["trace"]["0"]["forward"][0]
    assert first["module"] == "2" and first["inputs_finite"] is True  # the synchronous trace agrees
    assert first["output"]["bad_count"] > 0
    out = capsys.readouterr().out
    assert "reproducible" in out and err.incident in out
    from nanguard.incident.inspection import main as inspect_main

    assert inspect_main([err.incident]) == 0
    assert "trace        rank 0 forward: 2 (Sqrt, producer, micro-batch 0)" in capsys.readouterr().out


def test_bad_sample_in_the_batch(monkeypatch):
    before, err = train(nn.Linear(16, 16), bad_sample_at=5)
    assert err is not None and err.event.step == 5
    assert_captured_before(err, before)
    # the replay feeds the captured batch, not the loader's first (clean) one
    report = replay(monkeypatch, err.incident, nn.Linear(16, 16), bad_sample_at=None)
    assert report["verdict"] == "reproducible", report["message"]
    assert report["first_event"]["layer"] == err.event.layer
    first = report["trace"]["0"]["forward"][0]
    assert first["module"] == "<the captured batch>" and first["output"]["first_index"] == [3, 5]


def test_dropout_dependent_nan_needs_the_rng(monkeypatch):
    p = 0.08
    before, err = train(UnluckyDropout(p), steps=60)
    assert err is not None and err.event.step > 0, "the RNG never produced the NaN: pick another p"
    assert_captured_before(err, before)
    # the script's seed alone gives a clean first step: only the captured RNG state reproduces it
    torch.manual_seed(0)
    assert not torch.rand(()) < p
    report = replay(monkeypatch, err.incident, UnluckyDropout(p), steps=60)
    assert report["verdict"] == "reproducible", report["message"]
    assert report["first_event"]["layer"] == err.event.layer == "2"


def test_nan_in_micro_batch_3_of_4(monkeypatch):
    before, err = train(nn.Linear(16, 16), accumulate=4, nan_at=(4, 2))
    assert err is not None and err.event.step == 4 and err.event.micro_batch == 2
    assert_captured_before(err, before)
    assert err.event.input_nonfinite is True and "input batch" in err.event.message
    assert len(read_incident(err.incident).rank_batches(0)) == 4  # every micro-batch of the step
    report = replay(monkeypatch, err.incident, nn.Linear(16, 16), accumulate=4)
    assert report["verdict"] == "reproducible", report["message"]
    assert report["first_event"]["micro_batch"] == 2


def test_a_replay_that_feeds_fewer_micro_batches_than_captured_blames_no_hardware(monkeypatch):
    # the bad micro-batch (2 of 4) is never fed by a script that accumulates 2: the step runs
    # clean, which says nothing of the device that ran the original
    before, err = train(nn.Linear(16, 16), accumulate=4, nan_at=(4, 2))
    assert err is not None and err.event.micro_batch == 2
    report = replay(monkeypatch, err.incident, nn.Linear(16, 16), accumulate=2)
    assert report["verdict"] == "not_reproducible"
    assert report["own_data"] is True and report["suspects"] == [], report["message"]
    assert "hardware" not in report["message"].replace("says nothing of the hardware", "")
    assert any("micro-batch(es) 2 to 3 were never fed" in note for note in report["notes"]), report["notes"]
    assert report["devices"]["finding"] == "not_compared"


@pytest.mark.modes("sentinel", "full")
def test_transient_fault_is_not_reproducible(monkeypatch, capsys, guard_mode):
    Transient.fired = False
    before, err = train(Transient(16, at_step=7))
    # the full mode's probes saw it born in 2; the sentinel's re-run does not make it again, so it
    # blames no module (both say it was not reproduced)
    assert err is not None and err.event.step == 7 and err.event.layer == ("2" if guard_mode == "full" else "")
    assert (err.event.reproduced, err.event.verdict) == (False, "transient")
    assert_captured_before(err, before)
    report = replay(monkeypatch, err.incident, Transient(16, at_step=7))
    assert report["verdict"] == "not_reproducible"
    assert report["first_event"] is None
    suspect = report["suspects"][0]
    assert suspect["rank"] == 0 and suspect["host"] == err.event.host and suspect["device"] == "cpu"
    assert "transient" in report["message"] and err.event.host in report["message"]
    # the script's own state comes first among the suspects, the hardware last
    message = report["message"]
    assert message.index("the script's own state") < message.index("non-determinism") < message.index("hardware")
    assert "key such code on guard.step" in message
    # inspect shows the verdict
    from nanguard.incident.inspection import main as inspect_main

    capsys.readouterr()
    assert inspect_main([err.incident]) == 0
    assert "replay       not_reproducible" in capsys.readouterr().out


def test_replay_refuses_a_model_that_does_not_fit(monkeypatch):
    before, err = train(Sqrt(16))
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(IncidentError, match="does not fit the script's model"):
        train(Sqrt(32).lin)  # a Linear(32, 32) where a Sqrt(16) was
    # nothing was loaded into it, and no hook was left behind
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16))
    monkeypatch.delenv("NANGUARD_REPLAY")
    nanguard.init(model).close()


def test_replay_of_a_damaged_incident_is_refused(monkeypatch):
    before, err = train(Sqrt(16))
    path = err.incident
    state = f"{path}/rank0/state.pt"
    with open(state, "r+b") as f:
        f.seek(-5, 2)
        byte = f.read(1)
        f.seek(-5, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setenv("NANGUARD_REPLAY", path)
    with pytest.raises(IncidentError, match="state.pt"):
        nanguard.init(nn.Linear(2, 2))


def test_replay_needs_the_original_world_size(monkeypatch, tmp_path):
    before, err = train(Sqrt(16))
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(IncidentError, match="captured on 1 rank"):
        nanguard.init(nn.Linear(2, 2))


def test_replay_missing_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("NANGUARD_REPLAY", str(tmp_path / "nope"))
    with pytest.raises(IncidentError, match="no such incident folder"):
        nanguard.init(nn.Linear(2, 2))


SCRIPT = """
import sys, torch, nanguard
from torch import nn
nanguard.init()                      # bare: guards whatever the script builds
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    x = torch.randn(3, 4)
    if step == 6:
        x[0, 0] = float("inf")
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
print("loop ended")
"""


def test_bare_init_script_replays_in_a_subprocess(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    # this checkout's nanguard, not whichever one the interpreter has installed
    env = {"NANGUARD_DIR": str(tmp_path / "inc"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    first = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                           timeout=120)
    assert first.returncode != 0 and "NonFiniteError" in first.stderr
    (incident,) = (tmp_path / "inc").iterdir()
    second = subprocess.run([sys.executable, str(script)], env={**env, "NANGUARD_REPLAY": str(incident)},
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "loop ended" not in second.stdout  # the process ended at the replayed step
    assert "reproducible" in second.stdout
    assert read_incident(str(incident)).replay_report()["verdict"] == "reproducible"


def scaled_and_scheduled(made: dict | None = None):
    """A script that gives nanguard.init a GradScaler and a scheduler: (err, scaler, scheduler);
    ``made``: where to leave them (and the scheduler's state as it was made) before training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Sqrt(16), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    if made is not None:
        made.update(scaler=scaler, scheduler=scheduler, fresh=copy.deepcopy(scheduler.state_dict()))
    with nanguard.init(model, optimizer, scaler=scaler, scheduler=scheduler) as guard:
        try:
            for step in range(20):
                x, y = data(step)
                loss = nn.functional.cross_entropy(model(x), y)
                guard.check(loss, "loss")  # (the scaler skips a step whose gradients are NaN: the loss stops it)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad()
        except nanguard.NonFiniteError as err:
            return err, scaler, scheduler
    return None, scaler, scheduler


def test_replay_loads_scaler_and_scheduler_state(monkeypatch):
    err, scaler, scheduler = scaled_and_scheduled()
    assert err is not None and err.event.step >= 0
    captured = read_incident(err.incident).rank_state(0)["extra"]
    assert captured["scheduler"]["last_epoch"] == err.event.step
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    seen = {}
    real_load = torch.optim.lr_scheduler.StepLR.load_state_dict

    def spy(self, state):
        seen["scheduler"] = dict(state)
        return real_load(self, state)

    monkeypatch.setattr(torch.optim.lr_scheduler.StepLR, "load_state_dict", spy)
    with pytest.raises(SystemExit):
        scaled_and_scheduled()
    assert seen["scheduler"]["last_epoch"] == err.event.step
    assert read_incident(err.incident).replay_report()["verdict"] == "reproducible"


def static_buffer_script(bad_step: int | None, steps: int = 3):
    """Accumulation from one input buffer refilled in place for every micro-batch: a NaN in the
    data of micro-batch 0 at ``bad_step``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    buffer = torch.empty(6, 8)
    with nanguard.init(model, optimizer):
        for step in range(steps):
            for micro in range(2):
                buffer.copy_(torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + micro)))
                if (step, micro) == (bad_step, 0):
                    buffer[1, 2] = math.nan
                model(buffer).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("bad_step", [0, 2])
def test_a_static_input_buffer_replays_as_fed_or_says_what_it_lacked(monkeypatch, bad_step):
    with pytest.raises(nanguard.NonFiniteError) as info:
        static_buffer_script(bad_step)
    incident = info.value.incident
    monkeypatch.setenv("NANGUARD_REPLAY", incident)
    with pytest.raises(SystemExit) as finished:
        static_buffer_script(None)  # the script as it is: its own data is clean
    assert finished.value.code == 0
    report = read_incident(incident).replay_report()
    if bad_step == 2:  # the first step found the buffer refilled: every later batch was copied as fed
        assert report["verdict"] == "reproducible" and not report["own_data"], report["message"]
        assert report["first_event"]["input_nonfinite"] is True
        return
    # the first step's micro-batch 0 was refilled before anything copied it: the incident lacks it,
    # and the replay feeds the script's own buffer there (not None, on which the forward would fail)
    assert report["verdict"] == "not_reproducible" and report["own_data"] and report["first_event"] is None
    assert "says nothing of the hardware" in report["message"] and report["suspects"] == []
    assert report["devices"]["finding"] == "not_compared"
    assert any("changed in place after its forward" in note and "the script's own value" in note
               for note in report["notes"])
    assert report["samples"]["0"]["searched"] is False


def test_a_replay_without_the_captured_batch_does_not_blame_the_hardware(monkeypatch):
    # capture_batch=False: the replay runs on the script's own first batch, which is clean; a
    # clean step then says nothing of the device that saw the NaN sample
    before, err = train(nn.Linear(16, 16), bad_sample_at=4, init_kwargs={"capture_batch": False})
    assert err is not None and err.event.step == 4
    report = replay(monkeypatch, err.incident, nn.Linear(16, 16), bad_sample_at=4,
                    init_kwargs={"capture_batch": False})
    assert report["verdict"] == "not_reproducible" and report["own_data"]
    assert "says nothing of the hardware" in report["message"] and report["suspects"] == []
    assert report["devices"]["finding"] == "not_compared"
    assert any("capture_batch=False" in note for note in report["notes"])


class Rotary(nn.Module):
    """Scales by frequencies kept in a non-persistent buffer (transformers' rotary ``inv_freq``),
    which ``state_dict`` leaves out."""

    def __init__(self, width: int = 16, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.register_buffer("freq", torch.ones(width, dtype=dtype), persistent=False)

    def forward(self, x):
        return x * self.freq


def faulted_script(model: nn.Module, fault, fault_at: int, resume_at: int | None = None, micro_batches: int = 1,
                   compiled: bool = False):
    """Train ``model`` (SGD) for up to 4 steps, ``fault()`` before loop step ``fault_at`` (before its
    last micro-batch): its NonFiniteError, or None. ``resume_at``: a checkpoint's global step, loaded
    first; ``compiled``: the model is compiled in place once guarded."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        if compiled:
            model.compile(backend="aot_eager")
        if resume_at is not None:
            guard.load_state_dict({"step": resume_at})
        for step in range(4):
            for micro in range(micro_batches):
                if step == fault_at and micro == micro_batches - 1:
                    with torch.no_grad():
                        fault()
                x, y = data(step, micro)
                nn.functional.cross_entropy(model(x), y).backward()
            try:
                optimizer.step()
            except nanguard.NonFiniteError as err:
                return err
            optimizer.zero_grad()
    return None


def rotary_script(dtype: torch.dtype = torch.float32, corrupt_at: int = 2):
    """The frequencies turn NaN between steps (a corrupt checkpoint loaded, say): a step-2 stop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), Rotary(16, dtype), nn.Linear(16, 4))
    return faulted_script(model, lambda: model[2].freq.__setitem__(3, math.nan), corrupt_at)


def test_a_non_persistent_buffer_is_captured_and_replayed(monkeypatch):
    # without it the replay ran with the script's own finite frequencies, ran clean, and blamed
    # the hardware
    err = rotary_script()
    assert err.event.layer == "2" and "buffer(s) freq were non-finite" in err.event.message
    saved = read_incident(err.incident).rank_state(0)["extra"]["non_persistent_buffers"]
    assert set(saved) == {"2.freq"} and torch.isnan(saved["2.freq"][3])
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(SystemExit) as exit_info:
        rotary_script(corrupt_at=-1)  # the script's own frequencies are finite
    assert exit_info.value.code == 0
    report = read_incident(err.incident).replay_report()
    assert report["verdict"] == "reproducible" and report["first_event"]["layer"] == "2"
    assert report["suspects"] == []


def test_non_persistent_buffers_that_do_not_fit_the_script_are_refused(monkeypatch):
    err = rotary_script()
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(IncidentError, match="non-persistent buffers that do not fit"):
        rotary_script(dtype=torch.float64, corrupt_at=-1)  # (refused before its forward)


def resumed_script(fault_at: int = 1):
    """A run resumed from a checkpoint at global step 100, whose weight turns NaN before step 101."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    return faulted_script(model, lambda: model[1].weight.__setitem__((0, 0), math.nan), fault_at, resume_at=100)


def test_a_resumed_run_replays_its_step_although_the_script_loads_its_checkpoint_again(monkeypatch):
    # the replayed script calls guard.load_state_dict({"step": 100}) again: the replay must still
    # count its one step as the incident's (101), or it finds "a different first event" and blames
    # the hardware
    err = resumed_script()
    assert err.event.step == 101
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(SystemExit) as exit_info:
        resumed_script(fault_at=-1)  # the incident's weights hold the NaN
    assert exit_info.value.code == 0
    report = read_incident(err.incident).replay_report()
    assert report["verdict"] == "reproducible" and report["first_event"]["step"] == 101
    assert report["suspects"] == []


_NAMES = st.sampled_from(["2.freq", "freq", "2.other", "0.weight", ""])
_VALUES = st.one_of(
    st.builds(lambda n, dtype: torch.ones(n, dtype=dtype), st.integers(0, 20),
              st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool])),
    st.none(), st.integers(), st.text(max_size=5), st.lists(st.floats(), max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.dictionaries(_NAMES, _VALUES, max_size=4), st.lists(_VALUES, max_size=2), st.text(max_size=5),
                 st.none(), st.integers()))
def test_non_persistent_buffers_of_any_incident_are_loaded_only_when_each_fits(saved):
    from nanguard.incident import IncidentError as Refused
    from nanguard.replay.load import unpersisted

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), Rotary(16), nn.Linear(16, 4))
    fits = isinstance(saved, dict) and all(
        name == "2.freq" and isinstance(value, torch.Tensor) and value.shape == (16,) and value.dtype == torch.float32
        for name, value in saved.items())
    if fits:
        assert unpersisted(saved, model, "state.pt") == list(saved.items())
    else:
        with pytest.raises(Refused, match="state.pt: holds non-persistent buffers that do not fit"):
            unpersisted(saved, model, "state.pt")


@pytest.mark.modes("sentinel", "full")
def test_a_weight_written_between_micro_batches_replays_with_a_note_of_it(monkeypatch, guard_mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    err = faulted_script(model, lambda: model[1].weight.__setitem__((0, 0), math.nan), 2, micro_batches=2)
    if guard_mode == "sentinel":  # its re-run of micro-batch 0 runs with the weight written since: nothing is named
        assert (err.event.micro_batch, err.event.reproduced) == (None, None) and "changed since" in err.event.message
        return
    assert err.event.micro_batch == 1
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    torch.manual_seed(0)
    again = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    with pytest.raises(SystemExit):
        faulted_script(again, lambda: None, -1, micro_batches=2)
    report = read_incident(err.incident).replay_report()
    assert report["first_event"]["micro_batch"] == 0
    assert any("found at micro-batch 0 here, at micro-batch 1 in the original" in note for note in report["notes"])


def gan_script(bad_at: int = 2):
    """G and D kept in one container whose forward never runs: the script calls them itself."""
    torch.manual_seed(0)
    gan = nn.ModuleDict({"G": nn.Sequential(nn.Linear(4, 8)), "D": nn.Sequential(nn.Linear(8, 1))})
    optimizer = torch.optim.SGD(gan.parameters(), lr=0.1)
    with nanguard.init(gan, optimizer):
        for step in range(4):
            real = data(step)[0]
            if step == bad_at:
                real[1, 2] = math.nan
            (gan["D"](gan["G"](real[:, 4:])).mean() - gan["D"](real).mean()).backward()
            try:
                optimizer.step()
            except nanguard.NonFiniteError as err:
                return err
            optimizer.zero_grad()


def test_a_replay_of_modules_called_directly_says_it_ran_on_the_scripts_own_data(monkeypatch):
    # no root forward, so no batch was captured: a clean replay must not blame the hardware
    err = gan_script()
    assert err.event.layer == "D.0"
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(SystemExit):
        gan_script(bad_at=-1)
    report = read_incident(err.incident).replay_report()
    assert report["own_data"] is True and report["suspects"] == []
    assert any("root module ran no forward" in note for note in report["notes"])


class Scaled(nn.Module):
    """A linear map times a buffer; ``refreshed``: the buffer is set to ones as each forward begins
    (as DDP's broadcast of rank 0's buffers overwrites another rank's, in a replay where it runs)."""

    def __init__(self, refreshed: bool):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))
        self.refreshed = refreshed

    def forward(self, x):
        if self.refreshed:
            self.scale.fill_(1.0)
        return self.lin(x) * self.scale


def stale_script(refreshed: bool = False):
    """Code between steps writes a NaN into a buffer (an evaluation with BatchNorm in train mode
    does): the next step's forward uses it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Scaled(refreshed), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer):
        for step in range(4):
            if step == 2 and not refreshed:
                model[1].scale[3] = math.nan
            x, y = data(step)
            nn.functional.cross_entropy(model(x), y).backward()
            try:
                optimizer.step()
            except nanguard.NonFiniteError as err:
                return err
            optimizer.zero_grad()


def test_a_clean_replay_of_a_state_that_held_the_nan_blames_no_hardware(monkeypatch):
    err = stale_script()
    assert (err.event.kind, err.event.layer, err.event.step) == ("forward", "1", 2), err.event
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(SystemExit):
        stale_script(refreshed=True)  # the replayed step puts finite values in its place first
    report = read_incident(err.incident).replay_report()
    assert report["verdict"] == "not_reproducible" and report["first_event"] is None
    assert report["bad_state"] == {"0": ["1.scale"]} and report["suspects"] == [], report
    assert "the captured state already holds non-finite values (rank 0: 1.scale)" in report["message"]
    assert "transient fault" not in report["message"]
    assert report["devices"]["finding"] == "not_compared"


def unkept_script(fault: bool = True):
    """G and D given to init in a container the script does not keep (so it is freed at once)."""
    torch.manual_seed(0)
    g, d = nn.Sequential(nn.Linear(4, 8)), nn.Sequential(nn.Linear(8, 1))
    optimizer = torch.optim.SGD([*g.parameters(), *d.parameters()], lr=0.1)
    with nanguard.init(nn.ModuleDict({"G": g, "D": d}), optimizer):
        gc.collect()  # (a container in a reference cycle goes only when the collector runs)
        for step in range(4):
            if step == 2 and fault:
                with torch.no_grad():
                    d[0].weight[0, 0] = math.nan
            d(g(data(step)[0][:, :4])).mean().backward()
            try:
                optimizer.step()
            except nanguard.NonFiniteError as err:
                return err
            optimizer.zero_grad()


def test_a_model_the_script_did_not_keep_is_told_at_the_capture_and_the_replay(monkeypatch, caplog):
    # nanguard holds the model weakly: a container made in the call to init is gone at once
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        err = unkept_script()
    assert err.event.layer == "D.0"
    assert any("the model given to nanguard.init is gone" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(IncidentError, match="holds no model state: the model given to nanguard.init was gone"):
        unkept_script(fault=False)


def test_a_model_compiled_in_place_replays(monkeypatch):
    # model.compile() runs the replay's hooks inside the compiled frame too: traced, the batch's
    # feed crashed there (fuzz8 #8)
    def script(fault_at: int):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        return faulted_script(model, lambda: model[1].weight.__setitem__((0, 0), math.nan), fault_at, compiled=True)

    try:
        err = script(fault_at=2)
        assert err.event.layer == "1" and err.event.step == 2
        monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
        with pytest.raises(SystemExit) as exit_info:
            script(fault_at=-1)
    finally:
        torch._dynamo.reset()
    assert exit_info.value.code == 0
    report = read_incident(err.incident).replay_report()
    assert report["verdict"] == "reproducible" and report["first_event"]["layer"] == "1", report["message"]


# ---------------------------------------------------------------------- what a replay cannot give the step
def replayed_twice(monkeypatch, script, **kwargs) -> tuple[str, dict]:
    """``script(**kwargs)`` stops; run again under NANGUARD_REPLAY: (the incident, the report)."""
    with pytest.raises(nanguard.NonFiniteError) as info:
        script(**kwargs)
    monkeypatch.setenv("NANGUARD_REPLAY", info.value.incident)
    with pytest.raises(SystemExit) as finished:
        script(**kwargs)
    assert finished.value.code == 0
    monkeypatch.delenv("NANGUARD_REPLAY")
    return info.value.incident, read_incident(info.value.incident).replay_report()


def drawing_script(source: str = "python", optimizer: type = torch.optim.SGD, labels_bad_at: int | None = None):
    """A forward that takes a buggy branch when Python's (or numpy's) generator, seeded, draws low:
    step 3, every run; or labels all ignored at ``labels_bad_at`` (the loss is NaN: no draw)."""
    import random

    import numpy as np

    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            draw = random.random() if source == "python" else float(np.random.rand())
            return self.fc(torch.log(x - 10) if draw < 0.3 and labels_bad_at is None else x)

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = Drop()
    opt = optimizer(model.parameters(), lr=0.1)
    with nanguard.init(model, opt) as guard:
        for step in range(6):
            x = torch.rand(8, 4) + 0.5
            y = torch.full((8,), -100 if step == labels_bad_at else 1)
            loss = nn.functional.cross_entropy(model(x), y)
            guard.check(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()


def test_a_step_that_draws_from_pythons_generator_is_not_blamed_on_the_hardware(monkeypatch):
    # python's and numpy's states are read at the stop (reading them at every step start costs 9 and
    # 80 us): the replayed step drew other numbers, which the report says instead of naming a suspect
    _, report = replayed_twice(monkeypatch, drawing_script)
    assert report["verdict"] == "not_reproducible" and report["suspects"] == []
    assert "the step drew from Python's or numpy's random generator" in report["message"]
    assert "says nothing of the hardware" in report["message"] and report["devices"]["finding"] == "not_compared"


def test_a_loss_made_non_finite_by_its_labels_is_not_blamed_on_the_hardware(monkeypatch):
    # every label ignored makes cross_entropy NaN; a replay feeds the captured batch, but the labels
    # are the script's loader's own
    _, report = replayed_twice(monkeypatch, drawing_script, labels_bad_at=2)
    assert report["original_event"]["kind"] == "loss" and report["suspects"] == []
    assert "the original value was found in the loss" in report["message"]


def test_another_kind_of_optimizer_is_another_script_and_is_refused(monkeypatch):
    with pytest.raises(nanguard.NonFiniteError) as info:
        drawing_script()
    monkeypatch.setenv("NANGUARD_REPLAY", info.value.incident)
    with pytest.raises(IncidentError, match="another kind of optimizer than the script's Adam.*not the script"):
        drawing_script(optimizer=torch.optim.Adam)


def test_a_state_already_bad_says_so_when_the_replay_reproduces_it(monkeypatch):
    def script():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with nanguard.init(model, opt):
            for step in range(4):
                if step == 2:
                    with torch.no_grad():  # (a checkpoint loaded between steps, say)
                        model[2].weight[0, 0] = math.nan
                model(torch.rand(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()

    _, report = replayed_twice(monkeypatch, script)
    assert report["verdict"] == "reproducible" and report["bad_state"] == {"0": ["2.weight"]}
    assert "already held non-finite values before the step began (rank 0: 2.weight)" in report["message"]
    assert report["devices"]["finding"] == "not_compared"


def test_a_replay_that_never_reaches_the_step_says_so_at_exit(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {"NANGUARD_DIR": str(tmp_path / "inc"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    assert subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=120).returncode
    (incident,) = (tmp_path / "inc").iterdir()
    script.write_text(textwrap.dedent(SCRIPT).replace("range(10)", "range(0)"))  # an empty loader, say
    second = subprocess.run([sys.executable, str(script)], env={**env, "NANGUARD_REPLAY": str(incident)},
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "loop ended" in second.stdout
    assert "the script ended before the replayed step was decided" in second.stderr, second.stderr
    assert read_incident(str(incident)).replay_report() is None
