"""DESIGN.md's Trust rules, each on a model built to break it: a finite tensor never reads as
non-finite, a non-finite input alone never stops a step, gradients are judged as they are
produced, norms never overflow on finite gradients, and whatever a module returns is looked into."""

from __future__ import annotations

import contextlib
import copy
import logging

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_guard import GradFault, NanBackward
from torch import nn

import nanguard
from nanguard.rank.hooks import FINITE_PRESERVING


class MaskedAttention(nn.Module):
    """A causal attention that adds a -inf mask to its scores, as half the transformers in use do."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, width)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        mask = torch.full(scores.shape[-2:], -math.inf).triu(1)
        return self.softmax(scores + mask) @ x  # the masked scores reach Softmax as its input


def assert_trains_clean(model: nn.Module, steps: int = 3) -> None:
    """``steps`` steps of ``model`` on (4, 5, 8) batches: no event, every step taken."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.init(model, optimizer) as guard:
        for _ in range(steps):
            model(torch.randn(4, 5, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert guard.step == steps and guard.events == []


def test_an_additive_minus_inf_mask_never_stops_a_step():
    torch.manual_seed(0)
    assert_trains_clean(nn.Sequential(nn.Linear(8, 8), MaskedAttention(), nn.Linear(8, 2)))


class Huge(nn.Module):
    """Finite, and huge: a float32 sum of its output overflows."""

    def forward(self, x):
        return x.sign() * 3e37 + x


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return x * math.nan if self.armed else x / 1e37


@pytest.mark.modes("sentinel", "full")
def test_a_batch_refilled_in_place_before_the_decision_is_not_taken_for_finite(guard_mode):
    # accumulation from one static input buffer: by the step's decision, micro-batch 0's NaN
    # batch has been overwritten by micro-batch 1's, and cannot be checked any more
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for static in (True, False):
        with nanguard.init(model, optimizer, on_nan="warn") as guard:
            buffer = torch.randn(32, 8)
            for k in range(2):
                batch = buffer if static else torch.empty(32, 8)
                batch.copy_(torch.randn(32, 8))
                batch[3, 2] = math.nan if k == 0 else 0.0
                model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            event = guard.events[-1]
        if static and guard_mode == "sentinel":
            # micro-batch 0 cannot be re-run, so nothing is named from the re-run: not "the forward was finite"
            assert (event.kind, event.micro_batch, event.reproduced) == ("grad", None, None), event
            assert "its input was changed in place after its forward began" in event.message
            assert "the forward was finite" not in event.message
            continue
        assert (event.layer, event.micro_batch) == ("0", 0)
        if static:
            assert event.input_nonfinite is None and "could not be checked" in event.message
        else:
            assert event.input_nonfinite is True and "input batch of the model was already" in event.message


def test_a_static_input_buffer_is_checked_as_each_forward_was_fed_after_the_first_step():
    # the same loop run on: after the first step, which found the buffer refilled, each batch
    # is held as fed (with captures on), so the NaN of micro-batch 0 is found in the batch exactly
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    buffer = torch.empty(32, 8)
    with nanguard.init(model, optimizer, on_nan="warn") as guard:
        for step in range(3):
            for k in range(2):
                buffer.copy_(torch.randn(32, 8))
                buffer[3, 2] = math.nan if (step, k) == (2, 0) else 0.0
                model(buffer).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        (event,) = guard.events
    assert (event.step, event.layer, event.micro_batch) == (2, "0", 0)
    assert event.input_nonfinite is True and "input batch of the model was already" in event.message
    assert event.bad_count == 1 and tuple(event.first_index) == (3, 2)


def test_a_huge_finite_tensor_is_never_read_as_non_finite_nor_blamed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), Huge(), Broken(), nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.init(model, optimizer, detail_mb=0) as guard:  # nothing kept: probes alone
        for step in range(3):
            model[2].armed = step == 2
            try:
                model(torch.randn(32, 8)).sum().backward()
                optimizer.step()
            except nanguard.NonFiniteError as err:
                event = err.event
            optimizer.zero_grad()
    assert event.step == 2 and event.layer == "2" and event.input_nonfinite is False
    assert event.has_nan and "born in this module" in event.message
    assert [e.layer for e in guard.events] == ["2"]  # the huge, finite steps read clean


def _finite_preserving_instance(cls: type) -> nn.Module:
    if issubclass(cls, (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)):
        return cls(2)
    if issubclass(cls, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        return cls(2)
    if cls is nn.Unflatten:
        return cls(-1, (2, 4))
    return cls(dim=-1) if cls is nn.Softmax else cls()


@pytest.mark.parametrize("cls", sorted(FINITE_PRESERVING, key=lambda c: c.__name__), ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_what_is_passed_unchecked_as_finite_preserving_is_so_for_every_finite_input(cls, data):
    """Modules whose outputs are not probed (their input's probe covers them) must make a finite
    output of every finite input, the extremes of every floating dtype included."""
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]))
    big = torch.finfo(dtype).max
    extremes = st.sampled_from([big, -big, big / 2, -big / 6, torch.finfo(dtype).tiny, 0.0, -0.0])
    values = data.draw(st.lists(extremes | st.floats(-big, big, allow_nan=False), min_size=8, max_size=8))
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    x = torch.where(x.isfinite(), x, torch.zeros((), dtype=dtype))  # rounding to a narrow dtype
    shape = {"1d": (1, 1, 8), "2d": (1, 1, 2, 4), "3d": (1, 1, 2, 2, 2)}.get(cls.__name__[-2:], (1, 8))
    out = _finite_preserving_instance(cls)(x.reshape(shape))
    assert out.isfinite().all(), (cls.__name__, dtype, x.tolist(), out.flatten().tolist())


class ScaledGELU(nn.GELU):
    """A subclass of a finite-preserving activation that writes its own forward: it is checked."""

    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, x):
        return super().forward(x) / self.scale


class Overflowing(nn.Module):
    def __init__(self, activation: nn.Module):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(4, 8), activation, nn.Linear(8, 2)
        self.huge = False

    def forward(self, x):
        h = self.up(x)
        return self.down(self.act(h.abs() + 2.5e38 if self.huge else h))


@pytest.mark.parametrize("case", ["subclass", "gelu-overflow", "hardswish-overflow"])
def test_an_activation_that_makes_the_first_inf_is_named_not_the_layer_after_it(case):
    torch.manual_seed(0)
    model = Overflowing({"subclass": ScaledGELU(), "gelu-overflow": nn.GELU(),
                         "hardswish-overflow": nn.Hardswish()}[case])
    if case != "subclass" and model.act(torch.full((8,), 2.5e38)).isfinite().all():
        # (the oracle, this machine's own kernel: AVX2's GELU computes 0.5 * x * (1 + erf) and makes no Inf)
        pytest.skip(f"{type(model.act).__name__}'s kernel on this CPU makes no Inf of 2.5e38: nothing to name")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.init(model, optimizer) as guard:
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        if case == "subclass":
            model.act.scale = 0.0
        else:
            model.huge = True  # finite (2.5e38 < 3.4e38): the activation's own arithmetic overflows
        with pytest.raises(nanguard.NonFiniteError) as info:
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
    event = info.value.event
    assert (event.layer, event.input_nonfinite, event.output_nonfinite) == ("act", False, True), event
    assert [e.layer for e in guard.events] == ["act"]


@pytest.mark.parametrize("calls", ["the model", "its modules"])
@pytest.mark.parametrize("rewrite", ["clip_grad_norm_", "unscale"])
def test_what_the_loop_does_to_gradients_after_backward_cannot_move_the_blame(rewrite, calls):
    # "its modules": the script calls them one by one, as a Lightning training_step calls a
    # model's parts: the model's own forward never runs, yet its backward pass is still watched
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), GradFault(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        model[3].armed = True
        x = torch.randn(4, 8)
        if calls == "the model":
            x = model(x)
        else:
            for module in model:
                x = module(x)
        x.sum().backward()
        if rewrite == "clip_grad_norm_":
            # the total norm is NaN, so every gradient becomes NaN: the last layer's too
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            for p in model.parameters():
                p.grad.mul_(math.nan)  # a loop's own rewrite of every gradient
        assert all(torch.isnan(p.grad).all() for p in model.parameters())
        with pytest.raises(nanguard.NonFiniteError) as info:
            optimizer.step()
    event = info.value.event
    # born in the backward of GradFault: the first gradient it poisoned is the one of the layer before it
    assert event.kind == "grad" and event.layer == "2.weight", event
    assert "born in the backward pass between the gradients of 4 (finite) and this one" in event.message
    assert "without parameters: 3 (GradFault)" in event.message
    assert guard.step == 1


@pytest.mark.parametrize("layer", ["linear", "sparse embedding"])
def test_a_gradient_norm_past_float_range_still_warns(layer):
    torch.manual_seed(0)
    model = nn.Linear(64, 64) if layer == "linear" else nn.Embedding(64, 64, sparse=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.init(model, optimizer, grad_norm_warn=1.0) as guard:
        batch = torch.randn(8, 64) if layer == "linear" else torch.arange(8)
        (model(batch) * 1e37).sum().backward()  # finite gradients, L2 norm > 3.4e38
        assert all(torch.isfinite(p.grad.to_dense()).all() for p in model.parameters())
        optimizer.step()
    warning = next(e for e in guard.events if e.kind == "grad_norm")
    assert math.isfinite(warning.grad_norm) and warning.grad_norm > 1e38
    assert math.isfinite(guard.last_grad_norm)


class Policy(nn.Module):
    """Returns a distribution: the tensors it holds are what a NaN reaches."""

    def __init__(self):
        super().__init__()
        self.mean = nn.Linear(4, 2)
        self.broken = False

    def forward(self, x):
        scale = torch.full((x.shape[0], 2), math.nan if self.broken else 1.0)
        return torch.distributions.Normal(self.mean(x), scale, validate_args=False)


def test_an_object_a_module_returns_is_looked_into():
    model = Policy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.broken = True
    with nanguard.init(model, optimizer):
        with pytest.raises(nanguard.NonFiniteError) as info:
            dist = model(torch.randn(3, 4))
            dist.log_prob(torch.zeros(3, 2)).sum().backward()  # (the NaN scale reaches the gradients)
            optimizer.step()
    event = info.value.event
    assert event.kind == "forward" and event.has_nan and event.module_type == "Policy"


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def state(model, optimizer):
    import copy

    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_stopped_or_skipped_step_leaves_batchnorm_statistics_as_they_were(policy, tmp_path):
    from nanguard.incident import read_incident

    model = bn_model()
    optimizer = torch.optim.Adam(model.parameters())
    with nanguard.init(model, optimizer, on_nan=policy, capture=True) as guard:
        for step in range(4):
            x = torch.randn(16, 4)
            if step == 2:
                x[3, 1] = math.nan
                before = state(model, optimizer)
            try:
                model(x).sum().backward()
                optimizer.step()
            except nanguard.NonFiniteError:
                break
            finally:
                optimizer.zero_grad()
            if step == 2:
                after = state(model, optimizer)
        if policy == "raise":
            after = state(model, optimizer)
        for name, value in before[0].items():
            assert torch.equal(value, after[0][name]), f"{name} changed"  # running stats, batch count
        assert repr(before[1]) == repr(after[1])
        saved = read_incident(guard.incident).rank_state(0)["model"]
        assert all(torch.equal(saved[name], value) for name, value in before[0].items())
    model.eval()
    assert torch.isfinite(model(torch.randn(5, 4))).all()


def test_a_buffer_written_non_finite_behind_finite_outputs_is_an_event():
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        kept = model[0].running_var.clone()
        x = torch.randn(8, 4) * 1e20  # its variance overflows float32; the normalised output does not
        out = model(x)
        assert torch.isfinite(out).all() and not torch.isfinite(model[0].running_var).all()
        out.sum().backward()
        with pytest.raises(nanguard.NonFiniteError) as info:
            optimizer.step()
        assert torch.equal(model[0].running_var, kept)
    event = info.value.event
    assert event.kind == "buffer" and event.layer == "0.running_var" and event.module_type == "BatchNorm1d"
    assert guard.step == 2


def _stop_at_step_2(model, fault, width=8, tokens=None):
    """The event of a step-2 stop of ``model`` trained on (4, width) batches, (4, tokens, width) ones
    given ``tokens``, ``fault`` applied before step 2."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.init(model, optimizer):
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    fault()
            model(torch.randn(4, width) if tokens is None else torch.randn(4, tokens, width)).sum().backward()
            try:
                optimizer.step()
            except nanguard.NonFiniteError as err:
                return err.event
            optimizer.zero_grad()
    raise AssertionError("no stop")


@pytest.mark.parametrize("fault, words", [
    (lambda norm: norm.running_mean.fill_(math.nan), "buffer(s) running_mean were non-finite when the step began"),
    (lambda norm: norm.running_mean.fill_(-math.inf), "buffer(s) running_mean were non-finite when the step began"),
    (lambda norm: norm.running_var[2:5].fill_(-1.0), "buffer(s) running_var held a variance at or below -eps"),
], ids=["nan-mean", "inf-mean", "negative-var"])
@pytest.mark.parametrize("kind", ["BatchNorm1d", "NormAct"])
def test_a_norm_in_eval_with_bad_running_statistics_is_named_with_them(fault, words, kind):
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8) if kind == "BatchNorm1d" else NormAct(8)
    model = nn.Sequential(nn.Linear(4, 8), norm, nn.Linear(8, 2))
    event = _stop_at_step_2(model, lambda: (norm.eval(), fault(norm)), width=4)  # frozen, then corrupt
    if kind == "BatchNorm1d":  # its kernel made the value: its statistics are named as what made it
        assert (event.layer, event.input_nonfinite) == ("1", False) and f"inputs were finite but its {words}" \
            in event.message, event.message
    else:  # its own code called the kernel, and a child passed the value on (infinities alone, as a
        # mask: on to the next module's output, whose report names the code that made them)
        assert event.layer in ("1.drop", "2") and f"forward code of 1, whose {words}" in event.message, event.message


def test_a_running_statistic_already_non_finite_when_the_step_began_is_not_said_to_be_written_by_it():
    torch.manual_seed(0)
    model = bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        for step in range(3):
            if step == 2:
                model[1].running_mean[3] = math.nan  # a checkpoint loaded with it, say
            model(torch.randn(16, 4)).sum().backward()
            with contextlib.suppress(nanguard.NonFiniteError):
                optimizer.step()
            optimizer.zero_grad()
    event = guard.events[0]
    assert (event.kind, event.layer, event.step) == ("buffer", "1.running_mean", 2)
    assert "non-finite already when the step began" in event.message and "written by this step" not in event.message


class Smoothed(nn.Module):
    """Keeps, in a buffer its forward writes, an average of its weight; and a -inf mask in another."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.register_buffer("average", torch.zeros(width))
        self.register_buffer("mask", torch.where(torch.arange(width) > 3, -math.inf, 0.0))

    def forward(self, x):
        with torch.no_grad():
            self.average.mul_(0.9).add_(0.1 * self.weight)
        return x * self.weight + self.mask.exp()


def test_buffers_this_step_made_bad_and_masks_are_not_named_as_what_made_a_value():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Smoothed(), nn.Linear(8, 2))
    event = _stop_at_step_2(model, lambda: model[1].weight.fill_(math.nan))
    # (the step wrote its NaN weight into the average, which the stop then put back)
    assert event.layer == "1" and "inputs were finite but its parameter(s) weight are non-finite" == \
        event.message.split("; ")[0], event.message
    assert "average" not in event.message and "mask" not in event.message


class WarmedUp(nn.Module):
    """Scales by a statistic kept in a buffer that it starts writing only after a warm-up of two
    calls: 0/0, NaN, for a feature made constant."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("scale", torch.ones(width))
        self.calls = 0

    def forward(self, x):
        h = self.lin(x)
        self.calls += 1
        if self.calls > 2:
            with torch.no_grad():
                self.scale.copy_((h - h.mean(0)).abs().amax(0) / h.std(0))
        return h * self.scale


def test_a_buffer_first_written_in_the_bad_step_is_not_named_as_it_began_and_its_loss_is_told(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(WarmedUp(), nn.Linear(8, 2))
    event = _stop_at_step_2(model, lambda: model[0].lin.weight[4].zero_())  # finite, and constant
    assert (event.layer, event.input_nonfinite) == ("0", False) and "buffer" not in event.message, event.message
    assert any("0.scale were first written in this step" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fault", ["nan weight", "overflowing weight"])
def test_running_statistics_a_norm_in_training_does_not_use_are_not_named(fault):
    # in training a BatchNorm normalises by the batch's statistics: a NaN running_mean (a checkpoint
    # loaded with it) did not make its output
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

    def corrupt():
        model[1].running_mean[0] = math.nan
        model[1].weight[5] = math.nan if fault == "nan weight" else 3e38

    event = _stop_at_step_2(model, corrupt, width=4)
    assert (event.layer, event.input_nonfinite) == ("1", False) and "running_mean" not in event.message, event.message


def test_a_variance_below_zero_but_above_minus_eps_is_not_named():
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8)
    model = nn.Sequential(nn.Linear(4, 8), norm, nn.Linear(8, 2))

    def corrupt():
        norm.eval()
        norm.running_var[0] = -norm.eps / 10  # the root of variance + eps is finite
        norm.weight[5] = math.nan

    event = _stop_at_step_2(model, corrupt, width=4)
    assert "parameter(s) weight" in event.message and "running_var" not in event.message, event.message


class ToldMask(nn.Module):
    """An attention that adds the mask it is given as an argument."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.qk, self.softmax = nn.Linear(width, 2 * width), nn.Softmax(-1)

    def forward(self, x, mask):
        q, k = self.qk(x).chunk(2, -1)
        return self.softmax(q @ k.transpose(-1, -2) + mask) @ x


class GivesMask(nn.Module):
    """Hands its own mask (a buffer, as Swin's attn_mask, or a parameter, a learned bias) to its
    attention as an argument."""

    def __init__(self, kind: str, width: int = 8, tokens: int = 5):
        super().__init__()
        self.attn = ToldMask(width)
        if kind == "parameter":
            self.bias = nn.Parameter(torch.zeros(tokens, tokens))
        else:
            self.register_buffer("bias", torch.zeros(tokens, tokens))

    def forward(self, x):
        return x + self.attn(x, mask=self.bias)


@pytest.mark.parametrize("kind", ["buffer", "parameter"])
def test_a_parents_state_handed_to_a_child_as_an_argument_is_named_where_it_was_made(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), GivesMask(kind), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.init(model, optimizer):
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    model[1].bias[3, 1] = math.nan
            model(torch.randn(4, 5, 8)).sum().backward()
            try:
                optimizer.step()
            except nanguard.NonFiniteError as err:
                event = err.event
                break
            optimizer.zero_grad()
    words = "buffer(s) bias were non-finite" if kind == "buffer" else "parameter(s) bias are non-finite"
    assert (event.layer, event.input_nonfinite) == ("1.attn.softmax", True)
    assert f"forward code of 1, whose {words}" in event.message and "(passed to 1.attn as an argument already" \
        " with NaN), or of 1.attn itself" in event.message, event.message


class Tempered(nn.Module):
    """An attention whose own temperature scales its scores, and which ignores the mask it is given."""

    def __init__(self):
        super().__init__()
        self.temp, self.softmax = nn.Parameter(torch.ones(())), nn.Softmax(-1)

    def forward(self, x, mask):
        return self.softmax(x @ x.transpose(-1, -2) * self.temp) @ x


def test_the_hedge_of_a_nan_argument_names_the_state_of_the_call_that_took_it():
    torch.manual_seed(0)
    model = GivesMask("buffer")
    model.attn = Tempered()

    def corrupt():
        model.bias[3, 1] = math.nan  # handed over, unused
        model.attn.temp.fill_(math.nan)  # what makes the value

    event = _stop_at_step_2(model, corrupt, tokens=5)
    assert event.layer == "attn.softmax" and "(passed to attn as an argument already with NaN), or of attn itself," \
        " whose parameter(s) temp are non-finite" in event.message, event.message


class Sloped(nn.Module):
    """ALiBi as MPT builds it: the root makes a bias from its slopes and hands it to a block, which
    hands it on to its attention (two levels of arguments)."""

    def __init__(self, width: int = 8, tokens: int = 5):
        super().__init__()
        self.register_buffer("slopes", torch.ones(1))
        self.distance = torch.arange(tokens)[None] - torch.arange(tokens)[:, None]
        self.block = GivesOn(width)
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        return self.head(self.block(x, self.slopes * self.distance))


class GivesOn(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.attn = ToldMask(width)

    def forward(self, x, bias):
        return x + self.attn(x, mask=bias)


def test_a_nan_argument_handed_down_two_levels_is_followed_to_the_code_that_made_it():
    torch.manual_seed(0)
    model = Sloped()
    event = _stop_at_step_2(model, lambda: model.slopes.fill_(math.nan), tokens=5)
    assert event.layer == "block.attn.softmax" and "forward code of the root module, whose buffer(s) slopes were" \
        " non-finite when the step began (passed to block as an argument already with NaN)" in event.message, \
        event.message


class Unused(nn.Module):
    """Takes a mask it does not use; its own gain makes the value."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.g = nn.Parameter(torch.ones(width))

    def forward(self, x, mask):
        return x * self.g


class HandsUnused(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))
        self.scale = Unused(width)

    def forward(self, x):
        return self.scale(x, mask=self.bias * 1.0)


def test_a_nan_input_the_module_did_not_use_does_not_hide_its_own_bad_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), HandsUnused(), nn.Linear(8, 2))

    def corrupt():
        model[1].bias[0] = math.nan  # handed over, unused
        model[1].scale.g[3] = math.nan  # what makes the value

    event = _stop_at_step_2(model, corrupt)
    assert event.layer == "1.scale" and "or it was made here, where its parameter(s) g are non-finite" \
        in event.message, event.message


def test_a_bad_step_whose_diagnosis_fails_is_still_stopped_and_says_so(monkeypatch):
    # fault injection: the diagnosis raising must not take the training loop (or the other ranks,
    # waiting in the decision's collectives) down with it
    from nanguard.rank import diagnose

    def broken(*args, **kwargs):
        raise RecursionError("injected")

    monkeypatch.setattr(diagnose, "first_bad", broken)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    event = _stop_at_step_2(model, lambda: model[0].weight.fill_(math.nan))
    assert (event.kind, event.layer, event.step) == ("forward", "unknown", 2)
    assert "the diagnosis failed (RecursionError: injected)" in event.message


class SoftmaxInCode(nn.Module):
    """An attention whose softmax is a tensor method, not a module: its projection takes the NaN."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x, mask):
        return self.proj((x @ x.transpose(-1, -2) + mask).softmax(-1) @ x)


class PaddedAttention(nn.Module):
    """Adds a padding mask from the batch to its own mask buffer and hands the sum to its attention."""

    def __init__(self, width: int = 8, tokens: int = 5):
        super().__init__()
        self.register_buffer("mask", torch.zeros(tokens, tokens))
        self.att, self.head = SoftmaxInCode(width), nn.Linear(width, 2)

    def forward(self, x, padding):
        return self.head(self.att(x, mask=self.mask + padding[:, None, :]) + x)


def test_a_nan_the_batch_brought_into_an_argument_is_told_as_the_batchs():
    torch.manual_seed(0)
    model = PaddedAttention()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.init(model, optimizer):
        for step in range(3):
            padding = torch.zeros(4, 5)
            if step == 2:
                padding[1, 3] = math.nan
            model(torch.randn(4, 5, 8), padding).sum().backward()
            try:
                optimizer.step()
            except nanguard.NonFiniteError as err:
                event = err.event
                break
    assert event.input_nonfinite and "the input batch of the model was already non-finite" in event.message
    assert "born outside any module" not in event.message, event.message


def test_modules_the_script_calls_directly_under_a_root_that_never_runs_are_not_blamed_on_the_root():
    # a GAN kept in one container: the script calls G and D itself, so the root ModuleDict never ran
    torch.manual_seed(0)
    gan = nn.ModuleDict({"G": nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8)), "D": nn.Sequential(nn.Linear(8, 1))})
    optimizer = torch.optim.SGD(gan.parameters(), lr=0.0)
    with nanguard.init(gan, optimizer):
        for step in range(3):
            real = torch.randn(4, 8)
            if step == 2:
                real[1, 2] = math.nan  # the data
            (gan["D"](gan["G"](torch.randn(4, 4))).mean() - gan["D"](real).mean()).backward()
            try:
                optimizer.step()
            except nanguard.NonFiniteError as err:
                event = err.event
                break
    assert event.layer == "D.0" and "the training script, outside the model (its root module ran no forward" \
        in event.message and "the root module" not in event.message, event.message


def test_a_gradient_with_no_forward_checked_does_not_say_the_forward_was_finite():
    # a bare init() never sees a model compiled in place: its hooks run inside the compiled frame
    torch._dynamo.reset()
    guard = nanguard.init()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        model.compile(backend="aot_eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    model[1].weight[0, 0] = math.nan
            model(torch.randn(4, 4)).sum().backward()
            with contextlib.suppress(nanguard.NonFiniteError):
                optimizer.step()
            optimizer.zero_grad()
        event = guard.events[0]
    finally:
        guard.close()
        torch._dynamo.reset()
    assert event.kind == "grad" and "no module output of the model was checked in this step" in event.message
    assert "born in the backward pass" not in event.message


class Counting(nn.Module):
    """Writes buffers of every kind in its forward: a float one holding -0.0, a denormal and a huge
    value (each must come back bit for bit), an int counter and a bool flag."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("stats", torch.tensor([-0.0, 3e38, 1e-40, 0.5]))
        self.register_buffer("count", torch.tensor(0))
        self.register_buffer("seen", torch.tensor([False, True]))
        self.poison = False

    def forward(self, x):
        with torch.no_grad():
            self.stats[3] += 1.0
            self.count += 1
            self.seen.logical_not_()
        out = self.lin(x)
        return out * math.nan if self.poison else out


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_stopped_or_skipped_step_puts_back_buffers_of_every_dtype_bit_for_bit(policy):
    model = Counting()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan=policy, capture=False):
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        before = {name: b.clone() for name, b in model.named_buffers()}
        model.poison = True
        with contextlib.suppress(nanguard.NonFiniteError):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
    for name, value in model.named_buffers():
        assert value.dtype == before[name].dtype, name
        assert torch.equal(value.view(-1).view(torch.uint8) if value.is_floating_point() else value,
                           before[name].view(-1).view(torch.uint8) if value.is_floating_point()
                           else before[name]), name


class WithLoss(nn.Module):
    """Computes its own loss, as a transformers model given labels does, and returns a mapping."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, labels):
        logits = self.lin(x)
        keep = labels != -100
        loss = nn.functional.cross_entropy(logits[keep], labels[keep])  # every label -100: NaN
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("checked", [False, True])
def test_a_loss_the_model_returns_is_named_by_its_field(checked, guard_mode):
    model = WithLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        out = model(torch.randn(5, 4), labels=torch.full((5,), -100))
        if checked:
            guard.check(out["loss"])
        out["loss"].backward()  # (a mean over no label: its gradients are finite, zero)
        if checked:  # a loss given to check stops the step
            with pytest.raises(nanguard.NonFiniteError) as info:
                optimizer.step()
            event = info.value.event
        elif guard_mode == "sentinel":  # unchecked, it reaches nothing the update depends on: not looked at
            optimizer.step()
            assert guard.step == 1 and guard.events == []
            return
        else:  # the full mode's probe saw it: a warning event
            optimizer.step()
            (event,) = guard.events
            assert guard.step == 1 and "reached none of what the update depends on" in event.message
    assert event.output_field == "loss" and event.shape == () and "the value is nan" in str(event)
    if checked:
        assert event.kind == "loss" and event.layer == "loss" and "the model computed it" in event.message
        # checking the loss loses nothing the probes knew: the model, and where in it the value was born
        assert str(event).startswith("non-finite loss ('loss' in the output of the model (WithLoss)) at step 0")
        assert "born in this module" in event.message or "forward code" in event.message, event.message
    else:
        assert event.kind == "forward" and str(event).startswith("non-finite 'loss' in the output of the model")


def test_a_resumed_run_goes_on_counting_where_it_left_off(monkeypatch, tmp_path):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, spike_warmup_steps=2) as guard:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
        saved = guard.state_dict()
    assert saved["step"] == 3 and saved["grad_norm_level"] > 0
    with nanguard.init(nn.Linear(4, 2)) as other, pytest.raises(nanguard.ConfigError, match="step=-1 must be"):
        other.load_state_dict({**saved, "step": -1})
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    model2 = nn.Linear(4, 2)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    with nanguard.init(model2, optimizer2) as guard:
        guard.load_state_dict(saved)
        assert guard.step == 3 and guard.state_dict() == saved
        with torch.no_grad():
            model2.weight[0, 0] = math.nan
        with pytest.raises(nanguard.NonFiniteError) as info:
            model2(torch.randn(2, 4)).pow(2).sum().backward()  # (the NaN weight reaches the gradients)
            optimizer2.step()
    assert info.value.event.step == 3 and info.value.incident.endswith("job-restart2-step3")


def test_a_storm_of_the_same_report_logs_once_a_minute(caplog):
    import logging

    model = bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.no_grad():
        model[0].bias.fill_(math.nan)
    with caplog.at_level(logging.ERROR, logger="nanguard"), nanguard.init(model, optimizer, on_nan="warn") as guard:
        for _ in range(6):
            model(torch.randn(4, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert len(guard.events) == 6 and guard.step == 6  # every step is still an event
    reports = [r for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(reports) == 1 and "continuing (on_nan=warn)" in reports[0].getMessage()


# ---------------------------------------------------------------- values passed on
# A value made in forward code and handed on by a module that passes values as they come (an
# Identity, a dropout of p=0 that returns its input, an activation, in place or not) is checked
# where it is passed on, and blamed on the code before: never on the next module, as "inputs
# were finite" (found on timm's DeiT, EfficientNet and transformers' ViT).

class Offset(nn.Module):
    """A learned offset added in its own forward code (a ViT's position embedding), then handed
    to ``passing`` before a LayerNorm."""

    def __init__(self, passing: nn.Module):
        super().__init__()
        self.proj, self.pos = nn.Linear(8, 8), nn.Parameter(torch.zeros(8))
        self.drop, self.norm, self.head = passing, nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.norm(self.drop(self.proj(x) + self.pos)))


@pytest.mark.parametrize("passing", [nn.Identity(), nn.Dropout(0.0), nn.ReLU(), nn.ReLU(inplace=True)],
                         ids=["identity", "dropout-p0", "relu", "relu-inplace"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_value_made_in_forward_code_and_passed_on_is_blamed_on_that_code(passing, bad):
    torch.manual_seed(0)
    model = Offset(passing)
    event = _stop_at_step_2(model, lambda: model.pos.fill_(bad))
    assert "forward code of the root module, whose parameter(s) pos are non-finite" in event.message
    if math.isnan(bad):  # passed on as it came: reported where it was first seen
        assert (event.layer, event.input_nonfinite) == ("drop", True), event.message
    else:  # infinities the LayerNorm made NaN of, as it would of a mask's: where the NaN was made
        assert (event.layer, event.input_nonfinite) == ("norm", True), event.message
        assert "held infinities but no NaN" in event.message and "made here" in event.message


class MaskPassedOn(nn.Module):
    """An additive -inf mask handed through a dropout of p=0 (and returned, with the output, to
    the caller as a decoder layer returns its cache): evidence, never a stop by itself."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.q, self.drop, self.softmax = nn.Linear(width, width), nn.Dropout(0.0), nn.Softmax(-1)

    def forward(self, x, mask):
        scores = self.q(x) @ x.transpose(-1, -2)
        return self.softmax(self.drop(scores + mask)) @ x, mask


class Returning(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.head = MaskPassedOn(), nn.Linear(8, 2)

    def forward(self, x):
        y, mask = self.attn(x, torch.full((x.shape[-2],) * 2, -math.inf).triu(1))
        y, _ = self.attn(y, mask)
        return self.head(y)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_minus_inf_mask_passed_on_by_a_module_never_stops_a_step(mode):
    torch.manual_seed(0)
    model = Returning()
    getattr(model, mode)()
    assert_trains_clean(model)


class NormAct(nn.BatchNorm1d):
    """timm's BatchNormAct2d in one dimension: the norm in its own code, then a child Identity
    and an in-place activation, whose output it returns."""

    def __init__(self, width: int):
        super().__init__(width)
        self.drop, self.act = nn.Identity(), nn.ReLU(inplace=True)

    def forward(self, x):
        x = nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                     self.training, self.momentum, self.eps)
        return self.act(self.drop(x))


def test_a_norm_that_calls_its_function_in_its_own_code_is_named_with_its_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), NormAct(16), nn.Linear(16, 4))
    event = _stop_at_step_2(model, lambda: model[1].weight.fill_(math.inf))
    assert (event.layer, event.input_nonfinite) == ("1.drop", True), event.message
    assert "forward code of 1, whose parameter(s) weight are non-finite" in event.message
    assert "changed in place after it was checked" in event.message  # the ReLU wrote into it since


class ScaleInPlace(nn.Module):
    """timm's LayerScale with inplace=True: returns its input tensor, multiplied in place."""

    def __init__(self, width: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x.mul_(self.gamma)


def test_a_module_that_returns_its_input_changed_in_place_is_not_cleared_nor_skipped():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), ScaleInPlace(16), nn.Linear(16, 4))
    event = _stop_at_step_2(model, lambda: model[2].gamma.fill_(math.nan))
    # born in it or before it: from its output alone nothing tells which, and the report says so
    assert (event.layer, event.input_nonfinite) == ("2", None), event.message
    assert "returned its input tensor itself" in event.message and "gamma" in event.message


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.act = nn.Parameter(torch.randn(16, 8) * 0.1), nn.SiLU()

    def forward(self, x):
        return self.act(nn.functional.linear(x, self.w))  # its own weight, in its own code


class Routed(nn.Module):
    """Mixtral's sparse MLP in small: a router, then experts that apply their own weights."""

    def __init__(self):
        super().__init__()
        self.gate, self.experts = nn.Linear(8, 2), Experts()

    def forward(self, x):
        weights = self.gate(x).softmax(-1)
        return self.experts(x) * weights[:, :1]


def test_the_code_that_made_a_value_is_the_innermost_that_ran_not_the_common_parent():
    # the last module output checked before the bad value is the router's, a sibling of the
    # experts: their common parent did not make it, the experts' own forward code did
    torch.manual_seed(0)
    model = nn.Sequential(Routed(), nn.Linear(16, 4))
    event = _stop_at_step_2(model, lambda: model[0].experts.w[0, 0].fill_(math.nan))
    assert (event.layer, event.input_nonfinite) == ("0.experts.act", True), event.message
    assert "forward code of 0.experts, whose parameter(s) w are non-finite" in event.message


class Looped(nn.Module):
    """A learned scale of the root applied between the items of an nn.ModuleList (which runs no
    code): the root's code made the value, whose parameter is named."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.scales = nn.Parameter(torch.ones(3, 16))

    def forward(self, x):
        x = self.emb(x)
        for i, block in enumerate(self.blocks):
            x = block(x) * self.scales[i]
        return self.head(x)


class Carried(nn.Module):
    """A value made in the root's code, handed to a container that returns it as it came."""

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(16, 16)

        def forward(self, x, aux):
            return self.inner(x), aux

    def __init__(self):
        super().__init__()
        self.emb, self.stage, self.head = nn.Linear(8, 16), self.Stage(), nn.Linear(16, 4)
        self.aux_scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        h = self.emb(x)
        h, aux = self.stage(h, h * self.aux_scale)
        return self.head(h + aux)


def test_the_code_named_is_the_code_that_ran_not_a_module_list_nor_a_container_that_returned_it():
    torch.manual_seed(0)
    model = Looped()
    event = _stop_at_step_2(model, lambda: model.scales[1].fill_(math.nan))  # taken by blocks.2
    assert (event.layer, event.input_nonfinite) == ("blocks.2.0", True), event.message
    assert "forward code of the root module, whose parameter(s) scales are non-finite" in event.message
    model = Carried()
    event = _stop_at_step_2(model, lambda: model.aux_scale.fill_(math.nan))
    assert (event.layer, event.input_nonfinite) == ("stage", None), event.message
    assert "forward code of the root module, whose parameter(s) aux_scale are non-finite" in event.message


def test_an_inference_tensor_is_not_said_to_have_changed_in_place():
    torch.manual_seed(0)
    model = Offset(nn.Dropout(0.0))
    with nanguard.init(model, on_nan="warn") as guard:
        with torch.inference_mode():
            model(torch.randn(4, 8))
            model.pos.fill_(math.nan)
            model(torch.randn(4, 8))
        (event,) = guard.events
    assert event.layer == "drop" and "pos" in event.message
    assert "changed in place" not in event.message and "keeps no version" in event.message


class Scaled(nn.Module):
    """A block that takes the causal -inf mask (handed on by a dropout of p=0) and scales its
    output by a parameter of its own."""

    def __init__(self):
        super().__init__()
        self.attn, self.gamma = MaskPassedOn(), nn.Parameter(torch.ones(8))

    def forward(self, x, mask):
        return self.attn(x, mask)[0] * self.gamma


class MaskedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop, self.blocks, self.head = nn.Dropout(0.0), nn.ModuleList(Scaled() for _ in range(2)), nn.Linear(8, 2)

    def forward(self, x):
        mask = self.drop(torch.full((x.shape[-2],) * 2, -math.inf).triu(1))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def test_a_block_that_makes_its_own_inf_is_not_blamed_on_the_mask_it_took():
    torch.manual_seed(0)
    model = MaskedStack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.init(model, optimizer, on_nan="warn") as guard:
        model(torch.randn(4, 5, 8)).sum().backward()
        optimizer.step()
        with torch.no_grad():
            model.blocks[1].gamma[3] = math.inf
        model(torch.randn(4, 5, 8)).sum().backward()
        optimizer.step()
        (event,) = guard.events
    assert event.layer == "blocks.1" and event.input_nonfinite is True, event.message
    assert "its parameter(s) gamma are non-finite" in event.message and "held infinities" in event.message


def event_of_an_armed_step(model: nn.Module, armed: int):
    """The first event of one step (on_nan=warn) of ``model`` with its module ``armed`` armed."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="warn") as guard:
        model[armed].armed = True
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    return guard.events[0]


class LastLayerFault(nn.Linear):
    """The model's last layer, whose own backward makes NaN (a custom Function inside it)."""

    armed = False

    def forward(self, x):
        y = super().forward(x)
        return NanBackward.apply(y) if self.armed else y


def test_a_nan_born_in_the_last_modules_own_backward_is_not_asserted_to_come_from_the_loss():
    # the gradient entering the model's backward is finite; the first bad gradients are the last
    # layer's own: the loss is the likelier source, not a fact, and the layer's backward is named
    torch.manual_seed(0)
    event = event_of_an_armed_step(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), LastLayerFault(8, 2)), 2)
    assert event.kind == "loss" and "or the backward of 2 itself made it" in event.message, event.message
    assert "was already non-finite, so most likely" not in event.message


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2's tying; ``tied=False``: not),
    and when ``fault`` is set a NaN born in the backward pass between the head and the norm."""

    def __init__(self, tied: bool = True):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.fault = False

    def forward(self, ids):
        h = self.ln(torch.relu(self.body(self.emb(ids))))
        self.h = NanBackward.apply(h) if self.fault else h
        if self.h.requires_grad:
            self.h.retain_grad()  # (an oracle: the gradient the head's own backward sends on)
        return self.head(self.h)


def test_a_tied_output_layer_is_not_said_to_have_no_gradient_and_the_loss_stays_possible():
    # the shared weight is the head's too, and its gradient sums both uses: a NaN the loss made is
    # not "born in the backward pass" after "a head without trainable parameters"
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="warn") as guard:
        logits = model(torch.randint(0, 50, (4, 6)))
        (logits.mean() + torch.sqrt(((logits - logits.detach()) ** 2).sum())).backward()
        optimizer.step()
    event = guard.events[0]
    assert event.kind == "grad" and event.layer == "ln.weight", event
    assert "the gradient of head is non-finite too, but through a weight it shares" in event.message, event.message
    assert "or in head's own backward, or came in with the loss's gradient" in event.message
    assert "no trainable parameters" not in event.message and "so it was born in" not in event.message


class Residual(nn.Module):
    """x + relu(fc(x)), its ReLU off everywhere (bias -100): a gradient goes around fc."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            self.fc.bias.fill_(-100.0)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


def test_a_finite_gradient_before_a_residual_block_is_not_proof_the_nan_was_born_after_it():
    # the NaN is born in the backward above the residual block: it reaches the first layer through
    # the skip path, while the block's fc (its ReLU off) gets a finite gradient
    torch.manual_seed(0)
    event = event_of_an_armed_step(nn.Sequential(nn.Linear(8, 8), Residual(), GradFault(), nn.Linear(8, 2)), 2)
    assert event.layer == "0.weight" and "between the gradients of 1.fc (finite) and this one" in event.message
    assert "or before those on a path that went around its parameters (a residual connection" in event.message


def test_a_module_the_script_calls_after_the_models_forward_is_the_scripts_code(guard_mode):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.encoder(x))

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="warn") as guard:
        anchor = torch.randn(4, 8)
        anchor[0, 0] = math.nan  # the script's own input to the encoder, called alone
        (model(torch.randn(4, 8)).sum() + model.encoder(anchor).sum()).backward()
        optimizer.step()
    event = guard.events[0]
    if guard_mode == "sentinel":
        # no hook sees that call (a clean step runs none); the re-run of the model's forward and backward
        # is clean, which is no proof of a transient: never blamed on the hardware
        assert (event.kind, event.layer, event.reproduced, event.verdict) == ("grad", "encoder.0.weight", None, None)
        assert "or from the script's own use of the model's parts or parameters outside its forward" in event.message
        assert "transient fault of the hardware" not in event.message
        return
    assert (event.layer, event.micro_batch) == ("encoder.0", None), event
    assert "the training script, outside the model (called outside the root module's forward" in event.message
    assert "forward code of the root module" not in event.message


class Mixer(nn.Module):
    """Mamba's mixer: its own code hands its conv1d's weight to a convolution function and never
    calls conv1d (the CUDA kernels' path does the same)."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(8, 8)
        self.conv1d = nn.Conv1d(8, 8, 3, groups=8, padding=2)
        self.x_proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.in_proj(x).transpose(1, 2)
        h = nn.functional.conv1d(h, self.conv1d.weight, self.conv1d.bias, padding=2, groups=8)[..., :x.shape[1]]
        return self.x_proj(nn.functional.silu(h).transpose(1, 2))


def test_a_bad_weight_of_a_child_its_parent_uses_without_calling_it_is_named():
    torch.manual_seed(0)
    model = nn.Sequential(Mixer(), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.init(model, optimizer):
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(3):
                if step == 2:
                    with torch.no_grad():
                        model[0].conv1d.weight[0, 0, 0] = math.nan
                model(torch.randn(2, 5, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    event = info.value.event
    assert (event.step, event.layer, event.input_nonfinite) == (2, "0.x_proj", True), event
    assert "in the forward code of 0, whose parameter(s) conv1d.weight, of modules it did not call" in event.message


class OnlyWhenRecomputed(nn.Module):
    """Makes NaN only when a backward pass runs its forward again (the same operations either way,
    as activation checkpointing requires), and only of a batch so large that its input passes 1000."""

    def forward(self, x):
        large = bool(x.detach().abs().max() > 1e3)
        return x * (math.nan if large and torch._C._current_graph_task_id() != -1 else 1.0)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.fc1, self.fault, self.fc2, self.reentrant = nn.Linear(8, 8), OnlyWhenRecomputed(), nn.Linear(8, 8), reentrant

    def inner(self, x):
        return self.fc2(torch.tanh(self.fault(self.fc1(x))))

    def forward(self, x):
        return x + torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_value_made_only_when_checkpointing_runs_a_forward_again_says_so(reentrant):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Checkpointed(reentrant), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.init(model, optimizer):
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(4):
                for micro in range(2):
                    scale = 1e5 if (step, micro) == (2, 1) else 1.0
                    model((torch.randn(4, 8) * scale).requires_grad_()).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    event = info.value.event
    # the micro-batch whose backward ran it again; not "outside the model", nor a forward that was finite
    assert (event.kind, event.layer, event.step, event.micro_batch) == ("forward", "1.fault", 2, 1), event
    assert event.message.startswith("made in the backward pass, where activation checkpointing ran this forward again")
    assert "born in this module" in event.message


@pytest.mark.parametrize("forward_first", [True, False])
def test_a_checked_loss_that_is_the_first_bad_value_says_where_it_can_come_from(forward_first):
    # NaN targets are the common cause of a NaN loss with a finite model: the report must not be silent
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        targets = torch.randn(8, 1)
        targets[2] = math.nan
        if not forward_first:
            guard.check((targets ** 2).mean(), "loss")  # checked before any forward of the step
        loss = ((model(torch.randn(8, 4)) - targets) ** 2).mean()
        if forward_first:
            guard.check(loss)
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError) as info:
            optimizer.step()
    event = info.value.event
    assert (event.kind, event.layer) == ("loss", "loss"), event
    if forward_first:
        assert event.message.startswith("every module output checked before it was finite")
        assert "the batch's targets" in event.message
    else:
        assert event.message.startswith("no module output was checked before it in this step")


@pytest.mark.parametrize("loop", ["plain", "clip", "scaler"])
def test_a_gradient_the_script_makes_non_finite_after_backward_is_never_applied(loop):
    # a per-batch normalisation by a token count that was 0: the backward pass left finite
    # gradients, the optimizer would apply an infinite one ("scaler": after unscale_, under a
    # GradScaler given to init, which found nothing to skip)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=loop == "scaler")
    with nanguard.init(model, optimizer, scaler=scaler) as guard:
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(4):
                scaler.scale(model(torch.randn(4, 8)).sum()).backward()
                scaler.unscale_(optimizer)
                if loop == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # every step: finite stays finite
                if step == 2:
                    model[0].weight.grad.div_(0.0)
                before = [p.detach().clone() for p in model.parameters()]
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        assert guard.step == 3
    event = info.value.event
    assert (event.kind, event.layer, event.step) == ("grad", "0.weight", 2), event
    assert event.extra["after_backward"] is True and "finite as the backward pass left it" in event.message
    assert "sum across ranks" not in event.message  # one process: nothing summed it
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.modes("sentinel", "full")
@pytest.mark.parametrize("inference", [False, True])
def test_an_evaluation_between_optimizer_steps_is_neither_a_micro_batch_nor_a_training_stop(inference, guard_mode):
    # a validation forward (autograd off) at each iteration's start: a training NaN keeps its
    # micro-batch number, and a NaN in the validation batch alone is reported but stops nothing
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    off = torch.inference_mode if inference else torch.no_grad

    def evaluate(bad: bool):
        model.eval()
        with off():
            x = torch.randn(8, 16)
            if bad:
                x[0, 3] = math.nan
            model(x)
        model.train()

    from nanguard.rank.reporter import Reporter

    class Sent(Reporter):  # what would go to a coordinator, whose policy stops a job on any event it acted on
        def __init__(self):
            self.notes = []

        def note(self, event, action):
            self.notes.append((event, action))

    with nanguard.init(model, optimizer, max_pending=6) as guard:
        guard._respond.reporter = sent = Sent()
        for step in range(3):
            evaluate(bad=step == 1)
            for _ in range(3):  # a long validation: past max_pending, settled early, as an evaluation
                evaluate(bad=False)
            for micro in range(2):
                nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert guard.step == 3 and guard.incident is None
        (event,) = guard.events
        # (the sentinel probes an evaluation's output alone, and holds no evaluation batch to re-run)
        layer = "0" if guard_mode == "full" else ""
        assert (event.kind, event.layer, event.step, event.micro_batch) == ("forward", layer, 1, None), event
        assert "in a forward with autograd off after optimizer step 0 (an evaluation" in event.message
        assert sent.notes == [(event, "observe")]  # sent as an evaluation's: the coordinator stops no job for it
        with pytest.raises(nanguard.NonFiniteError) as info:
            evaluate(bad=False)
            for micro in range(2):
                x = torch.randn(8, 16)
                if micro == 1:
                    x[2, 2] = math.nan
                nn.functional.cross_entropy(model(x), torch.randint(0, 4, (8,))).backward()
            optimizer.step()
        optimizer.zero_grad()
        evaluate(bad=True)  # a last evaluation, after the last step: checked when the guard closes
    assert (info.value.event.step, info.value.event.micro_batch) == (3, 1), info.value.event
    assert [e.step for e in guard.events][-1] == 4 and "(an evaluation" in guard.events[-1].message


class InplaceScale(nn.Module):
    """timm's LayerScale(inplace=True): scales its input in place and returns it."""

    def __init__(self, width: int):
        super().__init__()
        self.gamma = nn.Parameter(0.1 * torch.ones(width))

    def forward(self, x):
        return x.mul_(self.gamma)


class ScaledInPlace(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.fc1, self.ls1, self.fc2 = nn.Linear(width, width), InplaceScale(width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(self.ls1(self.fc1(x)))


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_bad_parameter_of_a_module_that_scales_its_input_in_place_is_named(value):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ScaledInPlace(), nn.Linear(8, 2))
    event = _stop_at_step_2(model, lambda: model[1].ls1.gamma[3].fill_(value))
    assert "1.ls1" in f"{event.layer} {event.message}" and "gamma" in event.message, (event.layer, event.message)


@pytest.mark.parametrize("through", ["the model", "a part of it"])
def test_an_evaluation_amid_micro_batches_or_of_a_models_part_is_left_unchecked(through):
    # between micro-batches 0 and 1, or through a part of the model (DDP's inner module, a
    # validation step calling submodules), a forward with autograd off would join the training
    # step's probes: counted as a micro-batch, its NaN a stop of every rank. It is not checked.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.init(model, optimizer) as guard:
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(4):
                for micro in range(3):
                    x = torch.randn(8, 16)
                    if (step, micro) == (3, 2):
                        x[2, 2] = math.nan
                    nn.functional.cross_entropy(model(x), torch.randint(0, 4, (8,))).backward()
                    if micro == 0:
                        with torch.no_grad():
                            bad = torch.full((8, 16), math.nan if step == 1 else 0.0)
                            model(bad) if through == "the model" else model[0](bad)
                optimizer.step()
                optimizer.zero_grad()
        assert guard.step == 4 and [e.step for e in guard.events] == [3]
    assert (info.value.event.step, info.value.event.micro_batch) == (3, 2), info.value.event


@pytest.mark.modes("sentinel", "full")
@pytest.mark.parametrize("off", [torch.no_grad, torch.inference_mode])
def test_an_encoder_evaluated_on_its_nested_tensor_fast_path_is_checked(off, guard_mode):
    # nn.TransformerEncoder with a padding mask and autograd off hands nested tensors to its layers
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.01)
    x = torch.randn(4, 10, 16)
    padding = torch.zeros(4, 10, dtype=torch.bool)
    padding[0, 7:] = True
    nested = []
    encoder.layers[1].register_forward_pre_hook(
        lambda module, args: nested.append(args[0].is_nested) if not torch.is_grad_enabled() else None)

    def evaluate(bad: bool):
        encoder.eval()
        with off():
            given = x.clone()
            if bad:
                given[1, 2, 3] = math.nan  # a token that is not padding
            out = encoder(given, src_key_padding_mask=padding)
        encoder.train()
        return out

    with nanguard.init(encoder, optimizer) as guard:
        for step in range(3):
            encoder(x, src_key_padding_mask=padding).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            evaluate(bad=step == 1)
        assert nested == [True] * 3  # the fast path ran, nested tensors and all
        assert guard.step == 3 and guard.incident is None
        (event,) = guard.events
    assert (event.kind, event.step) == ("forward", 2), event
    assert "(an evaluation" in event.message, event
    # (the sentinel names the evaluation's output: it holds no evaluation batch to re-run)
    assert event.layer.startswith("layers.0") if guard_mode == "full" else event.layer == "", event


@pytest.mark.parametrize("weight, mask", [
    ("out_proj.weight", "padding"), ("in_proj_weight", "padding"), ("out_proj.weight", "causal"),
    # (in_proj_weight under a causal mask: torch's CPU attention kernel gives a finite output, and the
    # gradient report names the weight)
])
def test_an_attention_whose_own_weight_is_bad_under_an_infinite_mask_is_named_as_the_maker(weight, mask):
    # nn.MultiheadAttention uses both weights in its own code; the mask holds -inf on purpose
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
    masks = {"src_key_padding_mask": torch.zeros(4, 10, dtype=torch.bool)} if mask == "padding" else {
        "mask": nn.Transformer.generate_square_subsequent_mask(10), "is_causal": True}
    if mask == "padding":
        masks["src_key_padding_mask"][0, 7:] = True

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def forward(self, x):
            return self.encoder(x, **masks)

    weights = dict(encoder.layers[0].self_attn.named_parameters())
    event = _stop_at_step_2(Masked(), lambda: weights[weight][0].fill_(math.nan), width=16, tokens=10)
    assert (event.kind, event.layer, event.step, event.input_nonfinite) == (
        "forward", "encoder.layers.0.self_attn", 2, False), event
    assert str(event).startswith("non-finite output in encoder.layers.0.self_attn"), str(event)
    assert f"{weight} are non-finite" in event.message and "born outside any module" not in event.message, event.message


def test_a_copy_made_after_init_is_not_taken_for_the_guarded_model(caplog):
    # copy.deepcopy copies the hooks too: an EMA model and a frozen teacher, copied after init
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with caplog.at_level(logging.WARNING, logger="nanguard"), nanguard.init(model, optimizer) as guard:
        ema, teacher = AveragedModel(model), copy.deepcopy(model).requires_grad_(False)
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(4):
                for micro in range(2):  # the teacher runs with autograd on beside every micro-batch
                    target = teacher(x).softmax(-1)
                    out = model(x if (step, micro) != (2, 1) else x.log())  # (a NaN made in the script)
                    (nn.functional.cross_entropy(out, y) + (out.softmax(-1) - target).pow(2).mean()).backward()
                optimizer.step()
                optimizer.zero_grad()
                ema.update_parameters(model)
                with torch.no_grad():
                    ema.module[0].weight[0, 0] = math.nan  # the copy's weight only
                    ema(x)
    event = info.value.event
    assert (event.kind, event.layer, event.step, event.micro_batch) == ("forward", "0", 2, 1), event
    assert event.input_nonfinite is True and guard.events == [event]  # the EMA's NaN is in no event
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum("a copy of a guarded" in r.getMessage() for r in caplog.records) == 1


def test_a_layer_unfrozen_during_training_has_its_gradients_checked():
    # gradual unfreezing: the first layer, frozen when init ran, trains from step 2; a NaN born in
    # the backward reaches only its gradients at step 3, and must not be applied
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), GradFault(), nn.ReLU(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer):
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(6):
                if step == 2:
                    model[0].requires_grad_(True)
                model[1].armed = step == 3
                model(torch.randn(5, 4)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert (info.value.event.kind, info.value.event.layer, info.value.event.step) == ("grad", "0.weight", 3)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_optimizer_re_created_after_init_is_decided_at(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), GradFault(), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="nanguard"), nanguard.init(model, optimizer):
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(8):
                if step == 3:  # a second phase of training, or a checkpoint loaded: a new optimizer
                    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
                model[1].armed = step == 5
                model(torch.randn(5, 4)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert (info.value.event.kind, info.value.event.step) == ("grad", 5), info.value.event
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum("an optimizer not given to nanguard.init (Adam)" in r.getMessage() for r in caplog.records) == 1


def test_a_second_guard_without_an_optimizer_leaves_the_first_ones_optimizer_alone():
    # a teacher guarded apart, with no optimizer: the student's optimizer steps nothing of it
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(4, 8), GradFault(), nn.ReLU(), nn.Linear(8, 2))
    teacher = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).requires_grad_(False)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    with nanguard.init(student, optimizer) as guard, nanguard.init(teacher) as other:
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(4):
                student[1].armed = step == 2
                x = torch.randn(5, 4)
                (student(x) - teacher(x)).pow(2).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    event = info.value.event
    assert (event.kind, event.layer, event.step) == ("grad", "0.weight", 2), event
    assert guard.events == [event] and not other.events


def test_a_guard_without_an_optimizer_counts_the_steps_and_micro_batches_of_the_training_model():
    # a teacher's NaN is met in its own forward, before the student's update: it is reported at
    # the training step and micro-batch it happened in, not at step 0 of a guard that never steps
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    teacher = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).requires_grad_(False)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    with nanguard.init(student, optimizer), nanguard.init(teacher) as other:
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(6):
                for micro in range(3):
                    if (step, micro) == (4, 2):
                        with torch.no_grad():
                            teacher[2].weight[0, 0] = float("nan")
                    x = torch.randn(5, 4)
                    (student(x) - teacher(x)).pow(2).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    event = info.value.event
    assert (event.layer, event.step, event.micro_batch) == ("2", 4, 2), event
    assert other.step == 4 and all(torch.isfinite(p).all() for p in student.parameters())


def test_a_guard_without_an_optimizer_beside_a_gan_dates_the_generators_half_to_its_step():
    # a critic's step, then the generator's, with a forward between them: a teacher's NaN in the
    # generator's half of step 3 is at step 3, as the GAN's own guard counts it
    torch.manual_seed(0)
    generator, critic = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 1))
    teacher = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).requires_grad_(False)
    opt_g, opt_d = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (generator, critic))
    models = nn.ModuleDict({"generator": generator, "critic": critic})
    with nanguard.init(models, [opt_d, opt_g]), nanguard.init(teacher):
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(6):
                critic(generator(torch.randn(5, 4)).detach()).mean().backward()
                opt_d.step()
                opt_d.zero_grad()
                if step == 3:
                    with torch.no_grad():
                        teacher[2].weight[0, 0] = math.nan
                fake = generator(torch.randn(5, 4))
                (critic(fake).mean() + (fake - teacher(fake)).pow(2).mean()).backward()
                opt_g.step()
                opt_g.zero_grad()
                opt_d.zero_grad()
    assert (info.value.event.layer, info.value.event.step) == ("2", 3), info.value.event


class LoRA(nn.Module):
    """A frozen base Linear and a trainable low-rank update, added to a model after init."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.B = nn.Parameter(torch.zeros(base.out_features, rank))
        self.fault = GradFault()

    def forward(self, x):
        return self.base(x) + self.fault(x @ self.A.t()) @ self.B.t()


def test_modules_and_parameters_added_after_init_are_checked_and_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model[4].parameters(), lr=0.1)
    events = []
    with nanguard.init(model, optimizer, on_nan="skip") as guard:
        for step in range(8):
            if step == 2:  # a LoRA adapter put in place of a layer, its parameters given to the optimizer
                model[2] = LoRA(model[2])
                optimizer.add_param_group({"params": [model[2].A, model[2].B]})
            if step == 4:  # a parameter replaced outright
                model[0].bias = nn.Parameter(torch.zeros(8))
                optimizer.add_param_group({"params": [model[0].bias]})
            if step >= 2:
                model[2].fault.armed = step == 3
            with torch.no_grad():
                if step == 5:
                    model[0].bias[1] = math.nan
            before = [p.detach().clone() for p in model.parameters()]
            model(torch.randn(5, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if guard.events[len(events):]:
                events += guard.events[len(events):]
                assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)  # the update was skipped
                           for a, b in zip(before, model.parameters()))
            if step == 5:
                with torch.no_grad():
                    model[0].bias[1] = 0.0
    assert [(e.kind, e.layer, e.step) for e in events] == [("grad", "2.A", 3), ("forward", "0", 5)], events
    assert "its parameter(s) bias are non-finite" in events[1].message


class Holder(nn.Module):
    """A wrapper that holds the model (PEFT's ``PeftModel`` holds it two levels down)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


@pytest.mark.parametrize("keep", [True, False], ids=["wrapper kept", "wrapper let go"])
def test_a_layer_moved_back_into_its_place_is_renamed_when_the_script_calls_the_inner_model(keep):
    # as PEFT's merge_and_unload(): the adapter's base layer is put back in its place, and the
    # script trains the model the wrapper held, called directly: the guarded root runs no forward.
    # Once the wrapper is let go (model = model.merge_and_unload()), the incident saves that model
    import gc

    from nanguard.incident import read_incident

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    inner[0] = LoRA(inner[0])
    wrapper = Holder(inner)
    optimizer = torch.optim.SGD([p for p in wrapper.parameters() if p.requires_grad], lr=0.1)
    with nanguard.init(wrapper, optimizer):
        wrapper(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        inner[0] = inner[0].base.requires_grad_(True)  # merged: the base layer is the layer again
        if not keep:
            del wrapper
            gc.collect()
        optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(1, 4):
                with torch.no_grad():
                    inner[0].weight[0, 0] = math.nan if step == 2 else inner[0].weight[0, 0]
                before = {name: value.clone() for name, value in inner.state_dict().items()}
                inner(torch.randn(5, 4)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    event = info.value.event
    assert (event.kind, event.layer, event.step) == ("forward", "model.0", 2), event
    assert "its parameter(s) weight are non-finite" in event.message
    saved = read_incident(info.value.incident).rank_state(0)["model"]
    expected = {f"model.{name}": value for name, value in before.items()} if keep else before
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k].nan_to_num(), v.nan_to_num()) for k, v in expected.items())


def test_a_step_the_script_drops_after_its_backward_pass_is_not_stopped_a_step_later(guard_mode):
    # the script's own check (clip_grad_norm_'s error_if_nonfinite) drops the step: the next one is clean
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dropped = []
    with nanguard.init(model, optimizer) as guard:
        for step in range(6):
            x = torch.randn(5, 4)
            if step == 3:
                x[0, 0] = math.nan
            model(x).sum().backward()
            try:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            except RuntimeError:
                optimizer.zero_grad()
                dropped.append(step)
                continue
            optimizer.step()
            optimizer.zero_grad()
        assert guard.step == 5 and guard.incident is None
        if guard_mode == "sentinel":  # its gradients were dropped before any optimizer step read them
            assert dropped == [3] and guard.events == []
            return
        (event,) = guard.events
    assert dropped == [3] and (event.kind, event.step, event.micro_batch) == ("forward", 3, None), event
    assert "in a step the script dropped after its backward pass" in event.message
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_layer_moved_into_a_wrapper_added_after_init_is_named_where_it_is_now():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer), pytest.raises(nanguard.NonFiniteError) as info:
        for step in range(4):
            if step == 1:  # a PEFT-style wrapper takes the layer's place, holding it as its base
                model[0] = LoRA(model[0])
                optimizer.add_param_group({"params": [model[0].A, model[0].B]})
            if step == 2:
                with torch.no_grad():
                    model[0].base.weight[0, 0] = math.nan
            model(torch.randn(5, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    event = info.value.event
    assert (event.kind, event.layer, event.step) == ("forward", "0.base", 2), event
    assert "its parameter(s) weight are non-finite" in event.message


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_batch_the_script_drops_before_its_backward_pass_stops_nothing(accumulate, guard_mode):
    # `if not torch.isfinite(loss): optimizer.zero_grad(); continue`: that forward makes no update
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), GradFault(), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard, pytest.raises(nanguard.NonFiniteError) as info:
        for step in range(8):
            for micro in range(accumulate):
                x = torch.randn(5, 4)
                if (step, micro) == (3, 0):
                    x[0, 0] = math.nan
                model[1].armed = (step, micro) == (6, accumulate - 1)  # a real fault later: stopped
                loss = model(x).pow(2).mean()
                if not torch.isfinite(loss):
                    optimizer.zero_grad()
                    continue
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if guard_mode == "sentinel":  # the dropped forward reached nothing the sentinel reads: not looked at
        (second,) = guard.events
    else:
        first, second = guard.events
        assert (first.kind, first.step, first.micro_batch) == ("forward", 3, None), first
        assert "never backpropagated before the optimizer step" in first.message
    assert info.value.event is second and (second.kind, second.step) == ("grad", 6), second
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("tied", [True, False])
def test_a_backward_nan_behind_a_tied_head_is_not_blamed_on_the_head_or_the_loss_alone(tied):
    torch.manual_seed(0)
    model = TiedLM(tied)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer):
        for step in range(4):
            x = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(step))
            model.fault = step == 2
            loss = nn.functional.cross_entropy(model(x).reshape(-1, 50), x.reshape(-1))
            loss.backward()
            if model.fault:  # the oracle: what the head's backward sent on was finite, the norm's gradient not
                assert torch.isfinite(loss) and torch.isfinite(model.h.grad).all()
                assert not torch.isfinite(model.ln.weight.grad).all()
                with pytest.raises(nanguard.NonFiniteError) as info:
                    optimizer.step()
                break
            optimizer.step()
            optimizer.zero_grad()
    event = info.value.event
    assert (event.kind, event.layer, event.step) == ("grad", "ln.weight", 2), event
    if tied:  # the head's gradient sums the embedding's use: it does not tell whether the head's backward was finite
        assert "born in the backward pass between the gradients of head and this one, or in head's own backward" \
               in event.message and "so it does not tell which" in event.message, event.message
    else:
        assert "born in the backward pass between the gradients of head (finite) and this one" in event.message


def functional_training(per_sample: bool, bad_step: int = 3):
    """Gradients the script computes itself and assigns to ``.grad``: ``torch.autograd.grad`` of
    the loss, with a NaN born in the backward pass (``NanBackward``) at ``bad_step``, or per-sample
    gradients (``vmap(grad(functional_call))``, averaged), with a NaN sample then. Returns the
    model, its weights before that step, the error and the parameters' names."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [name for name, _ in model.named_parameters()]

    def sample_loss(params, x, y):
        return nn.functional.mse_loss(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    with nanguard.init(model, optimizer):
        for step in range(6):
            x, y = torch.randn(8, 8), torch.randn(8, 4)
            before = copy.deepcopy(model.state_dict())
            if per_sample:
                if step == bad_step:
                    x[5, 0] = math.nan  # one sample's: every gradient averaged over the batch is NaN
                params = {n: p.detach() for n, p in model.named_parameters()}
                grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
                for name, param in model.named_parameters():
                    param.grad = grads[name].mean(0)
            else:
                out = model(x)
                loss = nn.functional.mse_loss(NanBackward.apply(out) if step == bad_step else out, y)
                for param, g in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()))):
                    param.grad = g
            try:
                optimizer.step()
            except nanguard.NonFiniteError as err:
                return model, before, err, names
            optimizer.zero_grad()
    return model, None, None, names


@pytest.mark.parametrize("per_sample", [False, True], ids=["autograd.grad", "vmap-per-sample"])
def test_gradients_the_script_assigns_itself_are_checked_before_the_update(per_sample):
    # torch.autograd.grad ends a backward pass that leaves no .grad: the gradients the optimizer
    # applies were never read, and the NaN update went through (no event at all with torch.func)
    model, before, err, names = functional_training(per_sample)
    # (a NaN entering the backward pass at the model's output is the loss's, as the design names it)
    assert err is not None and (err.event.kind, err.event.step) == ("grad" if per_sample else "loss", 3), err
    assert err.event.layer in (names if per_sample else ["loss"])
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert err.incident is not None  # (batches seen inside vmap are not kept: they do not outlive it)
    if per_sample:
        assert "a forward inside torch.func's vmap or grad is not" in err.event.message


def test_a_loss_event_carries_no_gradients_numbers():
    # the loss is named when even the last module's gradients are bad: the event's shape and
    # counts were the first bad gradient's (a scalar loss of shape (4, 16), "64 NaN of 64")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="warn") as guard:
        out = model(torch.randn(4, 8))
        NanBackward.apply(out).sum().backward()
        optimizer.step()
    (event,) = guard.events
    assert (event.kind, event.layer) == ("loss", "loss"), event
    assert (event.shape, event.numel, event.bad_count, event.first_index) == (None, None, None, None), event
    assert event.has_nan


class StandardisesInPlace(nn.Module):
    """Standardises its input in place, as some models do (``x.sub_(mean).div_(std)``): a constant
    channel makes 0/0, a NaN its own code makes in the batch's own tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        x.sub_(x.mean(0)).div_(x.std(0))
        return self.lin(x)


@pytest.mark.modes("sentinel", "full")
@pytest.mark.parametrize("bad_step", [0, 2])
def test_a_batch_the_forward_changes_in_place_is_not_blamed_on_the_data(bad_step, guard_mode):
    torch.manual_seed(0)
    model = StandardisesInPlace()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fed = []
    with nanguard.init(model, optimizer), pytest.raises(nanguard.NonFiniteError) as info:
        for step in range(4):
            x = torch.randn(8, 4)
            if step == bad_step:
                x[:, 1] = 3.0  # a constant channel: its standard deviation is 0
            fed.append(x.clone())
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    event = info.value.event
    assert torch.isfinite(fed[bad_step]).all() and event.step == bad_step  # (the oracle: the data was finite)
    assert "already with NaN" not in event.message and "input batch of the model was already" not in event.message
    if bad_step:  # the batch is held as copies once a step found it changed in place: judged as it was fed
        assert (event.kind, event.layer, event.input_nonfinite) == ("forward", "lin", True), event
        assert "in the forward code of the root module" in event.message
        assert event.reproduced is True  # (the sentinel's re-run, and the full mode's, fed the copies)
    elif guard_mode == "full":  # the batch's tensor itself was changed: not known as it was fed
        assert (event.kind, event.layer) == ("forward", "lin") and "whether it came with NaN is not known" in event.message
    else:  # nor can it be re-run
        assert (event.kind, event.reproduced) == ("grad", None) and "changed in place after its forward began" in event.message
