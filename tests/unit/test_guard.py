"""End-to-end behaviour of one guard in one process."""

import contextlib
import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

import nanguard
from conftest import Fault, assert_same_state, make_mlp, snapshot, train_step


def run_until_error(model, optimizer, guard, steps=10, arm_at=3, arm=None, **kw):
    for step in range(steps):
        if step == arm_at:
            arm()
        saved = snapshot(model, optimizer)
        try:
            train_step(model, optimizer, guard, **kw)
        except nanguard.NonFiniteError as err:
            return step, err, saved
    raise AssertionError("no NonFiniteError was raised")


def test_names_the_producer_not_the_propagators(mlp):
    model, optimizer, guard = mlp
    step, err, saved = run_until_error(model, optimizer, guard, arm=lambda: setattr(model[2], "armed", True))
    event = err.event
    assert (step, event.step, guard.step) == (3, 3, 4)
    assert (event.kind, event.layer, event.module_type) == ("forward", "2", "Fault")
    assert event.input_nonfinite is False and event.output_nonfinite is True
    assert event.micro_batch == 0 and event.rank == 0
    assert (event.nan_count, event.inf_count, event.numel) == (1, 0, 5 * 16)
    assert event.first_index == (0, 3) and math.isnan(event.first_value)
    assert isinstance(err, RuntimeError)
    assert str(err).startswith("non-finite output in 2 (Fault) at step 3, rank 0, micro-batch 0: 1 NaN of 80")
    assert_same_state(model, optimizer, saved)
    assert guard.events[-1] == event


def test_bad_input_batch_is_told_apart(mlp):
    model, optimizer, guard = mlp
    x = torch.randn(5, 8)
    x[2, 1] = math.nan
    with pytest.raises(nanguard.NonFiniteError) as info:
        train_step(model, optimizer, guard, x=x)
    event = info.value.event
    assert event.kind == "forward" and event.input_nonfinite is True and event.layer == "0"
    assert "input batch" in event.message and event.first_index == (2, 1)


class Between(nn.Module):
    """Its own forward code (not a submodule) makes the NaN: a log of a negative number."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.armed = False

    def forward(self, x):
        h = self.a(x)
        if self.armed:
            h = torch.log(h - 1e3)
        return self.b(h)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states, gate):
        return self.proj(hidden_states) * gate


class ByKeyword(nn.Module):
    """Passes what its own code computed to a child by keyword, as transformers' layers call
    their attention (``self.self_attn(hidden_states=..., attention_mask=...)``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.gated = Gated()
        self.armed = False

    def forward(self, x):
        h = self.a(x)
        gate = torch.log(h.detach().abs() - 1e3) if self.armed else torch.sigmoid(h.detach())
        return self.gated(hidden_states=h, gate=gate)


@pytest.mark.parametrize("parent,child", [(Between, "b"), (ByKeyword, "gated")], ids=["positional", "keyword"])
def test_value_born_between_modules_blames_the_parent_code(parent, child):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), parent())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        train_step(model, optimizer, guard)
        model[1].armed = True
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(model, optimizer, guard)
    event = info.value.event
    assert (event.layer, event.input_nonfinite, event.output_nonfinite) == (f"1.{child}", True, True)
    assert "forward code of 1" in event.message


def test_nan_only_in_the_loss_with_check(mlp):
    model, optimizer, guard = mlp
    loss = model(torch.randn(5, 8)).sum() * math.inf * 0
    guard.check(loss)
    loss.backward()
    with pytest.raises(nanguard.NonFiniteError) as info:
        optimizer.step()
    assert (info.value.event.kind, info.value.event.layer) == ("loss", "loss")


def test_nan_only_in_the_loss_without_check(mlp):
    model, optimizer, guard = mlp
    out = model(torch.randn(5, 8))
    loss = torch.sqrt(out - 1e3).mean()  # sqrt of negative numbers: NaN born in the loss
    loss.backward()
    with pytest.raises(nanguard.NonFiniteError) as info:
        optimizer.step()
    event = info.value.event
    # the gradient that reached the model's output (kept: 5 x 4) was non-finite: the loss made it, for certain
    assert event.kind == "loss" and "output in micro-batch(es) 0 was already non-finite" in event.message


def test_nan_only_in_the_loss_with_no_detail_kept_says_what_it_cannot_tell_apart():
    # detail_mb=0: the gradient that reached the output is not kept, so the loss and the last module's own
    # backward are both left open, and the report says so rather than pick one
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, detail_mb=0):
        torch.sqrt(model(torch.randn(5, 8)) - 1e3).mean().backward()
        with pytest.raises(nanguard.NonFiniteError) as info:
            optimizer.step()
    event = info.value.event
    assert event.kind == "loss" and "either the gradient entering the model's backward pass" in event.message


class NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan


class GradFault(nn.Module):
    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return NanBackward.apply(x) if self.armed else x


def test_nan_born_in_backward_names_first_parameter_in_backward_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), GradFault(), nn.Linear(8, 4))
    optimizer = torch.optim.Adam(model.parameters())
    with nanguard.init(model, optimizer) as guard:
        train_step(model, optimizer, guard)
        saved = snapshot(model, optimizer)
        model[1].armed = True
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(model, optimizer, guard)
    event = info.value.event
    assert (event.kind, event.layer, event.step) == ("grad", "0.weight", 1)
    assert event.nan_count == 64 and event.extra["bad_params"] == ["0.weight", "0.bias"]
    assert_same_state(model, optimizer, saved)


@pytest.mark.parametrize("kind", ["sparse", "create_graph"])
def test_unusual_gradients_are_checked_too(kind):
    """A sparse embedding's gradient (SGD takes it as it is) and gradients that carry their own
    graph (backward(create_graph=True), as gradient penalties do): clean steps stay clean, and a
    NaN born in their backward names the parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8, sparse=kind == "sparse"), GradFault(), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        for step in range(4):
            model[1].armed = step == 3
            loss = model(torch.tensor([3, 1, 9, 3, 7])).pow(2).mean()
            try:
                loss.backward(create_graph=kind == "create_graph")
                optimizer.step()
            except nanguard.NonFiniteError as err:
                event = err.event
            for param in model.parameters():
                param.grad = None
    assert [e.step for e in guard.events] == [3]
    assert (event.kind, event.layer, event.shape) == ("grad", "0.weight", (10, 8))
    # the rows the batch used, 1, 3, 7 and 9 (all a sparse gradient stores), the first at row 1
    assert event.has_nan and event.nan_count == 4 * 8 and event.first_index == (1, 0)


def test_gradient_accumulation_names_the_micro_batch(mlp):
    model, optimizer, guard = mlp
    for step in range(3):
        for micro in range(4):
            model[2].armed = step == 2 and micro == 3
            loss = nn.functional.cross_entropy(model(torch.randn(5, 8)), torch.randint(0, 4, (5,)))
            (loss / 4).backward()
        model[2].armed = False
        if step < 2:
            optimizer.step()
            optimizer.zero_grad()
    with pytest.raises(nanguard.NonFiniteError) as info:
        optimizer.step()
    assert (info.value.event.step, info.value.event.micro_batch, info.value.event.layer) == (2, 3, "2")


def test_skip_drops_the_update_and_goes_on():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with nanguard.init(model, optimizer, on_nan="skip") as guard:
        for step in range(6):
            model[2].armed = step == 3
            saved = snapshot(model, optimizer)
            train_step(model, optimizer, guard)
            if step == 3:
                assert_same_state(model, optimizer, saved)
        assert guard.skipped_steps == 1 and guard.step == 6
        assert [e.step for e in guard.events] == [3]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_warn_reports_and_lets_the_update_happen(caplog):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="warn") as guard:
        model[2].armed = True
        train_step(model, optimizer, guard)
        assert guard.events[-1].layer == "2"
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    assert "non-finite output in 2 (Fault)" in caplog.text


class Mask(nn.Module):
    def forward(self, x):
        return x.masked_fill(torch.ones_like(x, dtype=torch.bool).triu(1), -math.inf)


def test_skip_types_and_modules_for_intentional_infs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Mask(), nn.Softmax(dim=-1), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, mode="full") as guard:  # (the sentinel probes no module output)
        train_step(model, optimizer, guard)  # the -inf reaches no gradient (the softmax makes 0 of it): no stop
        assert [(e.kind, e.layer) for e in guard.events] == [("forward", "1")]
        assert "reached none of what the update depends on" in guard.events[0].message
    for kw in ({"skip_types": ["Mask"]}, {"skip_modules": ["1"]}, {"skip_types": [Mask]}):
        with nanguard.init(model, optimizer, **kw) as guard:
            for _ in range(3):
                train_step(model, optimizer, guard)
            assert guard.events == []


class Shared(nn.Module):
    """One module called twice per forward; the second call goes bad."""

    def __init__(self):
        super().__init__()
        self.inner = Fault(8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        h = self.inner(x)
        self.inner.armed = self.armed
        h = self.inner(h)
        self.inner.armed = False
        return self.out(h)


def test_module_called_several_times():
    model = Shared()
    model.inner.lin = nn.Linear(8, 8)
    model.armed = False
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        train_step(model, optimizer, guard)
        model.armed = True
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(model, optimizer, guard)
    assert info.value.event.layer == "inner" and info.value.event.input_nonfinite is False


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extras: dict


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.armed = False

    def forward(self, x):
        h = self.lin(x)
        bad = h * math.inf if self.armed else h
        return Output(logits=h, extras={"aux": [torch.tensor(1), (h.detach(), bad)]})


class UsesStructured(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Structured()

    def forward(self, x):
        out = self.block(x)
        return out.logits + out.extras["aux"][1][1]


@pytest.mark.parametrize("armed", [False, True])
def test_nested_dataclass_dict_tuple_outputs(armed):
    model = UsesStructured()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        model.block.armed = armed
        if not armed:
            train_step(model, optimizer, guard)
            return
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(model, optimizer, guard)
    assert info.value.event.layer == "block"


def test_without_optimizer_checks_at_the_end_of_each_forward():
    model = make_mlp()
    with nanguard.init(model) as guard:
        with torch.no_grad():
            model(torch.randn(5, 8))
            model[2].armed = True
            with pytest.raises(nanguard.NonFiniteError) as info:
                model(torch.randn(5, 8))
    assert info.value.event.layer == "2" and guard.step == 0


def test_multihead_attention_is_covered():
    """nn.MultiheadAttention never calls its out_proj module, so the attention module is hooked."""
    torch.manual_seed(0)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0]).mean(1)

    model = Attn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        with torch.no_grad():
            model.attn.out_proj.weight[0, 0] = math.inf
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(model, optimizer, guard, x=torch.randn(5, 3, 8))
    event = info.value.event
    assert (event.layer, event.module_type) == ("attn", "MultiheadAttention")
    assert "out_proj.weight" in event.message


def test_on_stop_is_called_before_the_raise(mlp):
    model, optimizer, _ = mlp
    _.close()
    seen = []
    with nanguard.init(model, optimizer, on_stop=seen.append) as guard:
        model[2].armed = True
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(model, optimizer, guard)
    assert seen == [info.value]


def test_events_stay_bounded_when_everything_is_nan():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.init(model, optimizer, on_nan="warn", max_events=5) as guard:
        model[2].armed = True
        for _ in range(50):
            train_step(model, optimizer, guard)
            assert guard._detector.pending == 0
        assert len(guard.events) == 5


@pytest.mark.modes("sentinel", "full")
def test_many_forwards_without_a_step_stay_bounded(guard_mode):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, max_pending=64) as guard:
        with torch.no_grad():
            for _ in range(200):
                model(torch.randn(5, 8))
                assert guard._detector.pending < 64 + 8
            model[2].armed = True
            model(torch.randn(5, 8))
            model[2].armed = False
            for _ in range(100):
                model(torch.randn(5, 8))
        # forwards with autograd off before a step are an evaluation: reported, not a training stop
        train_step(model, optimizer, guard)
        (event,) = guard.events
        # (an evaluation stops nothing: the sentinel, which holds no evaluation's batch, names its output)
        assert event.layer == ("2" if guard_mode == "full" else "")
        assert "autograd off before any optimizer step (an evaluation" in event.message
        assert guard.step == 1 and guard.incident is None


class Huge(nn.Module):
    """Large but finite activations: a float32 sum of them overflows, the values do not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x) * 1e-3 + 3e37


class Shrink(nn.Module):
    def forward(self, x):
        return (x - 3e37) * 1e3


def test_no_false_alarm_on_huge_finite_activations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), Huge(), Shrink(), nn.LayerNorm(64), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.init(model, optimizer) as guard:
        for _ in range(200):
            train_step(model, optimizer, guard, x=torch.randn(32, 64) * 1e3,
                       y=torch.randint(0, 4, (32,)))
        assert guard.events == []


def test_no_false_alarm_under_bf16_autocast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.LayerNorm(256),
                          nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer) as guard:
        for _ in range(300):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(torch.randn(16, 64) * 100),
                                                   torch.randint(0, 4, (16,)))
            guard.check(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert guard.events == [] and guard.step == 300


def test_grad_scaler_overflow_steps_do_not_stop():
    """fp16 autocast with a GradScaler whose scale starts far too high: the fp16 gradients
    overflow, the scaler skips those steps and lowers its scale; nanguard must not stop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=1000)
    with nanguard.init(model, optimizer) as guard:
        for _ in range(30):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(16, 8))
            loss = nn.functional.cross_entropy(out.float(), torch.randint(0, 4, (16,)))
            guard.check(loss)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert guard.events == []
        assert 0 < guard.step < 30  # the scaler skipped the overflowing steps itself
    assert scaler.get_scale() < 2.0**30


def test_grad_norm_threshold_and_spike_warn_without_stopping():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.init(model, optimizer, grad_norm_warn=50.0, spike_warmup_steps=5,
                       param_grad_norms=True) as guard:
        for step in range(12):
            scale = 1e4 if step == 10 else 1.0
            loss = model(torch.randn(4, 8)).pow(2).mean() * scale
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        kinds = [(e.kind, e.step) for e in guard.events]
        assert ("grad_norm", 10) in kinds and ("spike", 10) in kinds
        assert len(kinds) == 2 and guard.step == 12
        assert set(guard.last_param_grad_norms) == {"0.weight", "0.bias", "1.weight", "1.bias"}
        spike = next(e for e in guard.events if e.kind == "spike")
        assert spike.grad_norm > 50 and spike.extra["top_params"]


def test_ddp_world_of_one_strips_the_wrapper_name(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(make_mlp())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with nanguard.init(model, optimizer) as guard:
            train_step(model, optimizer, guard)
            assert len(guard._detector.log.buckets) == 0  # read and reset with the step
            calls = []

            def user_hook(state, bucket):  # a team's own comm hook, registered after init
                calls.append(state)
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut

            model.register_comm_hook("mine", user_hook)
            train_step(model, optimizer, guard)
            assert calls and set(calls) == {"mine"}
            model.module[2].armed = True
            with pytest.raises(nanguard.NonFiniteError) as info:
                train_step(model, optimizer, guard)
        assert info.value.event.layer == "2"
    finally:
        dist.destroy_process_group()


def test_two_optimizers_count_one_step_per_iteration():
    torch.manual_seed(0)
    model = make_mlp()
    body = torch.optim.SGD(list(model[:3].parameters()), lr=0.1)
    head = torch.optim.Adam(model[4].parameters())
    with nanguard.init(model, [body, head]) as guard:
        for step in range(4):
            model[2].armed = step == 3
            loss = nn.functional.cross_entropy(model(torch.randn(5, 8)), torch.randint(0, 4, (5,)))
            loss.backward()
            try:
                body.step()
                head.step()
            except nanguard.NonFiniteError as err:
                assert (step, err.event.step, err.event.layer) == (3, 3, "2")
            body.zero_grad()
            head.zero_grad()
        assert guard.step == 4


def test_raise_captures_the_state_from_before_the_step(incidents_in_tmp):
    from nanguard import incident as capture
    from nanguard.incident import inspection as inspect

    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    with nanguard.init(model, optimizer, scheduler=scheduler) as guard:
        for step in range(3):
            train_step(model, optimizer, guard)
            scheduler.step()
        torch.manual_seed(1234)
        x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
        expected_noise = torch.rand(3)  # what the step's first random draw would be
        torch.manual_seed(1234)
        x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))  # drawn before the step begins
        model[2].armed = True
        saved = snapshot(model, optimizer)
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(model, optimizer, guard, x=x, y=y)
    err = info.value
    assert err.incident is not None and err.incident == guard.incident
    assert err.incident.startswith(str(incidents_in_tmp))
    incident = capture.read_incident(err.incident)
    assert incident.step == 3 and incident.world_size == 1
    assert incident.first_event.layer == "2"
    state = incident.rank_state(0)
    for name, value in saved[0].items():
        assert torch.equal(state["model"][name], value)
    assert state["optimizer"]["state"].keys() == optimizer.state_dict()["state"].keys()
    assert state["extra"]["scheduler"]["last_epoch"] == 3
    (batch,) = incident.rank_batches(0)
    assert torch.equal(batch["args"][0], x)
    capture.rng_restore(incident.rank_rng(0))
    assert torch.equal(torch.rand(3), expected_noise)
    report = inspect.as_json(incident)
    assert report["first_event"]["layer"] == "2" and report["replay"] is None


def test_a_batch_refilled_in_place_is_not_captured_as_the_one_fed(incidents_in_tmp):
    # accumulation from one static input buffer: by the capture, micro-batch 0's tensor holds
    # micro-batch 1's data; written as it is now, a replay would feed the wrong data as the step's
    from nanguard import incident as capture
    from nanguard.incident.batches import Missing
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer = torch.empty(5, 8)
    with nanguard.init(model, optimizer):
        with pytest.raises(nanguard.NonFiniteError) as info:
            for k in range(2):
                buffer.copy_(torch.randn(5, 8))
                model[2].armed = k == 1
                model(buffer).sum().backward()
            optimizer.step()
    notes = []
    first, second = capture.read_incident(info.value.incident).rank_batches(0, notes)
    assert type(first["args"][0]) is Missing and torch.equal(second["args"][0], buffer)
    assert len(notes) == 1 and "changed in place after its forward" in notes[0]
    assert "float32 of shape [5, 8]" in notes[0]


def test_a_static_input_buffer_is_captured_as_fed_after_the_first_step(incidents_in_tmp):
    # the loop of a CUDA graph or a pinned prefetch buffer: one tensor refilled for every
    # micro-batch of every step; once a step found it refilled, it is copied as each forward begins
    from nanguard import incident as capture

    class Tagged(nn.Module):  # an input buffer and an integer one, given by keyword
        def __init__(self):
            super().__init__()
            self.body = make_mlp()

        def forward(self, x, ids):
            return self.body(x) + ids.unsqueeze(1)

    model = Tagged()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer, ids = torch.empty(5, 8), torch.zeros(5, dtype=torch.long)
    fed = []
    with nanguard.init(model, optimizer):
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(3):
                fed.clear()
                for k in range(2):
                    buffer.copy_(torch.randn(5, 8))
                    ids.fill_(10 * step + k)
                    fed.append((buffer.clone(), ids.clone()))
                    model.body[2].armed = (step, k) == (2, 0)
                    model(buffer, ids=ids).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert info.value.event.step == 2 and info.value.event.micro_batch == 0
    notes = []
    batches = capture.read_incident(info.value.incident).rank_batches(0, notes)
    assert notes == []
    assert [(torch.equal(b["args"][0], x), torch.equal(b["kwargs"]["ids"], i)) for b, (x, i) in zip(batches, fed)] \
        == [(True, True), (True, True)]


def test_an_input_the_model_changes_in_place_is_captured_as_fed(incidents_in_tmp):
    # a forward that normalises its input in place: the batch held by reference would be
    # written normalised, and a replay would normalise it twice
    from nanguard import incident as capture

    class Normalising(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = make_mlp()

        def forward(self, x):
            return self.body(x.sub_(x.mean()))

    model = Normalising()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer):
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(3):
                x = torch.randn(5, 8) + 3
                fed = x.clone()
                model.body[2].armed = step == 2
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    notes = []
    (batch,) = capture.read_incident(info.value.incident).rank_batches(0, notes)
    assert notes == [] and torch.equal(batch["args"][0], fed)


def test_capture_can_be_turned_off_and_batches_left_out(incidents_in_tmp):
    from nanguard import incident as capture

    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for settings, expect in (({"capture": False}, None), ({"capture_batch": False}, "no batch")):
        with nanguard.init(model, optimizer, **settings) as guard:
            model[2].armed = True
            with pytest.raises(nanguard.NonFiniteError) as info:
                train_step(model, optimizer, guard)
            model[2].armed = False
        if expect is None:
            assert info.value.incident is None
        else:
            assert capture.read_incident(info.value.incident).rank_batches(0) is None


@pytest.mark.modes("sentinel", "full")
def test_grad_scaler_given_to_init_still_skips_overflows_and_a_forward_nan_in_a_skipped_step_stops_nothing(guard_mode):
    """A step the scaler skips never reaches optimizer.step(): with scaler= given, its update()
    decides that step, and since no update happens, nothing stops it (What stops a step). The full
    mode, which probes every module, reports the NaN's producer as a warning."""
    torch.manual_seed(0)
    fault = Fault(32)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), fault, nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=1000)
    with nanguard.init(model, optimizer, scaler=scaler) as guard:
        for step in range(40):
            fault.armed = step == 35
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(16, 8))
            loss = nn.functional.cross_entropy(out.float(), torch.randint(0, 4, (16,)))
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if step == 35:
                assert scaler.get_scale() < scale  # the scaler skipped it
        assert guard.step == 40 and guard.skipped_steps == 0
        expected = [("forward", 35, "2")] if guard_mode == "full" else []
        assert [(e.kind, e.step, e.layer) for e in guard.events if e.step == 35] == expected
    assert "update" not in vars(scaler)  # close() gave the scaler its own update() back


@pytest.mark.modes("sentinel", "full")
@pytest.mark.parametrize("two_optimizers", [False, True])
def test_steps_a_grad_scaler_skips_are_counted_as_the_loop_counts_them(two_optimizers, guard_mode):
    """A scale far too high makes the scaler skip the first steps (no optimizer.step() runs); they
    are steps all the same: an event carries the loop's iteration, an incident folder its number."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizers = [torch.optim.SGD(model[0].parameters(), lr=0.01)] + (
        [torch.optim.SGD(model[2].parameters(), lr=0.01)] if two_optimizers else [])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1000)
    with nanguard.init(model, optimizers if two_optimizers else optimizers[0], scaler=scaler,
                       on_nan="warn") as guard:
        taken = 0
        for step in range(30):
            x = torch.randn(16, 8)
            if step in (3, 25):
                x[0, 0] = math.nan
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), torch.randint(0, 4, (16,)))
            scaler.scale(loss).backward()
            for optimizer in optimizers:
                scaler.step(optimizer)
            scale = scaler.get_scale()
            scaler.update()
            taken += scaler.get_scale() >= scale  # (a skipped step halves the scale)
            for optimizer in optimizers:
                optimizer.zero_grad()
            assert guard.step == step + 1
        # (the scaler skipped the NaN batches' steps: a warning where the full mode probed them)
        expected = [(3, "forward", "0"), (25, "forward", "0")] if guard_mode == "full" else []
        assert [(e.step, e.kind, e.layer) for e in guard.events] == expected
    assert 0 < taken < 25  # the scaler skipped the first steps, and stepped later ones


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.1),
    lambda params: torch.optim.LBFGS(params, max_iter=3),  # calls the closure several times a step
], ids=["sgd", "lbfgs"])
def test_step_with_a_closure_is_decided_after_the_closure(make_optimizer):
    """optimizer.step(closure) runs forward and backward after the step pre-hook (Lightning's
    automatic optimization does this): the decision must wait for the closure."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = make_optimizer(model.parameters())
    with nanguard.init(model, optimizer) as guard:
        with pytest.raises(nanguard.NonFiniteError) as info:
            for step in range(6):
                x = torch.randn(6, 4)
                if step == 3:
                    x[0, 0] = float("nan")

                def closure():
                    optimizer.zero_grad()
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    return loss

                saved = copy.deepcopy(model.state_dict())
                optimizer.step(closure)
        assert step == 3 and info.value.event.step == 3 and guard.step == 4
        for name, value in model.state_dict().items():
            assert torch.equal(value, saved[name]), f"{name} was updated by the bad step"


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
@pytest.mark.parametrize("on_nan", ["raise", "skip"])
def test_a_closure_that_goes_bad_in_a_later_call_leaves_the_step_as_it_began(on_nan, line_search, tmp_path):
    # LBFGS updates the weights between the calls of its closure: a NaN in the second call comes
    # after an update of the very step that is not taken; it, and the optimizer's state, go back.
    # Skipped inside a strong-Wolfe line search, the search goes on from finite values (a NaN loss
    # broke it: IndexError) and the step ends as it began
    from nanguard.incident import read_incident

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, line_search_fn=line_search)
    with nanguard.init(model, optimizer, on_nan=on_nan, dir=str(tmp_path), capture=True) as guard:
        with contextlib.suppress(nanguard.NonFiniteError):
            for step in range(6):
                x, calls = torch.randn(6, 4), []

                def closure():
                    optimizer.zero_grad()
                    calls.append(1)
                    out = model(x)
                    loss = (out * (math.nan if step == 3 and len(calls) == 2 else 1.0)).pow(2).mean()
                    loss.backward()
                    return loss

                weights = copy.deepcopy(model.state_dict())
                state = copy.deepcopy(optimizer.state_dict())
                optimizer.step(closure)
                if step == 3:
                    break
        assert step == 3 and len(calls) >= 2 and {e.step for e in guard.events} == {3}
        for name, value in model.state_dict().items():
            assert torch.equal(value, weights[name]), f"{name} kept an update of the bad step"
        now = optimizer.state_dict()["state"]
        assert now.keys() == state["state"].keys()


        def same(a, b):
            if isinstance(a, list):
                return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
            return a is b is None or (a is not None and b is not None and torch.equal(torch.as_tensor(a),
                                                                                       torch.as_tensor(b)))

        assert all(same(now[0][key], value) for key, value in state["state"][0].items()), (now, state)
        saved = read_incident(guard.incident).rank_state(0)["model"]
        assert all(torch.equal(saved[name], value) for name, value in weights.items())


def test_a_grad_scaler_that_skips_every_step_for_a_backward_nan_is_warned_of_once():
    """A NaN born in the backward pass of every step: the scaler skips each one and halves its
    scale, for ever, and no update happens. That is not an overflow once the scale is below 1:
    one warning (a grad_norm event, which stops nothing) names the gradients, and training goes on
    as the scaler decides."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    before = copy.deepcopy(model.state_dict())
    with nanguard.init(model, optimizer, scaler=scaler) as guard:
        for step in range(12):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(16, 8))
            loss = nn.functional.cross_entropy(NanBackward.apply(out.float()), torch.randint(0, 4, (16,)))
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        (event,) = guard.events
    # skipped with scales 16, 8, 4, 2, 1 (halved to 0.5 after the fifth): told then, once
    assert (event.kind, event.step, event.layer) == ("grad_norm", 4, "0.weight"), event
    assert "the GradScaler skipped 5 optimizer steps in a row, and its scale is now 0.5" in event.message
    assert "4 of 4 parameter gradients were non-finite as the last backward pass left them (NaN)" in event.message
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())  # no update ran
