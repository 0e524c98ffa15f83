"""Scripts that train several models with several optimizers (a GAN, a student and its EMA
teacher): the step clock, the blame of a gradient whose module ran in an earlier step, and what
an incident holds of each model."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

import nanguard
from test_guard import GradFault


def gan(seed: int = 0) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    critic = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return (generator, critic, torch.optim.Adam(generator.parameters(), 1e-3),
            torch.optim.Adam(critic.parameters(), 1e-3))


def gan_iteration(generator, critic, opt_g, opt_d, *, loss_fault=False, freeze=True, weight_fault=False):
    """One iteration as GAN scripts write it: the critic's step on real and generated samples,
    then the generator's, through the critic (frozen for it, or not), with a forward in between."""
    real, noise = torch.randn(16, 8), torch.randn(16, 8)
    fake = generator(noise)
    d_loss = (nn.functional.softplus(-critic(real)).mean()
              + nn.functional.softplus(critic(fake.detach())).mean())
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    critic.requires_grad_(not freeze)
    if weight_fault:
        with torch.no_grad():
            critic[2].weight[0, 0] = math.nan
    score = critic(fake)
    g_loss = nn.functional.softplus(-score).mean()
    if loss_fault:
        # a finite value with an infinite gradient: the square root of a norm that is zero
        g_loss = g_loss + torch.sqrt((score - score.detach()).abs().sum())
    opt_g.zero_grad()
    g_loss.backward()
    try:
        opt_g.step()
    finally:
        critic.requires_grad_(True)


@pytest.mark.parametrize("scoped", [True, False])
def test_both_optimizers_of_an_iteration_count_as_one_step(scoped):
    generator, critic, opt_g, opt_d = gan()
    models = nn.ModuleDict({"G": generator, "D": critic})
    with nanguard.init(models, [opt_d, opt_g], on_nan="warn") if scoped else nanguard.init(on_nan="warn") as guard:
        seen = []
        for iteration in range(4):
            gan_iteration(generator, critic, opt_g, opt_d, weight_fault=iteration == 2)
            seen.append(guard.step)
            with torch.no_grad():
                critic[2].weight.nan_to_num_(0.0)
        # the critic's weight went bad between its own step and the generator's forward, in iteration 2
        assert seen == [1, 2, 3, 4]
        assert guard.events[0].step == 2, guard.events[0]
        assert guard.events[0].layer.endswith("2") and guard.events[0].kind == "forward", guard.events[0]


def test_an_optimizer_stepping_alone_takes_over_the_count():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    body, head = torch.optim.SGD(model[0].parameters(), 0.1), torch.optim.SGD(model[1].parameters(), 0.1)
    with nanguard.init(model, [body, head]) as guard:
        for phase, optimizers in ((0, (body, head)), (1, (head,))):
            for _ in range(3):
                model(torch.randn(4, 4)).sum().backward()
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
            # the body is frozen in the second phase: the head, stepping twice without the body
            # in between, counts the steps from its first step alone on
            assert guard.step == 3 * (phase + 1), phase


@pytest.mark.parametrize("scoped", [True, False])
@pytest.mark.parametrize("freeze", [True, False])
def test_a_loss_made_gradient_of_a_generator_is_not_blamed_on_its_backward(scoped, freeze):
    generator, critic, opt_g, opt_d = gan()
    models = nn.ModuleDict({"G": generator, "D": critic})
    with nanguard.init(models, [opt_d, opt_g], on_nan="warn") if scoped else nanguard.init(on_nan="warn") as guard:
        for iteration in range(3):
            gan_iteration(generator, critic, opt_g, opt_d, loss_fault=iteration == 2, freeze=freeze)
        events = guard.events
    assert events and events[0].step == 2, events
    event = events[0]
    assert "born in the backward pass" not in event.message, event.message
    if event.kind == "grad":
        # the generator ran in the critic's step: nothing says what its gradient went through
        assert "its output was made earlier and used again" in event.message, event.message
    else:  # the critic's gradients, first in backward order, were bad too
        assert not freeze and not scoped and event.kind == "loss", event


def test_a_gradient_after_a_last_module_without_parameters_names_it_and_the_loss():
    # the NaN is born in the backward of the model's last module, which has no parameters: the
    # first gradient checked is the layer before it, and nothing tells that module from the loss
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1), GradFault())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="warn") as guard:
        model[3].armed = True
        model(torch.randn(4, 8)).sum().backward()
        with contextlib.suppress(nanguard.NonFiniteError):
            optimizer.step()
    event = guard.events[0]
    assert event.kind == "grad" and event.layer == "2.weight", event
    assert "no module that ran after it in the forward left a gradient to check" in event.message
    assert "3 (GradFault)" in event.message and "the loss's gradient" in event.message, event.message
    assert "born in the backward pass" not in event.message
