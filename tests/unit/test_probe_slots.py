"""Probes write into places made in advance (places.Slots): whatever the step looks like (more
probes than any step before, dtypes mixed, inference mode first), each step's values are its own
and the report names the right module."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nanguard


class Poison(nn.Module):
    """Linear whose output turns NaN at one element while ``armed`` (multiplied in: the NaN reaches the
    gradients, whichever layer it is, and stops the step)."""

    def __init__(self, width: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=dtype)
        self.armed = False

    def forward(self, x):
        out = self.linear(x.to(self.linear.weight.dtype))
        if self.armed:
            poison = torch.ones_like(out)
            poison[0, 0] = float("nan")
            out = out * poison
        return out


def deep(n: int, dtypes=(torch.float32,)) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Poison(8, dtypes[i % len(dtypes)]) for i in range(n)])


def train(model, optimizer, steps=1):
    for _ in range(steps):
        out = model(torch.randn(4, 8))
        loss = out.float().pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def step(model, optimizer):
    """One step on a batch of 8 rows of 4 features."""
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def bad_step(model, optimizer):
    """A step whose ``model.lin`` makes NaN (its bias), then the bias made finite again."""
    model.lin.bias.data.fill_(float("nan"))
    step(model, optimizer)
    with torch.no_grad():
        model.lin.bias.zero_()


@pytest.mark.parametrize("bad", [1, 20, 79])
def test_more_probes_than_any_earlier_step_grow_the_places_and_keep_the_order(bad):
    # 80 modules, two probes each (the Poison and its Linear): past the 64 places made first
    model = deep(80)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):
        train(model, optimizer, steps=2)
        model[bad].armed = True
        with pytest.raises(nanguard.NonFiniteError) as info:
            train(model, optimizer)
    assert info.value.event.layer == f"{bad}" and info.value.event.step == 2


def test_clean_steps_after_a_skipped_bad_one_read_their_own_values():
    model = deep(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer, on_nan="skip") as guard:
        train(model, optimizer)
        model[2].armed = True
        train(model, optimizer)
        model[2].armed = False
        model[3].linear.weight.data.zero_()  # whatever the places held before is overwritten
        train(model, optimizer, steps=3)
        events = [e for e in guard.events if e.kind == "forward"]
    assert [(e.layer, e.step) for e in events] == [("2", 1)]


@pytest.mark.parametrize("bad", [0, 1, 2, 5])
def test_dtypes_mixed_in_one_step_are_read_in_order(bad):
    model = deep(6, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):
        train(model, optimizer)
        model[bad].armed = True
        with pytest.raises(nanguard.NonFiniteError) as info:
            train(model, optimizer)
    assert info.value.event.layer == f"{bad}"


def test_a_first_forward_in_inference_mode_leaves_places_a_training_step_can_write():
    model = deep(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):
        with torch.inference_mode():
            model(torch.randn(4, 8))
        train(model, optimizer)
        model[1].armed = True
        with pytest.raises(nanguard.NonFiniteError) as info:
            train(model, optimizer)
    assert info.value.event.layer == "1"


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.modes("full")  # (the sentinel probes no module: what is asserted here is the full mode's)
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.bfloat16, torch.float64)],
                         ids=["one dtype", "three dtypes"])
def test_a_steady_step_writes_every_probe_into_its_places_and_stacks_none(dtypes):
    # under autocast a step mixes dtypes: each dtype has places of its own, joined by one cat
    model = deep(5, dtypes)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):
        train(model, optimizer, steps=2)
        with Ops() as ops:
            train(model, optimizer)
    reductions = [n for n in ops.names if n.startswith("aten.aminmax")]
    # 5 Poison outputs are their Linears' outputs again: 5 probes, all into places; with three
    # dtypes each Poison but the first converts its input between modules: 4 inputs probed too
    assert reductions == ["aten.aminmax.out"] * (5 if len(dtypes) == 1 else 9)
    joins = [n for n in ops.names if n.startswith(("aten.stack", "aten.cat", "aten.slice"))]
    if len(dtypes) == 1:
        # the gradient norms are written after the probes, in their buffer: the step reads a slice
        # made at an earlier step, and makes no tensor to read them
        assert joins == ["aten.stack.out"]
    else:
        # a cat of each kind's slices (outputs, inputs: made at an earlier step), the norms
        # stacked, and one cat of the pieces
        assert joins == ["aten.stack.default", "aten.cat.default", "aten.cat.default", "aten.cat.default"]


def test_a_mixed_step_puts_each_probe_back_in_order():
    # the flight recorder's loss and the reports read values by probe: bf16, float32 and float64
    # probes interleaved must come back in the order they were made, whatever buffer held them
    from nanguard.rank.places import Slots

    slots, values, expected = Slots(), [], []
    for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.bfloat16, torch.float64, torch.float32] * 3):
        tensor = torch.tensor([-float(i) - 1, float(i) + 1], dtype=dtype)
        values.extend(torch.aminmax(tensor, out=slots.take(tensor)))
        expected += [-float(i) - 1, float(i) + 1]
    assert slots.in_order(slots.vector(values).tolist()) == expected
    slots.clear()
    tensor = torch.tensor([3.0, 4.0])
    values = list(torch.aminmax(tensor, out=slots.take(tensor)))
    assert slots.in_order(slots.vector(values).tolist()) == [3.0, 4.0]  # a new step starts clean


def test_the_norms_read_with_the_probes_keep_their_values_whatever_their_dtype():
    # the gradients' norms go after the probes in their buffer only when of its dtype: a float32
    # norm of 1e5 cast into a float16 buffer would read as inf, a clean step as a bad one
    from nanguard.rank.places import Slots

    slots = Slots()
    tensor = torch.tensor([1.0, 2.0], dtype=torch.float16)
    values = list(torch.aminmax(tensor, out=slots.take(tensor)))
    assert slots.vector(values, [torch.tensor(1e5), torch.tensor(3.0, dtype=torch.float16)]).tolist() == [
        1.0, 2.0, 1e5, 3.0]
    assert slots.vector(values, [torch.tensor(5.0, dtype=torch.float16)]).tolist() == [1.0, 2.0, 5.0]
    # more norms than the buffer has places: it grows, the probes' values kept
    many = [torch.tensor(float(i), dtype=torch.float16) for i in range(100)]
    assert slots.vector(values, many).tolist() == [1.0, 2.0, *map(float, range(100))]
    assert slots.vector(values).tolist() == [1.0, 2.0]
    assert slots.vector([], many[:2]).tolist() == [0.0, 1.0]


def test_a_model_run_under_inference_mode_is_checked_and_named():
    # inference tensors keep no in-place version: nanguard must neither crash on them nor take
    # one as unchanged since it was probed
    model = deep(3)
    with nanguard.init(model):
        with torch.inference_mode():
            model(torch.randn(4, 8))
            model[1].armed = True
            with pytest.raises(nanguard.NonFiniteError) as info:
                model(torch.randn(4, 8))
    assert info.value.event.layer == "1"


def test_a_model_under_torch_func_transforms_runs_and_is_checked_outside_them():
    # per-sample gradients (vmap over grad): the tensors inside hold no value to read, so they
    # are not probed; the same model called normally is still checked
    from torch.func import functional_call, grad, vmap

    model = deep(3)
    with nanguard.init(model):
        params = dict(model.named_parameters())
        per_sample = vmap(grad(lambda p, x: functional_call(model, p, (x[None],)).pow(2).sum()),
                          in_dims=(None, 0))(params, torch.randn(5, 8))
        assert per_sample["0.linear.weight"].shape == (5, 8, 8)
        model[2].armed = True
        with pytest.raises(nanguard.NonFiniteError) as info:
            model(torch.randn(4, 8))
    assert info.value.event.layer == "2"


@pytest.mark.modes("full")  # (the sentinel probes no module: what is asserted here is the full mode's)
def test_steady_steps_copy_the_buffers_into_the_same_places_and_still_put_them_back():
    # BatchNorm's statistics are kept at every step start: written into last step's places (one
    # cat of the float statistics, one stack of the batch counts), not cloned nor copied one by one;
    # they are checked after the forward by one cat and one reduction, not a norm each; a first
    # forward in inference mode leaves copies a training step can write, and a skipped step still
    # gets its buffers back
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    with nanguard.init(model, optimizer, on_nan="skip", capture=False) as guard:
        model.eval()
        with torch.inference_mode():
            model(torch.randn(8, 4))
        model.train()
        step(model, optimizer)
        step(model, optimizer)
        with Ops() as ops:
            step(model, optimizer)
        before = {name: b.clone() for name, b in model.named_buffers()}
        model[2].bias.data.fill_(float("nan"))
        step(model, optimizer)
    names = ops.names
    assert "aten._foreach_copy_.default" not in names and "aten.copy_.default" not in names
    assert names.count("aten._foreach_norm.Scalar") == 1  # the gradients'
    # the batch counts into their places, and the gradients' norms after the probes
    assert names.count("aten.stack.out") == 2 and names.count("aten.aminmax.default") == 1
    assert not any(n.startswith(("aten.clone", "aten._foreach_mul")) for n in names)
    assert guard.skipped_steps == 1
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())


class Ema(nn.Module):
    """Replaces its buffer with a new tensor at every forward, as running averages often do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        out = self.lin(x)
        self.ema = 0.9 * self.ema + 0.1 * out.detach().mean(0)
        return out


def test_a_buffer_replaced_at_every_forward_is_put_back_after_a_skipped_step_and_steps_go_on():
    torch.manual_seed(0)
    model = Ema()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    with nanguard.init(model, optimizer, on_nan="skip", capture=False) as guard:
        for _ in range(3):
            step(model, optimizer)
        kept = model.ema.clone()
        bad_step(model, optimizer)
        assert torch.equal(model.ema, kept) and guard.skipped_steps == 1
        for _ in range(3):
            step(model, optimizer)  # the put-back tensor is the module's own now: later steps keep copies of their own
            assert torch.isfinite(model.ema).all()
        kept = model.ema.clone()
        bad_step(model, optimizer)
    assert torch.equal(model.ema, kept) and guard.skipped_steps == 2


class Shrinking(nn.Module):
    """Resizes and retypes its buffer in place (the same tensor object) at one step: what the
    step began with must still be put back, bit for bit, with its shape and dtype."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("stat", torch.arange(4, dtype=torch.float32) / 3)
        self.change = None

    def forward(self, x):
        out = self.lin(x)
        if self.change == "shrink":
            self.stat.resize_(1)  # a (1,) copy would broadcast silently into a (4,) place
        elif self.change == "retype":
            self.stat.data = self.stat.data.double()  # float32 -> float64, same tensor object
        self.change = None
        with torch.no_grad():
            self.stat.add_(out.mean().double() / 3)  # in float64, more than float32 holds
        return out


@pytest.mark.parametrize("change", ["shrink", "retype"])
@pytest.mark.parametrize("when", ["step before", "bad step"])
def test_a_buffer_resized_or_retyped_in_place_is_put_back_as_it_was(change, when):
    torch.manual_seed(0)
    model = Shrinking()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="skip", capture=False) as guard:
        for _ in range(3):
            step(model, optimizer)
        if when == "step before":
            model.change = change
            step(model, optimizer)  # the buffer changes here: the next step starts from it
        kept = model.stat.clone()
        buffer = model.stat
        model.change = change if when == "bad step" else None
        bad_step(model, optimizer)
        assert guard.skipped_steps == 1
        assert model.stat is buffer
        assert model.stat.dtype == kept.dtype and model.stat.shape == kept.shape
        assert torch.equal(model.stat, kept)
        for _ in range(2):  # steps go on from the buffer put back
            step(model, optimizer)
        assert model.stat.shape == kept.shape and torch.isfinite(model.stat).all()
        assert guard.skipped_steps == 1


class Queue(nn.Module):
    """Keeps a queue of past outputs (MoCo's negatives), written in place by its forward."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("queue", torch.zeros(shape))
        self.register_buffer("at", torch.tensor(0))

    def forward(self, x):
        out = self.lin(x)
        with torch.no_grad():
            self.queue.view(-1, 4)[int(self.at) % 6] = out[0]
            self.at += 1
        return out


@pytest.mark.parametrize("shape", [(6, 4), (24,)], ids=["2-d", "1-d"])
def test_a_buffer_given_new_storage_between_steps_is_kept_as_it_is_then(shape):
    # the same tensor, of the same shape, with new data (a resumed run's queue loaded by `.data =`):
    # the step's copy must be of that data, not of the storage the buffer had before
    torch.manual_seed(0)
    model = Queue(shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, on_nan="skip", capture=False) as guard:
        for _ in range(3):
            step(model, optimizer)
        model.queue.data = torch.randn(shape)
        kept, count = model.queue.clone(), model.at.clone()
        bad_step(model, optimizer)
        assert guard.skipped_steps == 1
        assert torch.equal(model.queue, kept) and torch.equal(model.at, count)
        step(model, optimizer)
        assert not torch.equal(model.queue, kept) and guard.skipped_steps == 1


def test_the_norms_alone_are_written_into_places_of_their_own():
    # a sentinel's clean step reads the gradients' norms alone: into places made once, not a tensor a step
    from nanguard.rank.places import Slots

    slots = Slots()
    norms = [torch.tensor(float(k)) for k in range(5)]
    first, second = slots.vector([], norms), slots.vector([], [n + 1 for n in norms])
    assert second.data_ptr() == first.data_ptr() and second.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    mixed = slots.vector([], [torch.tensor(1.0), torch.tensor(2.0, dtype=torch.float64)])  # (dtypes: stacked)
    assert mixed.tolist() == [1.0, 2.0]
    assert slots.vector([], []) is None
