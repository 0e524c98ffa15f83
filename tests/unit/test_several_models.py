"""Scripts that train several models with several optimizers (a GAN, a student and its EMA
teacher): the step clock, the blame of a gradient whose module ran in an earlier step, and what
an incident holds of each model."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import nanguard
from nanguard.errors import IncidentError
from nanguard.incident import read_incident
from test_guard import GradFault
from test_replay import REPO


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
        assert not freeze and event.kind == "loss", event


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
    assert "no module that ran after it in the forward left a gradient checked at this step" in event.message
    assert "3 (GradFault)" in event.message and "the loss's gradient" in event.message, event.message
    assert "born in the backward pass" not in event.message


GAN_SCRIPT = """
import math, sys, torch, nanguard
from torch import nn
nanguard.init()                  # bare: the generator and the critic are found as two roots
class Log(nn.Module):  # its forward makes NaN from finite values once its (persistent) switch is on
    def __init__(self):
        super().__init__()
        self.register_buffer("on", torch.zeros(()))

    def forward(self, x):
        return torch.log(-(x.abs() + 1.0)) if self.on > 0 else x


torch.manual_seed(0)
G = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
D = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), Log())
opt_g, opt_d = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
fault = sys.argv[1]
for iteration in range(4):
    if iteration == 2 and fault == "critic weight":  # a corrupt critic, between iterations
        with torch.no_grad():
            D[2].weight[0, 0] = math.nan
    if iteration == 2 and fault == "critic code":
        D[3].on.fill_(1.0)
    real, noise = torch.randn(16, 8), torch.randn(16, 8)
    fake = G(noise)
    d_loss = nn.functional.softplus(-D(real)).mean() + nn.functional.softplus(D(fake.detach())).mean()
    opt_d.zero_grad(); d_loss.backward(); opt_d.step()
    score = D(fake)
    g_loss = nn.functional.softplus(-score).mean()
    if iteration == 2 and fault == "generator loss":
        g_loss = g_loss + torch.sqrt((score - score.detach()).abs().sum())
    opt_g.zero_grad(); g_loss.backward(); opt_g.step()
print("loop ended")
"""


def run_gan(tmp_path, fault: str, replay: str | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "gan.py"
    script.write_text(GAN_SCRIPT)
    # this checkout's nanguard, not whichever one the interpreter has installed
    env = {"NANGUARD_DIR": str(tmp_path / "inc"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    if replay is not None:
        env["NANGUARD_REPLAY"] = replay
    return subprocess.run([sys.executable, str(script), fault], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_bare_init_names_and_saves_every_model_and_its_replay_loads_them(tmp_path):
    first = run_gan(tmp_path, "critic weight")
    assert first.returncode != 0 and "NonFiniteError" in first.stderr
    (incident,) = (tmp_path / "inc").iterdir()
    saved = read_incident(str(incident))
    event = saved.first_event
    # the critic's names begin with its class and number: "2" alone would be the generator's layer
    assert (event.kind, event.layer, event.step) == ("forward", "Sequential#2.2", 2), event
    state = saved.rank_state(0)
    assert set(state["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    critic = state["extra"]["more_models"]["Sequential#2"]["model"]
    assert critic["2.weight"].shape == (1, 16) and math.isnan(critic["2.weight"][0, 0])
    # the replayed script's critic is finite: only the incident's weights make the step bad again
    second = run_gan(tmp_path, "none", replay=str(incident))
    assert second.returncode == 0, second.stderr
    report = read_incident(str(incident)).replay_report()
    assert report["verdict"] == "reproducible" and report["first_event"]["layer"] == "Sequential#2.2", report


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("bad", [0, 1, 2, 3])
def test_a_bare_init_names_each_model_by_its_class_and_number(bad):
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4)), Critic(), nn.Sequential(nn.Linear(4, 4))]
    expected = ["0", "Sequential#2.0", "Critic.fc", "Sequential#3.0"]
    with nanguard.init(on_nan="warn") as guard:
        optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
        for step in range(2):
            if step == 1:
                with torch.no_grad():
                    next(models[bad].parameters())[0, 0] = math.nan
            sum(model(torch.randn(2, 4)).pow(2).sum() for model in models).backward()  # (the NaN weight reaches the gradients)
            optimizer.step()
            optimizer.zero_grad()
        (event,) = [e for e in guard.events if e.kind == "forward"]
    assert (event.layer, event.step) == (expected[bad], 1), event


def test_the_replay_of_a_bare_inits_second_model_names_the_operation_in_it(tmp_path):
    first = run_gan(tmp_path, "critic code")
    (incident,) = (tmp_path / "inc").iterdir()
    event = read_incident(str(incident)).first_event
    assert (event.layer, event.micro_batch) == ("Sequential#2.3", 0), first.stderr[-2000:]
    second = run_gan(tmp_path, "none", replay=str(incident))
    assert second.returncode == 0, second.stderr
    report = read_incident(str(incident)).replay_report()
    (op,) = report["operations"]["0"]["forward"][:1]
    # it ran in the critic's module, in its first forward of the step: not "outside the modules"
    assert (op["op"], op["module"], op["micro_batch"]) == ("aten::log", "Sequential#2.3", 0), op
    assert report["verdict"] == "reproducible", report["message"]


def test_a_step_stopped_at_a_later_optimizer_is_refused_by_a_replay_with_the_reason(tmp_path):
    first = run_gan(tmp_path, "generator loss")
    assert first.returncode != 0 and "NonFiniteError" in first.stderr
    (incident,) = (tmp_path / "inc").iterdir()
    assert read_incident(str(incident)).rank_state(0)["extra"]["optimizer_steps_before"] == 1
    second = run_gan(tmp_path, "generator loss", replay=str(incident))
    assert second.returncode != 0 and "loop ended" not in second.stdout
    assert "was stopped at an optimizer that steps after 1 other optimizer step(s)" in second.stderr
    assert "This step cannot be replayed; nothing was run" in second.stderr
    assert not (incident / "replay.json").exists()


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.none(), st.integers(), st.text(max_size=4),
    st.dictionaries(st.sampled_from(["more_models", "other"]), st.one_of(
        st.none(), st.integers(), st.dictionaries(st.sampled_from(["Sequential", "D", ""]), st.one_of(
            st.none(), st.text(max_size=3), st.dictionaries(st.sampled_from(["model", "non_persistent_buffers"]),
                                                            st.one_of(st.none(), st.integers(), st.just({}), st.just(
                                                                {"weight": torch.ones(1, 4), "bias": torch.ones(1)}),
                                                                st.just({"weight": torch.ones(2, 4)}),
                                                                st.just({3: torch.ones(1)})), max_size=2)),
            max_size=2)), max_size=2)))
def test_another_model_of_any_incident_is_loaded_only_when_it_fits(extra):
    from nanguard.incident import IncidentError as Refused
    from nanguard.replay.load import load_other_model

    model = nn.Linear(4, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    record = extra.get("more_models") if isinstance(extra, dict) else None
    held = isinstance(record, dict) and "Sequential" in record
    entry = record["Sequential"] if held else None
    fits = held and isinstance(entry, dict) and isinstance(entry.get("model"), dict) and set(
        entry["model"]) == {"weight", "bias"} and entry.get("non_persistent_buffers", {}) == {}
    absent = record is None or (isinstance(record, dict) and not held)
    if absent:
        assert load_other_model(extra, "Sequential", model, "state.pt") is False
    elif fits:
        assert load_other_model(extra, "Sequential", model, "state.pt") is True
        assert torch.equal(model.weight, torch.ones(1, 4))
        return
    else:
        with pytest.raises(Refused, match="^state.pt: "):
            load_other_model(extra, "Sequential", model, "state.pt")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded


def test_a_replay_loads_the_optimizer_state_into_the_optimizer_that_stepped_first(monkeypatch, incidents_in_tmp):
    # init is given [generator's, critic's] but the critic steps first: the incident holds the
    # critic's optimizer, and a replay must not load it into the generator's (their counts match)
    def script(fault: bool):
        generator, critic, opt_g, opt_d = gan()
        models = nn.ModuleDict({"G": generator, "D": critic})
        with nanguard.init(models, [opt_g, opt_d]):
            for iteration in range(4):
                if fault and iteration == 2:  # a corrupt critic between iterations: the critic's step stops
                    with torch.no_grad():
                        critic[2].weight[0, 0] = math.nan
                gan_iteration(generator, critic, opt_g, opt_d)

    with pytest.raises(nanguard.NonFiniteError) as info:
        script(fault=True)
    assert info.value.event.step == 2 and info.value.event.layer == "D.2", info.value.event
    monkeypatch.setenv("NANGUARD_REPLAY", info.value.incident)
    opts = []
    monkeypatch.setattr(torch.optim.Adam, "load_state_dict", lambda self, state: opts.append((self, state)))
    with pytest.raises(SystemExit):
        script(fault=False)
    assert len(opts) == 1
    loaded_into, state = opts[0]
    shapes = {tuple(s["exp_avg"].shape) for s in state["state"].values()}
    assert (1, 16) in shapes and all(p.shape in {(16, 8), (16,), (1, 16), (1,)}
                                     for g in loaded_into.param_groups for p in g["params"])


@pytest.mark.parametrize("own_comm", [False, True])
def test_fsdp2_on_one_rank_claims_nothing_of_other_ranks(tmp_path, own_comm):
    # one rank (gloo): FSDP2 still shards into DTensors, but sums nothing across ranks (no
    # reduce-scatter runs), so a report must not say another rank sent the NaN, nor that the rank
    # it was born on is not known. The torchrun tests check two ranks, watched and not
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class Mine(DefaultReduceScatter):  # a team's own reduce-scatter: nanguard leaves it alone
        pass

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), GradFault(), nn.Linear(8, 2))
        fully_shard(model)
        if own_comm:
            model.set_custom_reduce_scatter(Mine())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with nanguard.init(model, optimizer):
            model[1].armed = True
            model(torch.randn(4, 8)).sum().backward()
            with pytest.raises(nanguard.NonFiniteError) as info:
                optimizer.step()
    finally:
        dist.destroy_process_group()
    event = info.value.event
    assert event.kind == "grad" and event.layer == "0.weight", event
    assert "born in the backward pass between the gradients of 2 (finite) and this one" in event.message
    assert "rank" not in event.message, event.message


@pytest.mark.parametrize("made, replayed", [("fsdp2", "plain"), ("plain", "fsdp2")])
def test_an_incident_replayed_with_the_model_wrapped_another_way_is_refused_clearly(tmp_path, monkeypatch,
                                                                                   made, replayed):
    # FSDP2's DTensor shards against whole tensors: the loader's own error was a raw torch one
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    def script():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), GradFault(), nn.Linear(8, 2))
        if (made if "NANGUARD_REPLAY" not in os.environ else replayed) == "fsdp2":
            fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with nanguard.init(model, optimizer):
            model[1].armed = True
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()

    monkeypatch.setenv("NANGUARD_DIR", str(tmp_path / "incidents"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(nanguard.NonFiniteError) as info:
            script()
        monkeypatch.setenv("NANGUARD_REPLAY", info.value.incident)
        with pytest.raises(IncidentError, match="sharded .FSDP2's DTensor. in the .* state only"):
            script()
    finally:
        dist.destroy_process_group()


def two_part_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    head = nn.Linear(1, 1)
    return net, head, torch.optim.SGD(net.parameters(), lr=0.01), torch.optim.SGD(head.parameters(), lr=0.01)


def test_a_container_whose_children_the_script_calls_keeps_and_checks_their_buffers():
    # init(nn.ModuleDict(...)): its own forward never runs, so the first child to run starts the step
    net, head, opt1, opt2 = two_part_model()
    models = nn.ModuleDict({"net": net, "head": head})
    with nanguard.init(models, [opt1, opt2]):
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(4):
                if step == 2:
                    with torch.no_grad():
                        net[1].running_var[0] = math.nan  # as a corrupt checkpoint would leave it
                head(net(torch.randn(8, 4))).pow(2).mean().backward()
                opt1.step(), opt2.step()
                opt1.zero_grad(), opt2.zero_grad()
    event = info.value.event
    assert (event.kind, event.layer, event.step) == ("buffer", "net.1.running_var", 2), event


@pytest.mark.parametrize("container", [True, False])
def test_a_skipped_step_drops_every_optimizers_update_and_is_reported_once(container, caplog):
    net, head, opt1, opt2 = two_part_model()
    model = nn.ModuleDict({"net": net, "head": head}) if container else nn.Sequential(net, head)
    with nanguard.init(model, [opt1, opt2], on_nan="skip") as guard:
        for step in range(4):
            x = torch.randn(8, 4)
            if step == 2:
                x[0, 0] = math.nan  # BatchNorm's statistics and every gradient go NaN in this step
                before = {k: v.clone() for k, v in model.state_dict().items()}
            (head(net(x)) if container else model(x)).pow(2).mean().backward()
            opt1.step(), opt2.step()
            opt1.zero_grad(), opt2.zero_grad()
            if step == 2:  # neither update happened, and the statistics were put back
                assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        events = guard.events
    assert guard.skipped_steps == 1 and [e.step for e in events] == [2], events
    assert "first written in this step" not in caplog.text


def phase_two_script(fault: bool):
    """Both optimizers step for 3 iterations, then only the head's (the body is frozen): the
    incident of a phase-2 step holds the head's optimizer, which steps second in a replayed run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    body, head = torch.optim.SGD(model[0].parameters(), lr=0.01), torch.optim.Adam(model[2].parameters())
    with nanguard.init(model, [body, head]):
        for step in range(6):
            if fault and step == 4:
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if step < 3:
                body.step()
            head.step()
            body.zero_grad(), head.zero_grad()


def test_an_optimizer_state_is_loaded_only_into_the_optimizer_of_its_parameters(monkeypatch, incidents_in_tmp):
    with pytest.raises(nanguard.NonFiniteError) as info:
        phase_two_script(fault=True)
    state = read_incident(info.value.incident).rank_state(0)
    assert state["extra"]["optimizer_params"] == ["2.weight", "2.bias"]
    monkeypatch.setenv("NANGUARD_REPLAY", info.value.incident)
    with pytest.raises(SystemExit):
        phase_two_script(fault=False)  # the replay ends at the body's step, the first here
    report = read_incident(info.value.incident).replay_report()
    # the head's Adam state is not forced into the body's SGD (it was refused as "does not fit")
    assert any("was not loaded into the script's SGD" in note for note in report["notes"]), report["notes"]
    assert report["verdict"] == "reproducible", report["message"]


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.none(), st.integers(), st.text(max_size=3), st.lists(st.one_of(st.text(max_size=3), st.integers()),
                                                                        max_size=3)))
def test_the_names_of_any_incidents_optimizer_parameters_are_a_list_of_names_or_refused(held):
    from nanguard.incident import IncidentError as Refused
    from nanguard.replay.load import _optimizer_params

    fine = held is None or (isinstance(held, list) and all(isinstance(n, str) for n in held))
    if fine:
        assert _optimizer_params({"optimizer_params": held}, "state.pt") == held
    else:
        with pytest.raises(Refused, match="^state.pt: holds optimizer_params that are not a list of names"):
            _optimizer_params({"optimizer_params": held}, "state.pt")


CHILD_FIRST_SCRIPT = """
import sys, torch, nanguard
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
nanguard.init()
for step in range(4):
    if step == 2 and sys.argv[1] == "weight":
        with torch.no_grad():
            model.encoder[2].weight[0, 0] = float("nan")
    x, x2 = torch.randn(16, 8), torch.randn(16, 8)
    if step == 2 and sys.argv[1] == "batch":
        x[0, 0] = float("nan")
    anchor = model.encoder(x2)  # a child of the model, called alone before the model: found first
    pred = model(x)
    loss = ((pred - 0.1 * anchor.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_child_the_script_calls_before_its_model_is_a_module_inside_the_model(tmp_path):
    # a bare init() makes the encoder a root (found first); inside the model's forward it is a
    # module: its call there is not a micro-batch of its own, and a replay does not feed it
    script = tmp_path / "child.py"
    script.write_text(CHILD_FIRST_SCRIPT)
    env = {"NANGUARD_DIR": str(tmp_path / "inc"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    batch = subprocess.run([sys.executable, str(script), "batch"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert "the input batch of Net was already non-finite" in batch.stderr, batch.stderr[-3000:]
    assert "born in this module" not in batch.stderr
    shutil.rmtree(tmp_path / "inc")
    first = subprocess.run([sys.executable, str(script), "weight"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert "NonFiniteError" in first.stderr
    (incident,) = (tmp_path / "inc").iterdir()
    second = subprocess.run([sys.executable, str(script), "none"], env={**env, "NANGUARD_REPLAY": str(incident)},
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert read_incident(str(incident)).replay_report()["verdict"] == "reproducible"


def test_the_gradient_norm_guard_watches_one_series_with_two_optimizers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    body, head = torch.optim.SGD(model[0].parameters(), 0.01), torch.optim.SGD(model[1].parameters(), 0.01)
    with nanguard.init(model, [body, head], grad_norm_warn=1e-12) as guard:  # every step warns
        for _ in range(3):
            model(torch.randn(4, 4)).sum().backward()
            body.step(), head.step()
            body.zero_grad(), head.zero_grad()
        events = guard.events
    assert [e.step for e in events if e.kind == "grad_norm"] == [0, 1, 2], events



SWEEP = """
import gc, json, sys, torch, nanguard
from torch import nn

def train(model, steps, fault=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if fault is not None and step == steps - 1:
            fault.register_hook(lambda grad: grad * float("nan"))
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

torch.manual_seed(0)
with nanguard.init():
    first = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    train(first, 2)
    old = {id(p) for p in first.parameters()}
    del first
    gc.collect()
    spare = []  # (until one takes a freed parameter's id: in a fresh process, the first does)
    weight = nn.Parameter(torch.randn(4, 4))
    while id(weight) not in old and len(spare) < 1000:
        spare.append(weight)
        weight = nn.Parameter(torch.randn(4, 4))
    second = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    second[2].weight = weight
    out = {"reused": id(weight) in old}
    try:
        train(second, 2, fault=weight)
    except nanguard.NonFiniteError as err:
        out["event"] = {"step": err.event.step, "bad_params": err.event.extra["bad_params"]}
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in second.parameters())
print(json.dumps(out))
"""


def test_a_model_built_after_another_was_freed_has_every_gradient_checked_under_its_own_names(tmp_path):
    # a sweep under one bare init(): a parameter of the second model takes the id a freed one of
    # the first had; it is checked (its NaN gradient alone is stopped before the update) and
    # named as the second model's, never with the first one's name. In a fresh process, where
    # the allocator hands the freed id out again
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO), "NANGUARD_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["reused"], "no parameter took a freed one's id: the premise of this test"
    assert out["event"] == {"step": 3, "bad_params": ["Sequential.2.weight"]}, out
    assert out["finite"]


def test_the_names_of_freed_parameters_are_forgotten():
    import gc

    from nanguard.rank.records import Catalog

    catalog = Catalog()
    param = nn.Parameter(torch.zeros(2))
    catalog.name_param(param, "a.weight", holder=0, first=True)
    catalog.name_param(param, "b.weight", holder=1, first=True)  # (a tied weight: its first name stays)
    assert catalog.param_name(param) == "a.weight" and catalog.param_holders[id(param)] == [0, 1]
    del param
    gc.collect()
    assert not catalog.param_names and not catalog.param_holders


def _distill(student: nn.Module, teacher: nn.Module, optimizer: torch.optim.Optimizer, bad: bool) -> None:
    """One distillation step: the teacher's targets made with autograd off (a NaN weight of its own first, ``bad``)."""
    x = torch.randn(4, 8)
    if bad:
        with torch.no_grad():
            teacher[2].weight[0, 0] = math.nan
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    nn.functional.kl_div(student(x).log_softmax(-1), target, reduction="batchmean").backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.modes("sentinel", "full")
def test_a_teachers_nan_under_no_grad_is_told_beside_the_loss_it_made(guard_mode):
    # distillation under a bare init(): the teacher runs under no_grad, so its forward is settled
    # apart as an evaluation; the loss made of its NaN targets says where they may have come from
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5)).requires_grad_(False)
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    with nanguard.init() as guard:
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(5):
                if step == 1:  # a validation pass with a NaN input: of no step, told of nowhere else
                    with torch.no_grad():
                        student(torch.full((2, 8), math.nan))
                _distill(student, teacher, optimizer, bad=step == 3)
    event = info.value.event
    assert event.step == 3 and event.kind in ("loss", "grad"), event
    # (the full mode names the teacher's module; the sentinel, which probes an evaluation's output only, the teacher)
    where = "2," if guard_mode == "full" else "the model (Sequential), reported as an evaluation"
    assert "a forward with autograd off before this step's training forward made a non-finite value too" \
           f" (in {where}" in event.message, event.message
    evaluations = [e for e in guard.events if e.step == 1]
    assert evaluations and all("autograd off" in e.message for e in evaluations)
    assert all(torch.isfinite(p).all() for p in student.parameters())


@pytest.mark.parametrize("bare_first", [False, True])
def test_a_bare_init_beside_a_guard_of_one_model_leaves_that_models_steps_to_it(bare_first):
    # a script guards its model, and a library (or a second call) guards the rest of the process with a
    # bare init(): each step is decided by the guard of the model it updates, which names what it saw
    torch.manual_seed(0)
    mine, other = (nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)) for _ in range(2))
    opt_mine, opt_other = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (mine, other))
    guards = {}
    for which in ("bare", "mine") if bare_first else ("mine", "bare"):
        guards[which] = nanguard.init(on_nan="skip") if which == "bare" else nanguard.init(mine, opt_mine, on_nan="skip")
    try:
        for step in range(4):
            for model, optimizer, bad in ((mine, opt_mine, step == 1), (other, opt_other, step == 2)):
                x = torch.randn(5, 8)
                if bad:
                    x[0, 0] = math.nan
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        mine_events = [(e.step, e.kind, e.layer) for e in guards["mine"].events]
        bare_events = [(e.step, e.kind, e.layer) for e in guards["bare"].events]
    finally:
        for guard in guards.values():
            guard.close()
    assert mine_events == [(1, "forward", "0")]
    assert bare_events == [(2, "forward", "0")]  # (its first model's names are the model's own)
    assert all(torch.isfinite(p).all() for m in (mine, other) for p in m.parameters())


@pytest.mark.parametrize("mode", ["sentinel", "full"])
def test_a_teachers_unchecked_targets_are_told_where_a_report_says_the_forward_was_finite(mode):
    # a student and its EMA teacher guarded in one container; the teacher's targets are made with autograd
    # off, which nothing checks: a NaN they bring stops the step at the loss, and the report does not say
    # the forward was finite without saying what was not checked
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    teacher = copy.deepcopy(student).requires_grad_(False)
    both = nn.ModuleDict({"student": student, "teacher": teacher})
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    with nanguard.init(both, optimizer, mode=mode), pytest.raises(nanguard.NonFiniteError) as info:
        for step in range(4):
            _distill(student, teacher, optimizer, bad=step == 2)
    event = info.value.event
    assert event.step == 2 and event.kind == "loss"
    assert "1 call(s) of the model's parts with autograd off in this step" in event.message


def test_a_nan_in_the_gradients_of_an_unguarded_model_whose_optimizer_was_given_says_so(caplog):
    # init(generator, [opt_g, opt_d]): the critic is not guarded, its optimizer is; a NaN in its gradients is
    # stopped, and the report says they belong to no guarded module, not that a forward was made earlier
    generator, critic, opt_g, opt_d = gan()
    with nanguard.init(generator, [opt_g, opt_d]), pytest.raises(nanguard.NonFiniteError) as info:
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    critic[0].weight[0, 0] = math.nan
            gan_iteration(generator, critic, opt_g, opt_d)
    assert "steps none of the parameters of the model given" in caplog.text  # (said at init)
    event = info.value.event
    assert event.step == 2 and event.kind == "grad" and event.layer.startswith("<unnamed parameter")
    assert "belongs to no module of the guarded model" in event.message
    assert "used again" not in event.message
