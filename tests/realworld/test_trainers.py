"""Trainers that own the loop: Lightning, the Hugging Face Trainer (with nanguard's callback) and an
accelerate loop. The fault is injected from the trainer's own callbacks, at a known global step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanguard
from helpers import assert_fed_as_captured, assert_untouched, needs
from oracles import ForwardOracle, GradOracle, StateBefore, identical, tensors_in
from zoo import gpt2, nan_for_batch, poison_backward_of, token_batch

BAD_STEP = 3


def read(incident: str):
    from nanguard.incident import read_incident

    return read_incident(incident)


def no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# ------------------------------------------------------------------ Lightning
def lightning_script(*, poison_sample: int | None = 13, fault_weight_at: int | None = None, steps: int = 6,
                     ckpt_path: str | None = None, max_steps: int | None = None, backward_fault_at: int | None = None,
                     clip: float | None = None, scale: float | None = None):
    """The user's script: a LightningModule whose training_step calls its submodules (never its
    own forward), on a loader whose sample ``poison_sample`` holds a NaN (batch 3 of size 4);
    ``backward_fault_at``: the backward of encoder.0's output makes NaN at that step; ``clip``: the
    trainer clips gradients; ``scale``: 16-bit mixed precision, the GradScaler starting there."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from nanguard.integrations.lightning import NanguardCallback

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32))
            self.head = nn.Linear(32, 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.head(self.encoder(x)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class Watch(L.Callback):
        """The test's own view: the state before every step, the batch it was given, the fault, and
        which gradients were non-finite before the trainer clipped them."""

        before: dict[int, StateBefore] = {}
        batches: dict[int, tuple] = {}
        bad_before_clipping: dict[int, set[str]] = {}

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == fault_weight_at:
                with torch.no_grad():
                    module.head.weight[0, 0] = math.inf
            poison.fill_(math.nan if trainer.global_step == backward_fault_at else 1.0)
            self.before[trainer.global_step] = StateBefore(module, trainer.optimizers[0])
            self.batches[trainer.global_step] = batch

        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.bad_before_clipping[trainer.global_step] = {
                name for name, p in module.named_parameters() if p.grad is not None and not p.grad.isfinite().all()}

    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    if poison_sample is not None:
        x[poison_sample, 2] = math.nan
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model, watch, callback = Classifier(), Watch(), NanguardCallback()
    poison = poison_backward_of(model.encoder[0])
    plugins = [] if scale is None else [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=scale))]
    trainer = L.Trainer(max_steps=max_steps or steps, accelerator="cpu", callbacks=[watch, callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=clip, plugins=plugins)
    try:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    except nanguard.NonFiniteError as err:
        return err, model, trainer, watch
    return None, model, trainer, watch


def test_lightning_stops_on_the_poisoned_batch_before_the_update():
    needs("lightning")
    err, model, trainer, watch = lightning_script()
    assert err is not None
    event = err.event
    assert (event.step, event.rank, event.kind) == (BAD_STEP, 0, "forward")
    assert (event.layer, event.input_nonfinite, event.first_index) == ("encoder.0", True, (1, 2))
    assert_untouched(watch.before[BAD_STEP], model, trainer.optimizers[0])


def test_lightning_captures_the_batch_the_trainer_hands_over_and_replays_it(monkeypatch):
    needs("lightning")
    err, model, trainer, watch = lightning_script()
    assert err is not None and err.event.step == BAD_STEP
    assert "forward code" not in err.event.message and "batch" in err.event.message
    batches = read(err.incident).rank_batches(0)
    assert len(batches) == 1
    assert any(identical(t, watch.batches[BAD_STEP][0]) for t in tensors_in(batches[0]))  # the step's x
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(SystemExit):
        lightning_script(poison_sample=None)  # the loader's clean batches: only the captured one is bad
    report = read(err.incident).replay_report()
    assert report["verdict"] == "reproducible", report["message"]
    assert report["trace"]["0"]["forward"][0]["module"] == "<the captured batch>"
    # the model's own forward does not take the trainer's batch: no search of it, and why
    assert report["samples"]["0"]["searched"] is False
    assert "the batch came through begin_micro_batch" in report["samples"]["0"]["why_not"]


def test_lightning_replay_says_what_it_fed(monkeypatch):
    needs("lightning")
    err, model, trainer, watch = lightning_script(poison_sample=None, fault_weight_at=BAD_STEP)
    assert err is not None and (err.event.step, err.event.layer) == (BAD_STEP, "head")
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(SystemExit):
        lightning_script(poison_sample=None)
    report = read(err.incident).replay_report()
    assert report["verdict"] == "reproducible"
    captured = read(err.incident).rank_batches(0)
    assert captured or "batch" not in report["message"], report["message"]


def test_lightning_clipping_does_not_move_the_blame_of_a_backward_nan():
    # training_step calls the submodules, so no forward of the guarded model runs: the gradients
    # are still taken as the backward pass leaves them, before clip_grad_norm_ makes every one NaN
    needs("lightning")
    err, model, trainer, watch = lightning_script(poison_sample=None, backward_fault_at=BAD_STEP, clip=1.0)
    assert err is not None
    assert watch.bad_before_clipping[BAD_STEP] == {"encoder.0.weight", "encoder.0.bias"}
    assert (err.event.step, err.event.kind) == (BAD_STEP, "grad")
    assert err.event.layer in watch.bad_before_clipping[BAD_STEP], str(err.event)
    assert_untouched(watch.before[BAD_STEP], model, trainer.optimizers[0])


def test_lightning_16_mixed_counts_the_steps_its_scaler_skips_as_the_trainer_does(guard_mode):
    # a scale far too high: the scaler skips the first steps (no optimizer.step()), which the
    # trainer's global_step counts, up to the NaN batch
    needs("lightning")
    from nanguard.integrations.lightning import NanguardCallback

    err, model, trainer, watch = lightning_script(scale=2.0**40)
    if guard_mode == "sentinel":
        # the scaler skips the NaN batch's update too (its own verdict): no update depends on it, and the
        # sentinel reads no forward, so nothing stops; the steps are counted as the trainer counts them
        (callback,) = [c for c in trainer.callbacks if isinstance(c, NanguardCallback)]
        assert err is None and callback.guard.step == trainer.global_step == 6 and callback.guard.events == []
        assert trainer.precision_plugin.scaler.get_scale() < 2.0**40
        assert all(torch.isfinite(p).all() for p in model.parameters())
        return
    assert err is not None
    assert trainer.precision_plugin.scaler.get_scale() < 2.0**40
    assert (err.event.step, err.event.kind, err.event.layer) == (BAD_STEP, "forward", "encoder.0")
    assert trainer.global_step == BAD_STEP and err.incident.endswith(f"step{BAD_STEP}")


def test_lightning_resumed_fit_counts_steps_from_the_checkpoint(tmp_path):
    needs("lightning")
    err, model, trainer, watch = lightning_script(poison_sample=None, steps=4)
    assert err is None and trainer.global_step == 4
    trainer.save_checkpoint(tmp_path / "step4.ckpt")
    err, model, trainer, watch = lightning_script(poison_sample=None, fault_weight_at=5, max_steps=8,
                                                  ckpt_path=str(tmp_path / "step4.ckpt"))
    assert err is not None
    assert (err.event.step, err.event.layer) == (5, "head")


# ------------------------------------------------------------------ Hugging Face Trainer
def hf_trainer(tmp_path, model, *extra_callbacks, max_steps: int = 6, **args):
    from transformers import Trainer, TrainingArguments

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (64, 16), generator=gen)]
    settings = dict(per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_steps=1000,
                    save_strategy="no", disable_tqdm=True)
    arguments = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=max_steps, **(settings | args))
    return Trainer(model=model, args=arguments, train_dataset=data, callbacks=list(extra_callbacks))


def hf_watch(fault=None, at: int = BAD_STEP):
    """A TrainerCallback of the test: injects ``fault(model)`` at global step ``at`` and keeps
    the state before every step (and an oracle on the bad one)."""
    from transformers import TrainerCallback

    class Watch(TrainerCallback):
        before: dict[int, StateBefore] = {}
        oracle: ForwardOracle | None = None
        grads: GradOracle | None = None

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step == at and fault is not None:
                fault(model)
                self.oracle, self.grads = ForwardOracle(model), GradOracle(model)
            self.before[state.global_step] = StateBefore(model, optimizer.optimizer)

    return Watch()


def inf_in_mlp(model):
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[3, 5] = math.inf


def test_hf_trainer_callback_stops_before_the_update_and_replays(tmp_path, monkeypatch):
    needs("transformers", "accelerate")
    from nanguard.integrations.transformers import NanguardCallback

    stops = []
    model, callback, watch = gpt2(), NanguardCallback(on_stop=stops.append), hf_watch(inf_in_mlp)
    trainer = hf_trainer(tmp_path, model, watch, callback)
    with pytest.raises(nanguard.NonFiniteError) as info:
        trainer.train()
    assert stops == [info.value]  # the user's on_stop, then the guard closed
    truth = watch.oracle.producer()
    assert (truth.name, truth.inputs_finite) == ("transformer.h.1.mlp.c_fc", True)
    event = info.value.event
    assert (event.step, event.rank, event.kind, event.layer) == (BAD_STEP, 0, "forward", truth.name)
    assert (event.input_nonfinite, event.output_nonfinite) == (False, True)
    assert_untouched(watch.before[BAD_STEP], model, trainer.optimizer.optimizer)
    watch.oracle.close()
    watch.grads.close()
    assert callback.guard.closed and no_hooks_left(model)  # closed on the way out of train()
    incident = read(info.value.incident)
    assert "scheduler" in incident.rank_state(0)["extra"]  # the Trainer's LR scheduler, passed on
    fed = incident.rank_batches(0)[0]["kwargs"]  # where the Trainer hands the batch over: model(**inputs)
    assert fed["input_ids"].shape == (4, 16) and torch.equal(fed["input_ids"], fed["labels"])

    # the unchanged script, replayed: a fresh model and trainer, NANGUARD_REPLAY set
    monkeypatch.setenv("NANGUARD_REPLAY", info.value.incident)
    with pytest.raises(SystemExit) as finished:
        hf_trainer(tmp_path, gpt2(), NanguardCallback()).train()
    assert finished.value.code == 0
    report = read(info.value.incident).replay_report()
    assert report["verdict"] == "reproducible", report["message"]
    assert report["trace"]["0"]["forward"][0]["module"] == truth.name
    assert_fed_as_captured(report)


def test_hf_trainer_clean_run_closes_the_guard(tmp_path):
    needs("transformers", "accelerate")
    from nanguard.integrations.transformers import NanguardCallback

    model, callback = gpt2(), NanguardCallback(grad_norm_warn=1e9)
    hf_trainer(tmp_path, model, callback, max_steps=2).train()
    assert callback.guard.step == 2 and callback.guard.events == []
    assert callback.guard.closed and no_hooks_left(model)


def test_hf_callback_settings_are_checked_when_it_is_made():
    needs("transformers")
    from nanguard.integrations.transformers import NanguardCallback

    with pytest.raises(nanguard.ConfigError, match="on_nan"):
        NanguardCallback(on_nan="ignore")


def test_hf_callback_without_transformers_says_what_to_install(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "nanguard.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=r"pip install transformers"):
        importlib.import_module("nanguard.integrations.transformers")


def test_hf_trainer_clipping_does_not_move_the_blame_of_a_backward_nan(tmp_path):
    needs("transformers", "accelerate")
    from nanguard.integrations.transformers import NanguardCallback

    model = gpt2()
    poison = poison_backward_of(model.transformer.h[0].mlp.c_proj)

    def arm(m):
        poison.fill_(math.nan)

    watch = hf_watch(arm)
    with pytest.raises(nanguard.NonFiniteError) as info:
        hf_trainer(tmp_path, model, watch, NanguardCallback()).train()
    first = watch.grads.bad_params_of_first_module()
    assert first == {"transformer.h.0.mlp.c_proj.weight", "transformer.h.0.mlp.c_proj.bias"}
    event = info.value.event
    assert (event.step, event.kind) == (BAD_STEP, "grad")
    assert event.layer in first, str(event)


def test_hf_trainer_resumed_run_counts_steps_from_the_trainer(tmp_path):
    needs("transformers", "accelerate")
    from nanguard.integrations.transformers import NanguardCallback

    hf_trainer(tmp_path, gpt2(), NanguardCallback(), max_steps=3, save_strategy="steps", save_steps=3).train()
    model, watch = gpt2(), hf_watch(inf_in_mlp, at=4)
    trainer = hf_trainer(tmp_path, model, watch, NanguardCallback(), max_steps=6)
    with pytest.raises(nanguard.NonFiniteError) as info:
        trainer.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-3"))
    assert (info.value.event.step, info.value.event.layer) == (4, "transformer.h.1.mlp.c_fc")


# ------------------------------------------------------------------ accelerate
def accelerate_loop(prepare_first: bool, accumulation: int = 2, steps: int = 5):
    """accelerator.prepare(model, optimizer, loader), accelerator.accumulate, accelerator.backward;
    a forward NaN (the user's hook on the second MLP) in micro-batch 1 of step 3."""
    from accelerate import Accelerator

    model = gpt2()
    fault = nan_for_batch(model, model.transformer.h[1].mlp.c_proj)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader([token_batch(i, batch=1)[0] for i in range(64)], batch_size=2)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    guard = None if prepare_first else nanguard.init(model, optimizer)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if guard is None:
        guard = nanguard.init(model, optimizer)
    oracle = ForwardOracle(model)
    before = None
    try:
        for index, ids in enumerate(loader):
            step, micro = divmod(index, accumulation)
            if (step, micro) == (BAD_STEP, 1):
                fault["batch"] = ids
            if micro == 0:
                oracle.reset()
                before = StateBefore(model, optimizer)
            with accelerator.accumulate(model):
                accelerator.backward(model(input_ids=ids, labels=ids).loss)
                optimizer.step()
                optimizer.zero_grad()
            if step == steps:
                break
    except nanguard.NonFiniteError as err:
        return err, before, oracle, model, optimizer
    finally:
        guard.close()
    pytest.fail("no NonFiniteError")


def test_accelerate_loop_guarded_before_prepare():
    needs("accelerate")
    err, before, oracle, model, optimizer = accelerate_loop(prepare_first=False)
    truth = oracle.producer()
    assert (truth.name, truth.inputs_finite, truth.forward) == ("transformer.h.1.mlp.c_proj", True, 1)
    event = err.event
    assert (event.step, event.micro_batch, event.kind, event.layer) == (BAD_STEP, 1, "forward", truth.name)
    assert event.input_nonfinite is False
    assert_untouched(before, model, optimizer)


def test_accelerate_loop_guarded_after_prepare():
    needs("accelerate")
    err, before, oracle, model, optimizer = accelerate_loop(prepare_first=True)
    assert (err.event.step, err.event.micro_batch, err.event.layer) == (BAD_STEP, 1, "transformer.h.1.mlp.c_proj")
    assert_untouched(before, model, optimizer)
