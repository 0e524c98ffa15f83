"""transformers' GPT-2, BERT, T5 and Llama (tiny configs, no downloads) with a fault at a known place.

Every expected answer comes from the oracles (our own hooks), never from nanguard.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import nanguard
from helpers import (assert_fed_as_captured, assert_incident_holds, assert_untouched, needs,
                     until_stop)
from oracles import ForwardOracle
from zoo import bert, gpt2, llama, mixtral, t5, token_batch

needs("transformers")


def lm_step(model, optimizer, guard=None, *, labels=None, autocast=False, check=False, **extra):
    """One step of a causal-LM loop: the loss is computed inside the model (labels=)."""

    def step(i):
        ids = token_batch(i)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids if labels is None else labels(i, ids), **extra)
        if check:
            guard.check(out.loss)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def gpt2_script(fault_step: int = 2, steps: int = 4):
    """The user's script: GPT-2 whose MLP weight turns +inf before step ``fault_step``."""
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = nanguard.init(model, optimizer)
    oracle = ForwardOracle(model)

    def arm(i):
        if i == fault_step:
            with torch.no_grad():
                model.transformer.h[1].mlp.c_fc.weight[3, 5] = math.inf

    try:
        return model, optimizer, oracle, until_stop(lm_step(model, optimizer), model, optimizer, steps=steps,
                                                    arm=arm, oracles=[oracle])
    finally:
        guard.close()
        oracle.close()


def test_gpt2_inf_weight_names_the_module_that_made_it_and_replays(monkeypatch):
    model, optimizer, oracle, (step, err, before) = gpt2_script()
    truth = oracle.producer()
    assert (truth.name, truth.inputs_finite, truth.params_finite) == ("transformer.h.1.mlp.c_fc", True, False)
    event = err.event
    assert (step, event.step, event.rank) == (2, 2, 0)
    assert (event.kind, event.layer, event.module_type) == ("forward", truth.name, truth.module_type)
    assert (event.input_nonfinite, event.output_nonfinite) == (False, True)
    assert event.has_inf and not event.has_nan and event.first_index[-1] == 5
    assert "parameter(s) weight" in event.message
    assert_untouched(before, model, optimizer)
    assert_incident_holds(err, before)

    # the unchanged script again, replaying the incident: fed the captured batch, same verdict
    monkeypatch.setenv("NANGUARD_REPLAY", err.incident)
    with pytest.raises(SystemExit) as finished:
        gpt2_script(fault_step=-1)
    assert finished.value.code == 0
    from nanguard.incident import read_incident

    report = read_incident(err.incident).replay_report()
    assert report["verdict"] == "reproducible", report["message"]
    assert report["first_event"]["layer"] == truth.name and report["first_event"]["step"] == 2
    first = report["trace"]["0"]["forward"][0]
    assert (first["module"], first["inputs_finite"]) == (truth.name, True)
    assert_fed_as_captured(report)
    batch = read_incident(err.incident).rank_batches(0)[0]
    assert torch.equal(batch["kwargs"]["input_ids"], token_batch(2))


def test_gpt2_under_bf16_autocast_names_the_nan_weight():
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):
        oracle = ForwardOracle(model)

        def arm(i):
            if i == 1:
                with torch.no_grad():
                    model.transformer.h[0].attn.c_attn.weight[0, 7] = math.nan

        step, err, before = until_stop(lm_step(model, optimizer, autocast=True), model, optimizer, steps=3,
                                       arm=arm, oracles=[oracle])
    truth = oracle.producer()
    assert (truth.name, truth.inputs_finite) == ("transformer.h.0.attn.c_attn", True)
    event = err.event
    assert (event.step, event.kind, event.layer) == (1, "forward", truth.name)
    assert (event.input_nonfinite, event.dtype) == (False, "bfloat16")
    assert_untouched(before, model, optimizer)


def test_gpt2_on_nan_skip_drops_the_update_and_goes_on():
    model = gpt2()
    fc = model.transformer.h[0].mlp.c_proj
    armed = {"on": False}

    def fault(module, args, output):  # the user's own hook: registered before the guard's
        return output * math.nan if armed["on"] else None

    fc.register_forward_hook(fault)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer, on_nan="skip") as guard:
        oracle = ForwardOracle(model)
        step = lm_step(model, optimizer)
        for i in range(4):
            armed["on"] = i == 2
            oracle.reset()
            if i == 2:
                from oracles import StateBefore

                before = StateBefore(model, optimizer)
            step(i)
            if i == 2:
                assert_untouched(before, model, optimizer)
                truth = oracle.producer()
        assert guard.skipped_steps == 1 and guard.step == 4
        bad = [e for e in guard.events if e.kind == "forward"]
    assert len(bad) == 1
    assert (bad[0].step, bad[0].layer, bad[0].input_nonfinite) == (2, truth.name, False)
    assert truth.name == "transformer.h.0.mlp.c_proj" and truth.inputs_finite
    assert all(torch.isfinite(p).all() for p in model.parameters())


def ignored_at_step_1(i, ids):
    """Labels all -100 (ignored) at step 1: the model's mean cross-entropy is 0/0."""
    return torch.full_like(ids, -100) if i == 1 else ids


@pytest.mark.modes("sentinel", "full")
def test_gpt2_all_ignored_labels_name_the_loss_field_and_stop_nothing(guard_mode):
    """Every label ignored: the model's mean over no token is 0/0, a NaN loss whose gradients are
    finite (zero). The update depends on no bad value, so nothing stops (What stops a step); the full
    mode, which probes the model's output, says which field in a warning event."""
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer) as guard:
        oracle = ForwardOracle(model)
        step = lm_step(model, optimizer, labels=ignored_at_step_1)
        for i in range(3):
            oracle.reset() if hasattr(oracle, "reset") else oracle.order.clear()
            step(i)
            if i == 1:
                truth = oracle.producer()
        events = list(guard.events)
        assert guard.step == 3 and guard.skipped_steps == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (truth.name, truth.inputs_finite) == ("", True)  # the model's own code: 0/0 in the mean
    if guard_mode == "sentinel":
        assert events == []
        return
    (event,) = events
    assert (event.step, event.layer, event.input_nonfinite, event.output_nonfinite) == (1, "", False, True)
    text = str(event)
    assert re.search(r"\bloss\b", text), text  # which field of the ModelOutput
    assert "first at []" not in text, text  # a 0-d value is printed plainly
    assert "reached none of what the update depends on" in text, text


def test_gpt2_check_of_the_model_loss_reports_kind_loss():
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer) as guard:
        step, err, before = until_stop(lm_step(model, optimizer, guard, labels=ignored_at_step_1, check=True),
                                       model, optimizer, steps=3)
    assert (err.event.step, err.event.kind, err.event.layer) == (1, "loss", "loss")
    assert "first at []" not in str(err.event)
    assert_untouched(before, model, optimizer)


def test_bert_bf16_huge_layernorm_weight_blames_the_layernorm_that_made_the_nan():
    model = bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaled = model.bert.encoder.layer[0].attention.output.LayerNorm
    with nanguard.init(model, optimizer, detail_mb=0):
        oracle = ForwardOracle(model)

        def arm(i):
            if i == 1:
                with torch.no_grad():
                    scaled.weight.mul_(1e37)

        def step(i):
            ids = token_batch(i, batch=16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        _, err, before = until_stop(step, model, optimizer, steps=3, arm=arm, oracles=[oracle])
    truth = oracle.producer()
    scaled_call = next(c for c in oracle.calls if c.name == "bert.encoder.layer.0.attention.output.LayerNorm")
    assert scaled_call.output_finite  # huge (~1e37) but finite: not a fault
    assert (truth.name, truth.inputs_finite) == ("bert.encoder.layer.0.output.LayerNorm", True)
    event = err.event
    assert (event.step, event.kind, event.layer) == (1, "forward", truth.name)
    assert (event.input_nonfinite, event.output_nonfinite) == (False, True)
    assert_untouched(before, model, optimizer)


def test_bert_additive_minus_inf_attention_mask_is_not_a_fault():
    """A 4-d additive mask of 0 and -inf given to BERT (eager attention) reaches every layer
    positionally; every output stays finite, so nothing stops."""
    model = bert(attn_implementation="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.zeros(4, 1, 16, 16)
    mask[:, :, :, 12:] = -math.inf  # padding
    with nanguard.init(model, optimizer) as guard:
        oracle = ForwardOracle(model)
        for i in range(3):
            oracle.reset()
            ids = token_batch(i)
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert guard.step == 3 and guard.events == []
    assert oracle.producer() is None
    assert "bert.encoder.layer.0" in [c.name for c in oracle.nonfinite_inputs()]


def test_t5_nan_weight_in_the_decoder_feed_forward():
    model = t5()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-3)
    wo = model.decoder.block[1].layer[2].DenseReluDense.wo
    with nanguard.init(model, optimizer):
        oracle = ForwardOracle(model)

        def arm(i):
            if i == 2:
                with torch.no_grad():
                    wo.weight[1, 2] = math.nan

        def step(i):
            ids = token_batch(i, seq=12)
            out = model(input_ids=ids, labels=token_batch(i + 100, seq=8))
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        _, err, before = until_stop(step, model, optimizer, steps=4, arm=arm, oracles=[oracle])
    truth = oracle.producer()
    assert (truth.name, truth.inputs_finite, truth.params_finite) == (
        "decoder.block.1.layer.2.DenseReluDense.wo", True, False)
    event = err.event
    assert (event.step, event.kind, event.layer, event.module_type) == (2, "forward", truth.name, "Linear")
    assert (event.input_nonfinite, event.output_nonfinite) == (False, True)
    assert_untouched(before, model, optimizer)
    assert_incident_holds(err, before)


@pytest.mark.parametrize("fault", ["inf weight", "overflow in attention code", "nan rotary frequency"])
def test_llama_names_the_module_or_the_code_between_modules_that_made_the_value(fault):
    """A weight of the feed-forward turned +inf is born in down_proj; queries and keys so large
    that their scores overflow make the NaN in the attention's own code (scaled_dot_product_attention,
    no module), which o_proj only receives: the report must tell the two apart. A NaN in the rotary
    embedding's frequencies (a buffer) is born there, and named."""
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    layer = model.model.layers[1]

    def arm(i):
        if i == 1:
            with torch.no_grad():
                if fault == "inf weight":
                    layer.mlp.down_proj.weight[3, 5] = math.inf
                elif fault == "nan rotary frequency":
                    model.model.rotary_emb.inv_freq[3] = math.nan
                else:  # finite queries and keys whose products pass float32's range
                    layer.self_attn.q_proj.weight.mul_(1e25)
                    layer.self_attn.k_proj.weight.mul_(1e25)

    with nanguard.init(model, optimizer):
        oracle = ForwardOracle(model)
        step, err, before = until_stop(lm_step(model, optimizer), model, optimizer, steps=3, arm=arm,
                                       oracles=[oracle])
        oracle.close()
    truth = oracle.producer()
    event = err.event
    assert (step, event.step, event.kind) == (1, 1, "forward")
    assert (event.layer, event.module_type) == (truth.name, truth.module_type)
    assert event.input_nonfinite is (not truth.inputs_finite)
    if fault == "inf weight":
        assert (truth.name, truth.inputs_finite) == ("model.layers.1.mlp.down_proj", True)
        assert "parameter(s) weight" in event.message
    elif fault == "nan rotary frequency":
        assert (truth.name, truth.inputs_finite) == ("model.rotary_emb", True)
        assert "inputs were finite but its buffer(s) inv_freq were non-finite when the step began" in event.message
    else:
        assert (truth.name, truth.inputs_finite) == ("model.layers.1.self_attn.o_proj", False)
        assert "forward code of model.layers.1.self_attn" in event.message
    assert_untouched(before, model, optimizer)


def test_mixtral_nan_expert_weight_is_named_in_the_experts_own_code():
    """The experts apply their own gate_up_proj in their forward code, then hand the result to
    act_fn: the report names that code and that parameter, not the router's parent."""
    model = mixtral()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    experts = model.model.layers[0].mlp.experts

    def arm(i):
        if i == 1:
            with torch.no_grad():
                experts.gate_up_proj[:, 3, 5] = math.nan  # in every expert: whichever is routed to

    with nanguard.init(model, optimizer):
        oracle = ForwardOracle(model)
        step, err, before = until_stop(lm_step(model, optimizer), model, optimizer, steps=3, arm=arm,
                                       oracles=[oracle])
        oracle.close()
    truth, event = oracle.producer(), err.event
    assert (truth.name, truth.inputs_finite) == ("model.layers.0.mlp.experts.act_fn", False)
    assert (step, event.kind, event.layer, event.input_nonfinite) == (1, "forward", truth.name, True)
    assert "forward code of model.layers.0.mlp.experts, whose parameter(s) gate_up_proj are non-finite" \
        in event.message, event.message
    assert_untouched(before, model, optimizer)


@pytest.mark.modes("full")  # (it counts the module probes of a clean step, which the sentinel makes none of)
def test_the_key_value_cache_decoders_carry_in_training_is_not_probed_layer_after_layer():
    """GPT-2 hands its DynamicCache (use_cache defaults to True, in training too) to every layer
    and returns it: the keys and values in it are made inside the attention, whose output is
    checked. A step probes the same tensors with the cache as without it, at any depth."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reductions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.__name__.startswith("aminmax")
            return func(*args, **(kwargs or {}))

    counts = {}
    for layers in (2, 4, 6):
        for use_cache in (False, True):
            model = gpt2(n_layer=layers)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            with nanguard.init(model, optimizer):
                lm_step(model, optimizer, use_cache=use_cache)(0)
                with Reductions() as probes:
                    lm_step(model, optimizer, use_cache=use_cache)(1)
            counts[layers, use_cache] = probes.count
    assert all(counts[layers, True] == counts[layers, False] for layers in (2, 4, 6)), counts
    assert counts[6, True] - counts[4, True] == counts[4, True] - counts[2, True] > 0, counts  # as many per layer


class _Act(torch.nn.Module):
    """A wrapper of an activation whose own forward code makes the NaN (a log of a negative) once armed."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.armed = inner, False

    def forward(self, x):
        y = self.inner(x)
        return y + torch.log(-torch.ones_like(y[..., :1])) if self.armed else y


def test_gpt2_compiled_beside_the_users_own_hooks_never_claims_code_it_did_not_check():
    # the user's own forward hooks (the oracle's: data-dependent) break the compiled graph into
    # pieces: some modules run compiled, where containers and inputs are not checked, others
    # eagerly. A NaN born in a container's own code that ran compiled must not be claimed as born
    # in the code between modules: named where the oracle saw it, or hedged
    model = gpt2()
    act = model.transformer.h[1].mlp.act = _Act(model.transformer.h[1].mlp.act)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):
        oracle = ForwardOracle(model)
        compiled = torch.compile(model, backend="aot_eager")

        def arm(i):
            act.armed = i == 2

        try:
            _, err, before = until_stop(lm_step(compiled, optimizer), model, optimizer, steps=4, arm=arm,
                                        oracles=[oracle])
        finally:
            oracle.close()
    assert_untouched(before, model, optimizer)
    producer = oracle.producer()
    assert (producer.name, producer.inputs_finite) == ("transformer.h.1.mlp.act", True)
    event = err.event
    assert event.step == 2
    assert event.layer == producer.name or "compiled graph" in event.message, str(event)
    assert "born outside any module" not in event.message, str(event)
