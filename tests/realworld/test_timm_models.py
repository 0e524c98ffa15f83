"""timm's ViT and ResNet (BatchNorm), eager and under torch.compile, with faults at known places."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanguard
from helpers import (assert_fed_as_captured, assert_incident_holds, assert_untouched, needs,
                     until_stop)
from oracles import ForwardOracle, GradOracle, StateBefore
from zoo import efficientnet, eva, image_batch, poison_backward_of, resnet, swin, vit

needs("timm")

BAD_STEP = 2


def vit_step(model, optimizer, run=None, size=32):
    run = model if run is None else run

    def step(i):
        x, y = image_batch(i, size=size)
        nn.functional.cross_entropy(run(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def test_vit_nan_born_in_the_attention_backward_names_qkv():
    model = vit()
    poison = poison_backward_of(model.blocks[0].attn.q_norm)  # the gradient flowing back into q
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):
        grads = GradOracle(model)
        arm = lambda i: poison.fill_(math.nan if i == BAD_STEP else 1.0)  # noqa: E731
        _, err, before = until_stop(vit_step(model, optimizer), model, optimizer, steps=4, arm=arm,
                                    oracles=[grads])
    first = grads.bad_params_of_first_module()
    assert first == {"blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias"}
    event = err.event
    assert (event.step, event.rank, event.kind) == (BAD_STEP, 0, "grad")
    assert event.layer in first and event.has_nan
    assert "born in the backward pass" in event.message
    # the gradients made just before the first bad one, as the oracle saw them produced, were finite
    bad_at = next(i for i, (_, ok) in enumerate(grads.order) if not ok)
    last_good = grads.order[bad_at - 1][0].rsplit(".", 1)[0]
    assert f"between the gradients of {last_good} (finite) and this one" in event.message, event.message
    assert_untouched(before, model, optimizer)


def test_vit_compiled_names_the_same_parameter_as_eager():
    model = vit()
    poison = poison_backward_of(model.blocks[0].attn.q_norm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):  # before the first compiled call
        # aot_eager: AOTAutograd's joint graph, as inductor builds it, without code generation
        compiled = torch.compile(model, backend="aot_eager")
        arm = lambda i: poison.fill_(math.nan if i == BAD_STEP else 1.0)  # noqa: E731
        _, err, before = until_stop(vit_step(model, optimizer, compiled), model, optimizer, steps=4, arm=arm)
    assert_untouched(before, model, optimizer)
    # the oracle: the same weights and batch in eager mode, with a hook on every parameter
    twin = vit()
    twin.load_state_dict(before.state["params"], strict=False)
    poison_backward_of(twin.blocks[0].attn.q_norm).fill_(math.nan)
    grads = GradOracle(twin)
    x, y = image_batch(BAD_STEP)
    nn.functional.cross_entropy(twin(x), y).backward()
    first = grads.bad_params_of_first_module()
    assert first == {"blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias"}
    event = err.event
    assert (event.step, event.kind) == (BAD_STEP, "grad")
    assert event.layer in first, str(event)


def resnet_script(policy: str = "raise", steps: int = 4, poison_at: int | None = BAD_STEP):
    """The user's script: a timm ResNet whose loader gives one NaN pixel at step ``poison_at``."""
    model = resnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = nanguard.init(model, optimizer, on_nan=policy)
    oracle = ForwardOracle(model)

    def step(i):
        x, y = image_batch(i)
        if i == poison_at:
            x[1, 0, 5, 5] = math.nan
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, guard, oracle, step


def test_resnet_poisoned_batch_names_the_batch_and_replays(monkeypatch):
    model, optimizer, guard, oracle, step = resnet_script()
    with guard:
        _, err, before = until_stop(step, model, optimizer, steps=4, oracles=[oracle])
    truth = oracle.producer()
    assert (truth.name, truth.inputs_finite) == ("conv1.0", False)  # the batch's first stop
    event = err.event
    assert (event.step, event.kind, event.layer, event.module_type) == (BAD_STEP, "forward", "conv1.0", "Conv2d")
    assert (event.input_nonfinite, event.first_index, event.nan_count) == (True, (1, 0, 5, 5), 1)
    assert "input batch" in event.message
    changed = before.changed(model, optimizer)
    assert [n for n in changed if "running_" not in n] == []  # parameters and optimizer state (buffers: below)

    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    model, optimizer, guard, oracle, step = resnet_script(poison_at=None)  # the loader's clean batches
    with pytest.raises(SystemExit) as finished:
        step(0)
    assert finished.value.code == 0
    from nanguard.incident import read_incident

    report = read_incident(err.incident).replay_report()
    assert report["verdict"] == "reproducible", report["message"]
    first = report["trace"]["0"]["forward"][0]
    assert (first["module"], first["output"]["first_index"]) == ("<the captured batch>", [1, 0, 5, 5])
    assert_fed_as_captured(report)


def test_resnet_stop_leaves_batchnorm_statistics_as_before_the_step():
    model, optimizer, guard, oracle, step = resnet_script()
    with guard:
        _, err, before = until_stop(step, model, optimizer, steps=4)
    assert err.event.step == BAD_STEP
    assert_untouched(before, model, optimizer)
    assert_incident_holds(err, before)


def test_resnet_skip_leaves_batchnorm_statistics_and_eval_stays_finite():
    model, optimizer, guard, oracle, step = resnet_script(policy="skip")
    with guard:
        for i in range(4):
            before = StateBefore(model, optimizer)
            step(i)
            if i == BAD_STEP:
                assert guard.skipped_steps == 1
                assert_untouched(before, model, optimizer)
        model.eval()
        with torch.no_grad():
            out = model(image_batch(9)[0])
        assert torch.isfinite(out).all()
        assert [e.step for e in guard.events] == [BAD_STEP]


def faulted_run(model, fault, size=32):
    """Train on ``size``-pixel images until nanguard stops, ``fault`` applied before step BAD_STEP:
    (the error, an independent oracle's record of that step's module calls, the state before it)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):
        oracle = ForwardOracle(model)

        def arm(i):
            if i == BAD_STEP:
                with torch.no_grad():
                    fault()

        try:
            _, err, before = until_stop(vit_step(model, optimizer, size=size), model, optimizer, steps=4, arm=arm,
                                        oracles=[oracle])
        finally:
            oracle.close()
    return err, oracle, before


def forward_fault(model, fault):
    """The event of ``faulted_run`` and what its oracle saw make the first non-finite module output."""
    err, oracle, _ = faulted_run(model, fault)
    return err.event, oracle.producer()


def test_vit_nan_position_embedding_is_blamed_on_the_code_that_adds_it():
    # VisionTransformer adds pos_embed in its own code and hands the sum to pos_drop (a Dropout of
    # p=0, which returns its input): the first LayerNorm after it did not make the NaN
    model = vit()
    event, truth = forward_fault(model, lambda: model.pos_embed[0, 3, 5].fill_(math.nan))
    assert (truth.name, truth.inputs_finite) == ("pos_drop", False)
    assert (event.step, event.kind, event.layer, event.input_nonfinite) == (BAD_STEP, "forward", truth.name, True)
    assert "forward code of the root module, whose parameter(s) pos_embed are non-finite" in event.message


def test_efficientnet_bad_batchnorm_bias_is_named_in_the_norm_that_applies_it():
    # BatchNormAct2d runs F.batch_norm in its own forward; the Identity after it is the first
    # module to hand on the NaN, and the convolution after that took a NaN, it did not make one
    model = efficientnet()
    event, truth = forward_fault(model, lambda: model.blocks[3][0].bn2.bias[3].fill_(math.nan))
    assert (truth.name, truth.inputs_finite) == ("blocks.3.0.bn2.drop", False)
    assert (event.kind, event.layer, event.input_nonfinite) == ("forward", truth.name, True)
    assert "forward code of blocks.3.0.bn2, whose parameter(s) bias are non-finite" in event.message


@pytest.mark.parametrize("build, norm", [(resnet, "layer1.0.bn1"), (efficientnet, "blocks.3.0.bn2")],
                         ids=["resnet", "efficientnet"])
def test_a_frozen_batchnorm_with_a_negative_running_variance_is_named(build, norm):
    # fine-tuning with a norm frozen (eval) normalises by its running statistics: a variance below
    # zero (a corrupt checkpoint, say) makes NaN of finite inputs, and the statistic is named
    model = build()
    frozen = model.get_submodule(norm)

    def fault():
        frozen.eval()
        frozen.running_var[:4].fill_(-1.0)

    event, truth = forward_fault(model, fault)
    assert (event.step, event.kind, event.layer) == (BAD_STEP, "forward", truth.name), (event.layer, truth)
    assert "buffer(s) running_var held a variance at or below -eps" in event.message, event.message


def test_swin_attention_mask_buffer_handed_to_the_attention_is_named_in_the_block():
    # a shifted block keeps its attn_mask as a buffer and passes it to its attention's forward: a
    # NaN there was not made by the attention's code, which only received it
    model = swin()
    block = next(name for name, m in model.named_modules() if getattr(m, "attn_mask", None) is not None)
    mask = model.get_submodule(block).attn_mask
    event, truth = forward_fault(model, lambda: mask.view(-1)[5].fill_(math.nan))
    assert (truth.name, truth.inputs_finite) == (f"{block}.attn.softmax", False)
    assert (event.kind, event.layer, event.input_nonfinite) == ("forward", truth.name, True)
    assert f"forward code of {block}, whose buffer(s) attn_mask were non-finite when the step began (passed" \
        f" to {block}.attn as an argument already with NaN), or of {block}.attn itself" in event.message, event.message


def test_eva_nan_key_bias_buffer_hidden_by_the_forward_is_named_not_blamed_on_the_backward(monkeypatch):
    # EVA's attention joins its key bias (a non-persistent buffer) into the qkv bias in its own code:
    # a NaN there makes NaN keys, which the CPU's scaled_dot_product_attention hides from its output
    # (the forward's outputs and the loss are finite) but not from its backward
    model = eva()
    err, oracle, before = faulted_run(model, lambda: model.blocks[1].attn.k_bias[0].fill_(math.nan), size=28)
    assert err.event.step == BAD_STEP
    reached = [c.name for c in oracle.calls if not c.output_finite and c.name != "blocks.1.attn.k_norm"]
    event = err.event
    if reached:  # a torch whose attention passes the NaN on: a forward fault
        assert (event.kind, event.layer) == ("forward", reached[0]), (event, reached)
    else:  # only the Identity the keys pass through (its output: evidence, not a fault) held it
        assert event.kind == "grad" and "born in the backward pass" not in event.message, event.message
        assert ("the forward was not finite, though no module output checked was: the input of"
                " blocks.1.attn.k_norm held NaN, made in the forward code of blocks.1.attn, whose buffer(s)"
                " k_bias were non-finite when the step began") in event.message, event.message
    assert_untouched(before, model)

    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    replayed = eva()
    optimizer = torch.optim.AdamW(replayed.parameters(), lr=1e-3)
    with nanguard.init(replayed, optimizer), pytest.raises(SystemExit):
        vit_step(replayed, optimizer, size=28)(0)
    from nanguard.incident import read_incident

    report = read_incident(err.incident).replay_report()
    assert report["bad_state"] == {"0": ["blocks.1.attn.k_bias"]}, report  # a non-persistent buffer, saved apart
