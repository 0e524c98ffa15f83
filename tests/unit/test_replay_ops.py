"""Replay, item 1: the ATen operation that made the first non-finite value, the user's line that
called it, the module it ran in and its inputs' ranges, forward and backward."""

from __future__ import annotations

import math

import torch
from torch import nn

from nanguard.incident.inspection import summary
from nanguard.incident import read_incident
from nanguard.replay.ops import OpWatch
from replay_script import line_of, replay, run

HERE = __file__


def labelled(step: int, n: int = 6):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen)


class LogFeatures(nn.Module):
    """log of a linear map: NaN wherever the map goes negative."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return torch.log(h)  # the bad line


def test_log_of_a_negative_number_in_a_custom_forward(monkeypatch, capsys):
    def model():
        return nn.Sequential(nn.Linear(8, 16), LogFeatures(), nn.Linear(16, 4))

    err = run(model, labelled)
    assert err is not None and err.event.layer == "1"
    report = replay(monkeypatch, err.incident, model, labelled)
    assert report["verdict"] == "reproducible"
    op = report["operations"]["0"]["forward"][0]
    assert op["op"] == "aten::log" and op["phase"] == "forward"
    assert op["module"] == "1" and op["module_type"] == "LogFeatures" and op["micro_batch"] == 0
    assert op["source"]["file"] == HERE
    assert op["source"]["line"] == line_of(LogFeatures.forward, "the bad line")
    assert op["source"]["code"] == "return torch.log(h)  # the bad line"
    assert op["inputs"][0]["name"] == "self" and op["inputs"][0]["min"] < 0
    assert op["why"].startswith(f"input min {op['inputs'][0]['min']:.4g}")
    assert op["output"]["nan_count"] == op["inputs"][0]["negatives"]
    # the module-level trace stays
    assert report["trace"]["0"]["forward"][0]["module"] == "1"
    out = capsys.readouterr().out
    assert "operation: rank 0 forward: aten::log in module 1 (LogFeatures)" in out
    assert f"{HERE}:{op['source']['line']} in forward: return torch.log(h)" in out
    text = summary(read_incident(err.incident))
    assert "operation    rank 0 forward: aten::log in module 1 (LogFeatures), micro-batch 0" in text


class Bucketed(nn.Module):
    """T5's relative-position bucket: a log of every distance, whose zeros give -inf that the code
    discards (harmless, and made before anything bad)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        distance = torch.arange(x.shape[1], dtype=x.dtype).abs()
        scale = torch.where(distance > 0, torch.log(distance), torch.zeros_like(distance))
        return self.lin(x) + 0.0 * scale


def test_harmless_infinities_made_before_the_nan_do_not_hide_or_lead_it(monkeypatch, capsys):
    # more harmless -inf makers than the operations kept per kind, then the NaN's maker
    def model():
        return nn.Sequential(nn.Linear(8, 16), *(Bucketed() for _ in range(6)), LogFeatures(), nn.Linear(16, 4))

    err = run(model, labelled)
    assert err is not None and err.event.layer == "7"
    report = replay(monkeypatch, err.incident, model, labelled)
    ops = report["operations"]["0"]["forward"]
    assert [op["module"] for op in ops if op["output"]["nan_count"]] == ["7"], ops
    assert sum(not op["output"]["nan_count"] for op in ops) == 4  # the infinities kept: no more than the limit
    assert "operation: rank 0 forward: aten::log in module 7 (LogFeatures)" in capsys.readouterr().out


class MaskedMean(nn.Module):
    """Mean over the samples a mask selects: 0/0 when the batch selects none."""

    def forward(self, h, mask):
        count = mask.sum()
        return (h * mask[:, None]).sum(0, keepdim=True) / count  # the division


class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.pool = MaskedMean()
        self.head = nn.Linear(16, 4)

    def forward(self, batch):
        return self.head(self.pool(self.embed(batch["x"]), batch["mask"])).expand(len(batch["x"]), 4)


def masked(step: int):
    x, y = labelled(step)
    mask = (x[:, 0] > 0).long() if step != 2 else torch.zeros(6, dtype=torch.long)  # none selected
    return {"x": x, "mask": mask}, y


def test_division_by_a_zero_count_computed_from_the_batch(monkeypatch):
    err = run(Pooled, masked)
    assert err is not None and err.event.step == 2 and err.event.layer == "pool"
    report = replay(monkeypatch, err.incident, Pooled, masked)
    assert report["verdict"] == "reproducible"
    op = report["operations"]["0"]["forward"][0]
    assert op["op"] == "aten::div.Tensor" and op["module"] == "pool" and op["module_type"] == "MaskedMean"
    assert op["source"]["line"] == line_of(MaskedMean.forward, "the division")
    divisor = next(i for i in op["inputs"] if i["name"] == "other")
    assert divisor["dtype"] == "int64" and divisor["zeros"] == 1 and divisor["shape"] == []
    assert op["why"] == "divisor (other) has 1 zero"


class NaiveSoftmax(nn.Module):
    """softmax written out: exp overflows float32 above 88.7, and inf / inf is NaN."""

    def __init__(self):
        super().__init__()
        self.scores = nn.Linear(16, 16)

    def forward(self, x):
        e = torch.exp(self.scores(x) * 200.0)  # the overflow
        return e / e.sum(-1, keepdim=True)


def test_overflow_in_a_softmax(monkeypatch):
    def model():
        return nn.Sequential(nn.Linear(8, 16), NaiveSoftmax(), nn.Linear(16, 4))

    err = run(model, labelled)
    assert err is not None and err.event.layer == "1"
    report = replay(monkeypatch, err.incident, model, labelled)
    first = report["operations"]["0"]["forward"][0]
    assert first["op"] == "aten::exp" and first["module"] == "1"
    assert first["source"]["line"] == line_of(NaiveSoftmax.forward, "the overflow")
    assert first["output"]["inf_count"] > 0 and first["output"]["nan_count"] == 0
    assert first["inputs"][0]["max"] > 88.7
    assert "exp overflows float32 above 88.72" in first["why"]
    # inf / inf = NaN: the division met a non-finite input, so it is not where the value was made
    assert all(op["op"] != "aten::div.Tensor" for op in report["operations"]["0"]["forward"])


class HalfSqrt(torch.autograd.Function):
    """sqrt of the positive part; its backward divides by the output: inf where that is 0."""

    @staticmethod
    def forward(ctx, x):
        y = x.clamp(min=0).sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad / (2 * y)  # born in backward


class Rooted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return HalfSqrt.apply(self.lin(x))  # made in forward


def test_nan_born_in_a_custom_autograd_backward(monkeypatch, capsys):
    def model():
        return nn.Sequential(nn.Linear(8, 16), Rooted(), nn.Linear(16, 4))

    err = run(model, labelled)
    assert err is not None and err.event.kind in ("backward", "grad")
    report = replay(monkeypatch, err.incident, model, labelled)
    assert report["verdict"] == "reproducible"
    ops = report["operations"]["0"]
    assert ops["forward"] == []  # the forward made nothing non-finite
    op = ops["backward"][0]
    assert op["op"] == "aten::div.Tensor" and op["phase"] == "backward"
    assert op["node"] == "HalfSqrtBackward" and op["custom_backward"] is True
    assert op["module"] == "1" and op["module_type"] == "Rooted"
    assert op["source"]["line"] == line_of(HalfSqrt.backward, "born in backward")
    assert op["forward_source"]["line"] == line_of(Rooted.forward, "made in forward")
    assert op["why"].startswith("divisor (other) has ")
    # the sample search saw it in backward too, and says with what: not the script's loss
    entry = report["samples"]["0"]["micro_batches"][0]
    assert entry["outcome"] == "backward" and "not the script's loss" in entry["checked"]
    out = capsys.readouterr().out
    assert "backward node HalfSqrtBackward (custom backward at" in out
    assert "made in the forward at" in out


def test_a_built_in_backward_names_its_node_and_the_forward_line():
    watch = OpWatch(lambda name: 0)
    model = nn.Sequential(nn.Linear(4, 4), Sqrtish())
    handles = watch.install(model, set())
    watch.start()
    try:
        x = torch.full((3, 4), 1.0)
        model[0].weight.data.zero_()
        model[0].bias.data.zero_()  # sqrt(0) = 0 is fine forward; its gradient 1/(2 sqrt(0)) is inf
        model(x).sum().backward()
    finally:
        assert watch.stop() == []
        for handle in handles:
            handle.remove()
    (op,) = watch.result()["backward"][:1]
    assert op["node"] == "SqrtBackward0" and op["custom_backward"] is False and op["source"] is None
    assert op["backward_call"]["code"] == "model(x).sum().backward()"
    assert op["forward_source"]["line"] == line_of(Sqrtish.forward, "sqrt here")
    assert op["module"] == "1" and op["module_type"] == "Sqrtish"
    assert not torch.is_anomaly_enabled()  # anomaly mode was on for the step only


class Sqrtish(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)  # sqrt here


def test_what_the_operation_check_never_blames():
    """Non-finite inputs (a -inf mask), in-place updates of a finite tensor, nanguard's own
    bookkeeping, uninitialised memory and modules the settings skip are not where a value was made."""
    watch = OpWatch(lambda name: 0)
    masked = nn.Sequential(Masker())
    handles = watch.install(masked, {"0"})
    watch.start()
    try:
        scores = torch.randn(2, 3)
        scores.masked_fill(torch.tensor([[True, False, False]] * 2), -math.inf)  # a -inf scalar: not finite
        scores.clone().masked_fill_(scores > 0, -math.inf)  # written in place, an infinity: a mask
        torch.where(scores > 0, torch.tensor(math.nan), scores)  # a NaN number, but not written in place
        masked(scores)  # a skipped module may make -inf on purpose
        huge = torch.full((4,), 3e38)
        from nanguard.rank.backward import probe

        probe(huge)  # nanguard's own sum overflows: not the user's
        for _ in range(20):  # uninitialised memory (overloads too: empty.memory_format) is not a fault,
            torch.full((64,), math.nan)  # whatever it held: the NaN of this tensor, freed at once, often
            torch.empty(64), torch.empty_like(huge), huge.new_empty(8)
        y = torch.full((2,), -1.0)
        y.log_()  # in place: its input was finite before it ran
    finally:
        watch.stop()
        for handle in handles:
            handle.remove()
    (op,) = watch.result()["forward"]
    assert op["op"] == "aten::log_" and op["inputs"][0]["min"] == -1.0 and op["module"] is None
    assert op["source"]["code"] == "y.log_()  # in place: its input was finite before it ran"


class Masker(nn.Module):
    def forward(self, x):
        return torch.log(x - x)  # -inf on purpose (skip_modules)


class WritesNaN(torch.autograd.Function):
    """A custom backward that writes a NaN literal into the gradient it passes on."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")  # the NaN written
        return grad


class WritingNaN(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return WritesNaN.apply(self.lin(x))


def test_a_nan_number_written_in_place_is_where_the_nan_was_made(monkeypatch):
    # the loss or this custom backward: the report hedges, the replay tells which (a NaN number
    # handed to torch.full, a placeholder, is not blamed: see test_what_the_operation_check_never_blames)
    def model():
        return nn.Sequential(nn.Linear(8, 16), WritingNaN(), nn.Linear(16, 4))

    err = run(model, labelled)
    assert err is not None
    report = replay(monkeypatch, err.incident, model, labelled)
    op = report["operations"]["0"]["backward"][0]
    assert op["op"] == "aten::copy_" and op["node"] == "WritesNaNBackward" and op["custom_backward"]
    assert op["source"]["line"] == line_of(WritesNaN.backward, "the NaN written")
    assert op["why"] == "src is NaN, a number the code gave it to write"
