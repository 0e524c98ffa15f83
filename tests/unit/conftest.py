import pytest
import torch
from torch import nn

import nanguard


class Fault(nn.Module):
    """Passes its input on; when ``armed``, writes a NaN (or ``value``) into its output, and from then
    on into the output of any call fed the same input again: a fault of the data, which a re-run of
    the step (nanguard's microscope, a replay) makes again, as a real one would."""

    def __init__(self, width: int = 16, value: float = float("nan"), index=(0, 3)):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.armed = False
        self.value = value
        self.index = index
        self.poisoned = set()

    def forward(self, x):
        y = self.lin(x)
        if torch.compiler.is_compiling():  # (no host read inside a graph: armed alone)
            poisoned = self.armed
        else:
            fingerprint = (tuple(x.shape), x.detach().double().sum().item())
            if self.armed:
                self.poisoned.add(fingerprint)
            poisoned = fingerprint in self.poisoned
        if poisoned:
            y = y.clone()
            y[self.index] = self.value
        return y


def make_mlp(width: int = 16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), Fault(width), nn.ReLU(), nn.Linear(width, 4))


@pytest.fixture(autouse=True)
def incidents_in_tmp(tmp_path, monkeypatch):
    """Incidents of every test go to its own temporary folder, never into the checkout."""
    monkeypatch.setenv("NANGUARD_DIR", str(tmp_path / "incidents"))
    return tmp_path / "incidents"


@pytest.fixture
def gloo(tmp_path):
    """A one-rank gloo process group in this process (file store): the same collectives and worker
    threads as a torchrun rank's."""
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


@pytest.fixture
def mlp():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = nanguard.init(model, optimizer)
    yield model, optimizer, guard
    guard.close()


def train_step(model, optimizer, guard=None, x=None, y=None):
    x = torch.randn(5, 8) if x is None else x
    y = torch.randint(0, 4, (5,)) if y is None else y
    loss = nn.functional.cross_entropy(model(x), y)
    if guard is not None:
        guard.check(loss)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def snapshot(model, optimizer):
    import copy

    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def assert_same_state(model, optimizer, saved):
    weights, opt_state = saved
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), f"{name} changed"
    assert repr(optimizer.state_dict()) == repr(opt_state)
