"""nanguard._tree: one walker, so that what is checked is what is captured."""

from __future__ import annotations

import collections
import dataclasses
from collections import UserDict

import torch
from torch import nn

import nanguard
from nanguard._tree import MAX_DEPTH, floating_tensors, map_tensors


class Encoding(UserDict):
    """Shaped like Hugging Face's BatchEncoding: a UserDict, not a dict."""


@dataclasses.dataclass(frozen=True)
class Output:
    logits: torch.Tensor
    extra: tuple


Pair = collections.namedtuple("Pair", "a b")


def nest():
    a, b, c, d = (torch.full((2,), float(i)) for i in range(4))
    return (Pair(a, [b, "text", 3]), Encoding(x=c, ids=torch.arange(3)),
            collections.OrderedDict(y=Output(d, (a, None))))


def test_the_walker_and_the_copier_see_the_same_tensors_in_the_same_order():
    obj = nest()
    seen = floating_tensors(obj)
    assert [float(t[0]) for t in seen] == [0.0, 1.0, 2.0, 3.0, 0.0]  # integer ids are not floating
    mapped = []
    copy = map_tensors(obj, lambda t: mapped.append(t) or t.clone())
    assert [t for t in mapped if t.is_floating_point()] == [seen[0], seen[1], seen[2], seen[3]]
    assert type(copy[0]) is Pair and type(copy[1]) is Encoding and type(copy[2]) is collections.OrderedDict
    assert type(copy[2]["y"]) is Output and copy[2]["y"].extra[0] is copy[0].a  # aliasing kept
    assert copy[0].b[1:] == ["text", 3] and copy[1]["x"] is not obj[1]["x"]


def test_nesting_deeper_than_the_limit_is_not_entered():
    deep = torch.ones(1)
    for _ in range(MAX_DEPTH + 2):
        deep = [deep]
    assert floating_tensors(deep) == []
    assert map_tensors(deep, lambda t: t * 2) is not None


def test_a_userdict_batch_passed_positionally_is_checked_as_the_batch():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, batch):
            return self.lin(batch["x"])

    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    with nanguard.init(model, optimizer) as guard:
        try:
            model(Encoding(x=x)).sum().backward()
            optimizer.step()
        except nanguard.NonFiniteError as err:
            event = err.event
        else:
            raise AssertionError("a NaN in the batch did not stop the step")
        assert event.input_nonfinite is True and "input batch" in event.message
        assert guard.step == 1
