"""The two tiers: the sentinel decides every step from what the update depends on, the microscope
re-runs only a bad step from memory under the full probes, and says whether the re-run reproduced it.

The oracle is the fault each test plants (where, which micro-batch, on which execution), and the
same test run in full mode, which probes every module the first time round."""

import math
import sys

import pytest
import torch
from torch import nn

import nanguard

from conftest import make_mlp, snapshot

MODES = ("sentinel", "full")
MARK = 1234.0
"""a value planted in a batch: the model's Fault goes off on the forward fed it (a fault of the data,
which every run of that batch makes again)"""


@pytest.fixture(autouse=True)
def sentinel(monkeypatch):
    """Every guard here is a sentinel unless it says otherwise."""
    monkeypatch.setenv("NANGUARD_MODE", "sentinel")


def _faulty_on_the_mark(model):
    model.register_forward_pre_hook(lambda module, args: setattr(module[2], "armed", bool((args[0] == MARK).any())))


def _run(model, optimizer, guard, steps, micro_batches=1, after_forward=lambda k, x: None, seed=1,
         after_backward=lambda k, x: None, mark=None):
    """Train ``steps`` steps of ``micro_batches`` each; returns the NonFiniteError that stopped it, or None."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for k in range(micro_batches):
            x = torch.randn(5, 8, generator=gen)
            if mark is not None and mark(k):
                x[1, 1] = MARK
            y = torch.randint(0, 4, (5,), generator=gen)
            loss = nn.functional.cross_entropy(model(x), y) / micro_batches
            after_forward(k, x)
            loss.backward()
            after_backward(k, x)
        try:
            optimizer.step()
        except nanguard.NonFiniteError as err:
            return err
        optimizer.zero_grad()
    return None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("micro_batches, bad_micro_batch", [(1, 0), (3, 2)])
def test_a_deterministic_fault_is_named_alike_in_both_modes(mode, micro_batches, bad_micro_batch):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = None
    _faulty_on_the_mark(model)
    with nanguard.init(model, optimizer, mode=mode) as guard:
        assert _run(model, optimizer, guard, 2, micro_batches) is None
        before = snapshot(model, optimizer)
        err = _run(model, optimizer, guard, 1, micro_batches, mark=lambda k: k == bad_micro_batch)
    assert err is not None
    event = err.event
    assert (event.step, event.kind, event.layer, event.module_type, event.micro_batch) == \
        (2, "forward", "2", "Fault", bad_micro_batch)
    assert event.input_nonfinite is False and event.has_nan and event.first_index == (0, 3)
    if mode == "sentinel":
        assert (event.reproduced, event.verdict) == (True, "reproducible")
        assert event.device == "cpu"
    after = snapshot(model, optimizer)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("refill", ["through .data", "through numpy"])
@pytest.mark.parametrize("bad_step", [0, 2])
def test_a_buffer_refilled_without_a_version_between_micro_batches_is_never_called_a_transient(mode, refill, bad_step):
    # one input buffer for both micro-batches, refilled where no in-place version counts it: in the first step,
    # the re-run of micro-batch 0 gets micro-batch 1's data, clean, which proves nothing of the hardware; from
    # the next step on, what each micro-batch was fed is copied, and the fault is reproduced
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _faulty_on_the_mark(model)
    buf, gen = torch.zeros(5, 8), torch.Generator().manual_seed(1)
    with nanguard.init(model, optimizer, mode=mode), pytest.raises(nanguard.NonFiniteError) as info:
        for step in range(3):
            for k in range(2):
                fresh = torch.randn(5, 8, generator=gen)
                if step == bad_step and k == 0:
                    fresh[1, 1] = MARK
                if refill == "through .data":
                    buf.data.copy_(fresh)
                else:
                    buf.numpy()[:] = fresh.numpy()
                loss = nn.functional.cross_entropy(model(buf), torch.randint(0, 4, (5,), generator=gen)) / 2
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    event = info.value.event
    assert event.step == bad_step
    if bad_step == 0:
        assert (event.reproduced, event.verdict) == (None, None)
        assert "refilled" in event.message and "the forward was finite" not in event.message
    else:
        assert (event.reproduced, event.verdict, event.layer, event.micro_batch) == (True, "reproducible", "2", 0)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_cut_from_one_batch_are_not_taken_for_a_refilled_buffer(mode):
    # chunks of one batch share its storage, each beginning apart: a transient in one of them is still one
    model = _transient_model(bad_call=5)  # step 2's micro-batch 0 (two calls a step)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    with nanguard.init(model, optimizer, mode=mode), pytest.raises(nanguard.NonFiniteError) as info:
        for _ in range(4):
            batch, labels = torch.randn(10, 8, generator=gen), torch.randint(0, 4, (10,), generator=gen)
            for x, y in zip(batch.chunk(2), labels.chunk(2)):
                (nn.functional.cross_entropy(model(x), y) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
    event = info.value.event
    assert (event.step, event.micro_batch, event.reproduced, event.verdict) == (2, 0, False, "transient")
    assert "refilled" not in event.message


class FirstTimeOnly(nn.Module):
    """Makes a NaN on its ``bad_call``-th execution only: a fault a re-run does not make again (a
    stand-in for a bit flipped by the hardware)."""

    def __init__(self, bad_call: int):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = 0
        self.bad_call = bad_call

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        return y * float("nan") if self.calls == self.bad_call else y


def _transient_model(bad_call: int):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), FirstTimeOnly(bad_call), nn.ReLU(), nn.Linear(16, 4))


def test_a_transient_is_not_reproduced_and_blames_no_module():
    model = _transient_model(bad_call=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        err = _run(model, optimizer, guard, 5)
    event = err.event
    assert event.step == 2 and model[2].calls == 4  # one execution more: the microscope's re-run
    assert (event.reproduced, event.verdict) == (False, "transient")
    assert event.layer == "" and event.module_type == "Sequential"  # the model's output, no module of it
    assert "not reproduced" in event.message and "cpu" in event.message
    assert "born in this module" not in event.message


@pytest.mark.parametrize("micro_batches, bad_call", [(1, 3), (3, 8)])
def test_a_transient_reported_on_the_models_output_describes_that_output(micro_batches, bad_call):
    # the decision first found a gradient (or the loss) bad; the report is of the model's output, so its
    # shape, counts and micro-batch are the output's, not those of the tensor the decision read
    model = _transient_model(bad_call=bad_call)  # call 8 of 3 a step: step 2's micro-batch 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        err = _run(model, optimizer, guard, 5, micro_batches)
    event = err.event
    assert (event.step, event.verdict, event.layer) == (2, "transient", "")
    assert event.micro_batch == (bad_call - 1) % micro_batches
    assert (event.shape, event.numel, event.bad_count, event.nan_count) == ((5, 4), 20, 20, 20)
    assert event.has_nan and event.first_index == (0, 0) and event.finite_min is None


def test_full_mode_names_the_producer_of_a_transient_and_gives_the_verdict_too():
    model = _transient_model(bad_call=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, mode="full") as guard:
        err = _run(model, optimizer, guard, 5)
    event = err.event
    assert (event.step, event.layer, event.module_type) == (2, "2", "FirstTimeOnly")  # seen born in the first pass
    assert model[2].calls == 4  # and re-run once for the verdict
    assert (event.reproduced, event.verdict, event.device) == (False, "transient", "cpu")
    assert "not reproduced" in event.message and "probes saw it born here" in event.message
    assert event.message.index("script's own state") < event.message.index("hardware")  # (the suspects in order)


class MaskedPolicy(nn.Module):
    """An RL policy that adds its additive -inf action mask (an input) to its logits itself."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, obs, mask):
        return self.head(obs) + mask


@pytest.mark.parametrize("mode", MODES)
def test_an_intended_minus_inf_output_never_stops_a_step(mode):
    """What stops a step is the same in every mode: the loss and every gradient are finite. The full
    mode, which sees the -inf logits, says so in a warning event of each step's micro-batch."""
    torch.manual_seed(0)
    model = MaskedPolicy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.tensor([0.0, 0.0, float("-inf"), 0.0])
    before = model.head.weight.detach().clone()
    with nanguard.init(model, optimizer, mode=mode) as guard:
        for _ in range(3):
            logits = model(torch.randn(5, 8), mask)
            loss = -torch.log_softmax(logits, -1)[:, 0].mean()
            guard.check(loss, "loss")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert guard.step == 3 and guard.skipped_steps == 0 and not model.head.weight.equal(before)
        events = list(guard.events)
    if mode == "sentinel":
        assert not events  # (it probes no module output on a clean step)
    else:
        assert [(e.kind, e.step, e.micro_batch) for e in events] == [("forward", k, 0) for k in range(3)]
        assert all("reached none of what the update depends on" in e.message for e in events)


class IllegalActions(nn.Module):
    def forward(self, logits):
        return logits.masked_fill(torch.tensor([False, False, True, False]), float("-inf"))


class MaskedActorCritic(nn.Module):
    """A policy that masks its illegal actions with -inf (on purpose, in a module of its own), beside a value head."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.policy = nn.Linear(16, 4)
        self.mask = IllegalActions()
        self.value = nn.Linear(16, 1)

    def forward(self, obs):
        h = torch.relu(self.trunk(obs))
        return torch.log_softmax(self.mask(self.policy(h)), -1), self.value(h)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", ["value head", "target"])
def test_an_intended_minus_inf_is_not_blamed_for_a_fault_elsewhere_in_its_step(mode, fault):
    # the masked logits are the step's first non-finite values every step; a NaN weight of the value head is what
    # stops step 2, and is named; a NaN the script's target brings in names no module for sure
    torch.manual_seed(0)
    model = MaskedActorCritic()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.init(model, optimizer, mode=mode) as guard, pytest.raises(nanguard.NonFiniteError) as info:
        for step in range(4):
            obs, target = torch.randn(5, 8), torch.randn(5, 1)
            if step == 2 and fault == "value head":
                with torch.no_grad():
                    model.value.weight[0, 3] = math.nan
            if step == 2 and fault == "target":
                target[1, 0] = math.nan
            logp, value = model(obs)
            loss = -logp[:, 0].mean() + nn.functional.mse_loss(value, target)
            guard.check(loss, "loss")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    event = info.value.event
    assert event.step == 2
    if fault == "value head":
        assert (event.kind, event.layer) == ("forward", "value") and "weight" in event.message
        assert "made -inf before it" in event.message
    else:
        assert "as an intended mask makes" in event.message and "guard.check" in event.message


class DrawsItsFault(nn.Module):
    """Makes a NaN where a random draw of its own says so (as a dropout mask decides what survives)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.draws = []

    def forward(self, x):
        y = self.lin(x)
        draw = torch.rand(()).item()
        self.draws.append(draw)
        return y * float("nan") if draw > 0.9 else nn.functional.dropout(y, 0.5)


def _drawn(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), DrawsItsFault(), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(3)
    with nanguard.init(model, optimizer, mode=mode) as guard:
        err = _run(model, optimizer, guard, 40, micro_batches=3)
    return model, err, torch.get_rng_state()


def test_a_fault_decided_by_the_rng_is_reproduced_in_its_micro_batch():
    model, err, state_after = _drawn("sentinel")
    assert err is not None
    draws = model[2].draws
    first = next(i for i, d in enumerate(draws) if d > 0.9)
    event = err.event
    assert (event.step, event.micro_batch) == (first // 3, first % 3)
    assert (event.layer, event.reproduced, event.verdict) == ("2", True, "reproducible")
    # the re-run drew again, each micro-batch from its own state: the same draws as the original
    start = first - first % 3
    assert len(draws) == start + 6 and draws[start + 3:] == draws[start:start + 3]
    # and the script's generator goes on as if nothing re-ran: as in full mode, which re-runs nothing
    full, full_err, full_state = _drawn("full")
    assert (full_err.event.step, full_err.event.micro_batch, full_err.event.layer) == \
        (event.step, event.micro_batch, event.layer)
    assert torch.equal(state_after, full_state)


def test_a_batch_changed_in_place_after_its_forward_is_not_re_run():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _faulty_on_the_mark(model)
    with nanguard.init(model, optimizer) as guard:
        err = _run(model, optimizer, guard, 1, mark=lambda k: True, after_backward=lambda k, x: x.mul_(0))
    event = err.event
    assert event.reproduced is None and event.verdict is None
    assert "changed in place" in event.message
    assert event.kind in ("loss", "grad", "backward")  # no forward probe saw it: no module is named


def test_an_overflow_the_gradscaler_skips_never_wakes_the_microscope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    calls = []
    model[0].register_forward_hook(lambda *a: calls.append(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 120)  # the first steps overflow
    with nanguard.init(model, optimizer, scaler=scaler) as guard:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(5, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert scaler.get_scale() < 2.0 ** 120  # it did skip
        assert guard.step == 4 and not guard.events
    assert len(calls) == 4  # one forward a step: nothing re-ran


def _calls_of_a_clean_step(model, mode):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    called = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__", "").startswith("nanguard"):
            called.append(f"{frame.f_globals['__name__']}.{frame.f_code.co_name}")

    with nanguard.init(model, optimizer, mode=mode) as guard:
        _run(model, optimizer, guard, 3)
        sys.setprofile(profile)
        try:
            assert _run(model, optimizer, guard, 1) is None
        finally:
            sys.setprofile(None)
    return called


def _deep(layers):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), *[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.GELU())],
                         nn.Linear(16, 4))


def test_the_python_calls_of_a_clean_sentinel_step_do_not_grow_with_the_model():
    shallow, deep = _calls_of_a_clean_step(_deep(1), "sentinel"), _calls_of_a_clean_step(_deep(12), "sentinel")
    assert shallow and not [c for c in deep if c.endswith(".hook")]  # no module probe ran
    assert len(deep) == len(shallow) <= 130, deep
    full = _calls_of_a_clean_step(_deep(12), "full")
    assert len(full) > len(deep) + 24  # (the full mode's probe of each of the 25 modules)


def test_after_a_transient_the_guard_escalates_to_full():
    model = _transient_model(bad_call=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="skip") as guard:
        _run(model, optimizer, guard, 4)
        assert [e.verdict for e in guard.events] == ["transient"] and guard.skipped_steps == 1
        model[2].calls, model[2].bad_call = 0, 1  # another transient: now seen at its producer
        _run(model, optimizer, guard, 1)
    last = guard.events[-1]
    assert (last.layer, last.module_type) == ("2", "FirstTimeOnly")


def test_under_warn_a_transient_escalates_too():
    model = _transient_model(bad_call=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="warn") as guard:
        _run(model, optimizer, guard, 3)
        assert [e.verdict for e in guard.events] == ["transient"]
        assert guard._detector.probes.on and not guard._detector.sentinel


def test_without_escalation_the_guard_stays_a_sentinel():
    model = _transient_model(bad_call=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="skip", escalate=False) as guard:
        _run(model, optimizer, guard, 4)
        model[2].calls, model[2].bad_call = 0, 1
        _run(model, optimizer, guard, 1)
    assert [e.verdict for e in guard.events] == ["transient", "transient"]


def test_an_intended_minus_inf_output_does_not_stop_the_sentinel():
    """An RL policy returns logits + an additive -inf action mask; the loss and the gradients are finite."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.tensor([0.0, 0.0, float("-inf"), 0.0])
    with nanguard.init(model, optimizer) as guard:
        for _ in range(3):
            logits = model(torch.randn(5, 8)) + mask
            loss = -torch.log_softmax(logits, -1)[:, 0].mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert guard.step == 3 and not guard.events


def test_bad_mode_is_refused():
    with pytest.raises(nanguard.ConfigError, match="mode='fast'"):
        nanguard.init(make_mlp(), mode="fast")


def test_no_optimizer_decides_on_the_outputs_and_names_the_producer():
    model = make_mlp()
    model[2].armed = True
    with nanguard.init(model) as guard, pytest.raises(nanguard.NonFiniteError) as info:
        with torch.no_grad():
            model(torch.randn(5, 8))
    assert guard.step == 0
    assert (info.value.event.layer, info.value.event.reproduced) == ("2", True)



class OnceOnly(nn.Module):
    """A model part that refuses to run twice on one batch (it consumes an iterator, say)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.seen = set()

    def forward(self, x):
        key = x.sum().item()
        if key in self.seen:
            raise RuntimeError("this batch was consumed already")
        self.seen.add(key)
        return self.lin(x) * float("nan")


def test_a_model_that_fails_when_re_run_is_still_stopped_and_says_it_could_not_tell():
    model = OnceOnly()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with nanguard.init(model, optimizer) as guard:
        err = _run(model, optimizer, guard, 1)
    event = err.event
    assert (event.step, event.reproduced, event.verdict) == (0, None, None)
    assert "its re-run raised RuntimeError: this batch was consumed already" in event.message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_calls_of_a_models_parts_beyond_what_is_held_are_said_not_re_run():
    """A script that calls a model's part itself, more often in a step than the microscope holds: the calls
    past MAX_PARTS are not re-run, so a NaN made there is not called transient."""
    from nanguard.rank.hooks import MAX_PARTS

    torch.manual_seed(0)
    model = nn.ModuleDict({"cell": nn.Linear(4, 4)})  # (no forward of its own: the script calls its cell)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer):
        h = torch.randn(2, 4)
        for k in range(MAX_PARTS + 6):
            h = torch.tanh(model["cell"](h))
            if k == MAX_PARTS + 3:
                h = h * float("nan")  # (the script's own code, after a call that was not held)
        h.sum().backward()
        with pytest.raises(nanguard.NonFiniteError) as info:
            optimizer.step()
    event = info.value.event
    assert event.step == 0 and event.reproduced is None and event.verdict is None, event
    assert f"beyond the first {MAX_PARTS}: not held, so not re-run" in event.message


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_the_scripts_own_penalty_makes_non_finite_is_never_blamed_on_the_hardware(mode):
    # the script adds a penalty on a weight outside the model's forward (a square root of a weight
    # that went negative): no re-run of the model makes it, so a clean re-run proves no transient
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, mode=mode) as guard:
        for step in range(3):
            loss = model(torch.randn(5, 8)).pow(2).mean()
            if step == 2:
                loss = loss + torch.sqrt(model[2].weight).sum()  # NaN where the weight is negative
            loss.backward()
            if step < 2:
                optimizer.step()
                optimizer.zero_grad()
        with pytest.raises(nanguard.NonFiniteError) as info:
            optimizer.step()
    event = info.value.event
    # (the loss the backward pass began from is NaN: what the gradients' NaN came with)
    assert (event.step, event.kind, event.layer, event.extra["bad_params"]) == (2, "loss", "loss", ["2.weight"]), event
    assert (event.reproduced, event.verdict) == (None, None)
    assert "the script's own use of the model's parts or parameters outside its forward" in event.message
    assert "transient fault of the hardware" not in event.message and not guard.events[1:]


@pytest.mark.parametrize("mode", MODES)
def test_a_model_whose_wrapper_is_let_go_is_re_run_from_the_step_after(mode):
    # the script trains, from step 1 on, the model a wrapper held (as after PEFT's merge_and_unload()):
    # the guarded root runs no forward any more, and its model's calls are held for the re-run instead
    class Holder(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x)

    model = make_mlp()
    _faulty_on_the_mark(model)
    holder = Holder(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(holder, optimizer, mode=mode):
        assert _run(holder, optimizer, None, 1) is None
        assert _run(model, optimizer, None, 1) is None
        err = _run(model, optimizer, None, 1, mark=lambda k: True)
    event = err.event
    assert (event.step, event.kind, event.layer, event.module_type) == (2, "forward", "model.2", "Fault"), event
    assert (event.reproduced, event.verdict) == (True, "reproducible")


def _maml_step(model, optimizer, x, poison: bool):
    """One MAML-style step: an inner step's fast weights, then the outer loss through them by
    torch.func.functional_call; ``poison``: one element of the fast weights of layer 2 is NaN."""
    from torch.func import functional_call

    params = dict(model.named_parameters())
    inner = model(x).pow(2).mean()
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
    if poison:
        fast["2.weight"] = fast["2.weight"] * torch.tensor([[float("nan")] + [1.0] * 7, [1.0] * 8])
    functional_call(model, fast, (x,)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_weight_handed_to_a_call_is_named_and_re_run(mode):
    # the weights a call ran with are not the module's own: a report must name them (whoever owns them),
    # and the re-run must run with them, or it blames a transient of the hardware
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, mode=mode), pytest.raises(nanguard.NonFiniteError) as info:
        for step in range(4):
            _maml_step(model, optimizer, torch.randn(8, 4), poison=step == 2)
    event = info.value.event
    assert (event.step, event.kind, event.layer, event.micro_batch, event.input_nonfinite) == (2, "forward", "2", 1, False)
    assert "weight (handed to the call by torch.func.functional_call) are non-finite" in event.message
    assert (event.reproduced, event.verdict) == (True, "reproducible")
    assert all(torch.isfinite(p).all() for p in model.parameters())


class HyperLinear(nn.Module):
    """A hypernetwork: its own code makes a child's weight and runs the child with it."""

    def __init__(self):
        super().__init__()
        self.hyper = nn.Linear(4, 8 * 8)
        self.child = nn.Linear(8, 8)

    def forward(self, x, z):
        from torch.func import functional_call

        weight = self.hyper(z).view(8, 8).div(z.abs().sum() - 2.0)  # inf where the code sums to 2
        return functional_call(self.child, {"weight": weight, "bias": self.child.bias}, (x,))


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_a_hypernetwork_hands_its_child_is_named(mode):
    torch.manual_seed(0)
    model = HyperLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.init(model, optimizer, mode=mode), pytest.raises(nanguard.NonFiniteError) as info:
        for step in range(4):
            z = torch.tensor([[0.5, 0.5, 0.5, 0.5 if step == 2 else 0.25]])  # sums to 2 at step 2
            model(torch.randn(3, 8), z).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    event = info.value.event
    assert (event.step, event.layer, event.input_nonfinite) == (2, "child", False), event
    assert "weight (handed to the call by torch.func.functional_call) are non-finite" in event.message
    assert event.reproduced is True


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_nan_of_one_micro_batch_is_given_its_micro_batch(mode):
    # accumulation over 3 micro-batches, the backward of the marked one (2) makes NaN (keyed on the data):
    # the gradients sum every micro-batch's, so only a re-run of each apart tells which one made it
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.register_forward_pre_hook(lambda module, args: setattr(module[3], "armed", bool((args[0] == MARK).any())))

    def poison(module, args, out):  # the gradient flowing back into the marked micro-batch's output turns NaN
        if module.armed and out.requires_grad:
            out.register_hook(lambda grad: grad * float("nan"))

    model[3].register_forward_hook(poison)
    with nanguard.init(model, optimizer, mode=mode):
        assert _run(model, optimizer, None, 2, micro_batches=3) is None
        err = _run(model, optimizer, None, 1, micro_batches=3, mark=lambda k: k == 2)
    event = err.event
    assert (event.step, event.kind, event.micro_batch, event.reproduced) == (2, "grad", 2, True), event
    assert "micro-batch 2 was the first whose own gradients it made non-finite" in event.message


def _wide_transient_model(bad_call: int, width: int):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), FirstTimeOnly(bad_call), nn.ReLU(), nn.Linear(16, width))


def _held_through_backward(model, optimizer):
    """Whether a step's output is still alive after its backward pass, the script's references gone."""
    with nanguard.init(model, optimizer):
        _run(model, optimizer, None, 2)
        output = model(torch.randn(5, 8))
        alive = torch.utils.weak.WeakTensorKeyDictionary()  # (a weak reference that keeps nothing)
        alive[output] = True
        output.pow(2).mean().backward()
        del output
        held = len(alive) == 1
        optimizer.step()
        optimizer.zero_grad()
        assert len(alive) == 0  # let go by the decision, whatever it held
    return held


def test_on_a_cpu_a_large_output_is_not_held_through_the_backward_pass():
    # held until the decision, a large output keeps glibc from reusing its memory: the backward pass and the
    # next micro-batch map fresh pages (page faults, a seventh of a nanoGPT step); a small one costs nothing
    small, large = _wide_transient_model(0, 4), _wide_transient_model(0, 4096)  # 80 B and 80 KiB a row of 5
    assert _held_through_backward(small, torch.optim.SGD(small.parameters(), lr=0.1))
    assert not _held_through_backward(large, torch.optim.SGD(large.parameters(), lr=0.1))


def test_a_transient_in_a_large_output_is_still_judged_from_its_extremes():
    # the original output is not held on the CPU (80 KiB), but its extremes are: the re-run's clean output
    # is a transient all the same
    model = _wide_transient_model(bad_call=3, width=4096)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        err = _run(model, optimizer, guard, 5)
    event = err.event
    assert event.step == 2 and model[2].calls == 4
    assert (event.reproduced, event.verdict) == (False, "transient")
    assert event.layer == "" and event.module_type == "Sequential"
    # only its extremes were kept: NaN is told, its shape and counts are not known (not a gradient's)
    assert event.has_nan and (event.shape, event.numel, event.bad_count) == (None, None, None)
    assert event.micro_batch == 0


def test_a_backward_nan_past_what_is_held_says_its_backward_was_not_re_run():
    # a NaN made in the backward pass of a model whose output gradient (80 KiB) is not kept on a CPU: the
    # microscope cannot re-run that backward pass, and says so rather than guess
    model = _wide_transient_model(bad_call=0, width=4096)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def poison(module, args, out):
        if module.poisoned and out.requires_grad:
            out.register_hook(lambda grad: grad * float("nan"))

    model[3].poisoned = False
    model[3].register_forward_hook(poison)
    with nanguard.init(model, optimizer):
        assert _run(model, optimizer, None, 2) is None
        model[3].poisoned = True
        err = _run(model, optimizer, None, 1)
    event = err.event
    assert (event.step, event.kind, event.reproduced, event.verdict) == (2, "grad", None, None), event
    assert "backward pass of micro-batch(es) 0 was not re-run" in event.message


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_the_loss_makes_in_one_micro_batch_is_told_from_the_gradient_kept_at_the_output(mode):
    # the loss of micro-batch 1 of 3 has a log(0): the model's forward and backward are clean, and the
    # gradient that reached its output (kept: 80 B) was non-finite already, which names the loss for certain
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    with nanguard.init(model, optimizer, mode=mode):
        for step in range(3):
            for k in range(3):
                p = torch.softmax(model(torch.randn(5, 8, generator=gen)), -1)
                if step == 2 and k == 1:
                    p = p * 0
                (-torch.log(p[:, 0]).mean() / 3).backward()
            try:
                optimizer.step()
            except nanguard.NonFiniteError as err:
                event = err.event
                break
            optimizer.zero_grad()
    assert (event.step, event.kind, event.layer, event.micro_batch) == (2, "loss", "loss", 1), event
    assert "output in micro-batch(es) 1 was already non-finite" in event.message
    assert "not by the model's backward pass" in event.message and "either" not in event.message
    assert (event.reproduced, event.verdict) == (None, None)  # (the loss is the script's: nothing re-ran it)
