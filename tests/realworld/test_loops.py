"""Hand-written training loops of the kinds people run: nanoGPT's (gradient accumulation, bf16
autocast, a GradScaler, unscale and clip), PyTorch's nn.Transformer tutorial (a -inf causal mask),
an fp16 model, a policy that returns a ``torch.distributions.Normal``, and a resumed run."""

from __future__ import annotations

import math

import torch
from torch import nn

import nanguard
from helpers import assert_untouched, until_stop
from oracles import ForwardOracle, GradOracle
from zoo import Actor, TutorialLM, nan_for_batch, nanogpt, poison_backward_of, token_batch

ACCUMULATION = 4


def nanogpt_step(model, optimizer, *, clip: float = 1.0, on_micro=lambda step, micro: None):
    """nanoGPT's train.py, step by step: micro-batches under autocast, a GradScaler (disabled for
    bf16, as nanoGPT does), unscale, clip_grad_norm_, scaler.step, scaler.update, zero_grad."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def step(i):
        for micro in range(ACCUMULATION):
            on_micro(i, micro)
            ids = token_batch(ACCUMULATION * i + micro, seq=17)
            x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
                loss = loss / ACCUMULATION
            scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def test_nanogpt_accumulation_names_the_micro_batch_and_the_module():
    model = nanogpt()
    fault = nan_for_batch(model, model.transformer.h[1].attn.c_proj)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer) as guard:
        oracle = ForwardOracle(model)

        def on_micro(step, micro):
            if (step, micro) == (2, 2):
                fault["batch"] = token_batch(ACCUMULATION * step + micro, seq=17)[:, :-1].contiguous()

        _, err, before = until_stop(nanogpt_step(model, optimizer, on_micro=on_micro), model, optimizer,
                                    steps=4, oracles=[oracle])
        assert guard.step == 3
    truth = oracle.producer()
    assert (truth.name, truth.inputs_finite, truth.forward) == ("transformer.h.1.attn.c_proj", True, 2)
    event = err.event
    assert (event.step, event.micro_batch, event.rank) == (2, 2, 0)
    assert (event.kind, event.layer, event.module_type) == ("forward", truth.name, "Linear")
    assert (event.input_nonfinite, event.output_nonfinite) == (False, True)
    assert_untouched(before, model, optimizer)


def test_nanogpt_clipping_does_not_move_the_blame_of_a_backward_nan():
    model = nanogpt()
    poison = poison_backward_of(model.transformer.h[0].mlp.gelu)  # the gradient flowing into c_fc's output
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):
        grads = GradOracle(model)

        def on_micro(step, micro):
            poison.fill_(math.nan if (step, micro) == (1, 3) else 1.0)

        _, err, before = until_stop(nanogpt_step(model, optimizer, on_micro=on_micro), model, optimizer,
                                    steps=3, oracles=[grads])
    first = grads.bad_params_of_first_module()
    assert first == {"transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.bias"}
    event = err.event
    assert (event.step, event.kind) == (1, "grad")
    assert event.layer in first, str(event)
    assert_untouched(before, model, optimizer)


def test_tutorial_transformer_minus_inf_mask_is_not_a_fault():
    torch.manual_seed(0)
    model = TutorialLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        oracle = ForwardOracle(model)
        for i in range(3):
            oracle.reset()
            ids = token_batch(i, seq=13)
            logits = model(ids[:, :-1])
            nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert oracle.producer() is None
            assert "transformer_encoder" in [c.name for c in oracle.nonfinite_inputs()]
        assert guard.step == 3 and guard.events == []


def test_fp16_model_grad_norm_warning_does_not_vanish_on_norm_overflow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 10)).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    with nanguard.init(model, optimizer, grad_norm_warn=1e4) as guard:
        x, y = torch.randn(64, 256).half(), torch.randint(0, 10, (64,))
        (nn.functional.cross_entropy(model(x).float(), y) * 2**16).backward()  # a static loss scale
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())  # the oracle: finite,
        true_norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        assert 1e5 < true_norm < 1e6  # and over grad_norm_warn
        assert not torch.isfinite(model[2].weight.grad.norm())  # float16's own norm overflows
        optimizer.step()
        warnings = [e for e in guard.events if e.kind == "grad_norm"]
    assert len(warnings) == 1 and warnings[0].step == 0
    assert math.isclose(warnings[0].grad_norm, true_norm, rel_tol=1e-2)


def test_policy_returning_a_distribution_is_looked_into():
    torch.manual_seed(0)
    actor = Actor()
    optimizer = torch.optim.Adam(actor.parameters(), lr=1e-3)
    with nanguard.init(actor, optimizer):
        oracle = ForwardOracle(actor)

        def arm(i):
            if i == 1:
                with torch.no_grad():
                    actor.head.log_std.fill_(100.0)  # finite; exp(100) is not, in float32

        def step(i):
            gen = torch.Generator().manual_seed(i)
            obs, action = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
            (-actor(obs).log_prob(action).sum(-1).mean()).backward()
            optimizer.step()
            optimizer.zero_grad()

        _, err, before = until_stop(step, actor, optimizer, steps=3, arm=arm, oracles=[oracle])
    truth = oracle.producer()
    assert (truth.name, truth.module_type, truth.inputs_finite, truth.params_finite) == (
        "head", "GaussianHead", True, True)
    event = err.event
    assert (event.step, event.kind, event.layer) == (1, "forward", "head")
    assert (event.input_nonfinite, event.output_nonfinite) == (False, True)
    assert_untouched(before, actor, optimizer)


def test_resumed_run_counts_steps_from_the_checkpoint():
    model = nanogpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer) as guard:
        step = nanogpt_step(model, optimizer)
        for i in range(3):
            step(i)
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "nanguard": guard.state_dict()}
    # a new process, as nanoGPT resumes: init_from="resume"
    model = nanogpt()
    model.load_state_dict(checkpoint["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(checkpoint["optimizer"])
    target = model.transformer.h[0].mlp.c_proj
    with nanguard.init(model, optimizer) as guard:
        guard.load_state_dict(checkpoint["nanguard"])
        assert guard.step == 3

        def arm(i):
            if i == 1:
                with torch.no_grad():
                    target.weight[0, 0] = math.inf

        _, err, before = until_stop(nanogpt_step(model, optimizer), model, optimizer, steps=3, arm=arm)
    assert (err.event.step, err.event.layer) == (4, "transformer.h.0.mlp.c_proj")
    assert_untouched(before, model, optimizer)

