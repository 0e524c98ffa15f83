"""Gradient accumulation: a step of several backward passes has its gradients measured once, as the
last pass left them (the passes before it are summed into what that one leaves, and a non-finite
value stays non-finite under a sum), however many micro-batches a step has and whatever the loop
does to the gradients between its last pass and the optimizer step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanguard
from nanguard.rank import backward
from test_guard import GradFault

pytestmark = pytest.mark.modes("sentinel", "full")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), GradFault(), nn.Linear(8, 2))


def _micro_batches(model: nn.Module, count: int, bad: int | None = None) -> None:
    for micro in range(count):
        model[1].armed = micro == bad
        (model(torch.randn(4, 8)).square().mean() / count).backward()
    model[1].armed = False


def _total_norm(model: nn.Module) -> float:
    # the oracle: every gradient as it is, summed in float64 by torch's own vector norm
    return float(torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in model.parameters()])))


def test_only_the_last_backward_pass_of_a_step_is_measured(monkeypatch):
    calls = []
    fused = backward.foreach_norm
    monkeypatch.setattr(backward, "foreach_norm", lambda grads: calls.append(len(grads)) or fused(grads))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step, norms = [], []
    with nanguard.init(model, optimizer) as guard:
        for micro_batches in (4, 4, 4, 2, 2, 3):
            before = len(calls)
            _micro_batches(model, micro_batches)
            expected = _total_norm(model)
            optimizer.step()
            optimizer.zero_grad()
            per_step.append(len(calls) - before)
            norms.append((guard.last_grad_norm, expected))
    # the first step measures every pass (nothing to go by yet); a step with fewer micro-batches than the
    # one before has its last pass measured at the decision; one with more measures its passes from the
    # count the step before had on
    assert per_step == [4, 1, 1, 1, 1, 2], per_step
    assert all(math.isclose(got, want, rel_tol=1e-5) for got, want in norms), norms


def _stopped_at_step_2(counts: tuple[int, int, int], bad: int, clip: bool = False):
    """Three steps of ``counts`` micro-batches, the last with a NaN born in micro-batch ``bad``'s backward
    pass (clipped before each optimizer step where ``clip``): the event that stops it, and whether the
    weights are still those from before it."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer):
        for step, count in enumerate(counts):
            _micro_batches(model, count, bad=bad if step == 2 else None)
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step == 2:
                break
            optimizer.step()
            optimizer.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(nanguard.NonFiniteError) as info:
            optimizer.step()
    return info.value.event, all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_nan_born_in_an_early_micro_batchs_backward_stops_its_step():
    event, untouched = _stopped_at_step_2((4, 4, 4), bad=1)  # (pass 2 of 4: not measured when it ends)
    assert (event.step, event.kind, event.layer) == (2, "grad", "0.weight"), event
    assert untouched


@pytest.mark.parametrize("clip", [False, True])
def test_a_step_with_fewer_micro_batches_than_the_one_before_is_still_stopped(clip):
    # its last pass is taken for one of several (the steps before had 4): measured at the decision, as it
    # left the gradients, where they are so still; else (clipping rewrote them in place, spreading the NaN
    # over every gradient) the report says where they were made non-finite is not known, and blames none
    event, untouched = _stopped_at_step_2((4, 4, 2), bad=1, clip=clip)
    assert (event.step, event.kind) == (2, "grad"), event
    if clip:
        assert event.layer == "unknown" and "is not known" in event.message, event
    else:
        assert event.layer == "0.weight", event
    assert untouched
