"""nanguard.integrations.lightning: the callback in a real Lightning Trainer (CPU, one process)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nanguard

L = pytest.importorskip("lightning")
from nanguard.integrations.lightning import NanguardCallback  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, bad_step: int = -1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.bad_step = bad_step
        self.before: dict[int, dict] = {}

    def training_step(self, batch, batch_idx):
        self.before[self.global_step] = copy.deepcopy(self.net.state_dict())
        (x,) = batch
        if self.global_step == self.bad_step:
            x = x.clone()
            x[0, 0] = float("nan")
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model, callback, steps=8):
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    return trainer


def test_stops_before_the_bad_update_inside_automatic_optimization():
    model, callback = Model(bad_step=5), NanguardCallback()
    with pytest.raises(nanguard.NonFiniteError) as info:
        fit(model, callback)
    assert info.value.event.step == 5 and info.value.event.layer == "net.0"
    # Lightning runs forward and backward inside optimizer.step(closure): the guard decided
    # after the closure, before the update
    for name, value in model.net.state_dict().items():
        assert torch.equal(value, model.before[5][name]), name
    assert callback.guard.closed  # the trainer's teardown removed every hook


def test_a_clean_fit_leaves_no_hook_behind():
    model, callback = Model(), NanguardCallback(grad_norm_warn=1e9)
    fit(model, callback, steps=4)
    assert callback.guard.step == 4 and callback.guard.events == []
    assert callback.guard.closed
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_settings_are_checked_when_the_callback_is_made():
    with pytest.raises(nanguard.ConfigError, match="on_nan"):
        NanguardCallback(on_nan="ignore")


class DataModel(Model):
    """The fault is in the data: a poisoned sample of the loader."""

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()


def poisoned_fit(callback, steps=8):
    torch.manual_seed(0)
    data = torch.randn(64, 4)
    data[21, 2] = float("nan")  # sample 21: the sixth batch of four, step 5
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(DataModel(), loader)


def test_the_batch_the_trainer_hands_over_is_captured_and_fed_back_in_a_replay(monkeypatch):
    from nanguard.incident import read_incident

    with pytest.raises(nanguard.NonFiniteError) as info:
        poisoned_fit(NanguardCallback())
    err = info.value
    assert err.event.step == 5 and err.event.micro_batch == 0
    (batch,) = read_incident(err.incident).rank_batches(0)[0]["args"]
    assert torch.isnan(batch[0][1, 2])  # the batch, as the trainer handed it over
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(nanguard.ReplayFinished) as replay:
        poisoned_fit(NanguardCallback())
    report = replay.value.report
    assert report["verdict"] == "reproducible" and report["first_event"]["step"] == 5
    assert not any("not captured" in note or "extra ones" in note for note in report["notes"])
