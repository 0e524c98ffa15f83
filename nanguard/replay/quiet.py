"""Extra runs of the model that leave no trace: nanguard's own hooks set aside, floating and
integer buffers (BatchNorm statistics) and every random state put back afterwards.

A replay's sample search runs the model again on parts of the batch after the step's verdict is
known. The guard's hooks must not see those runs (they would count as forwards of the step, and a
bare ``init()``'s process-wide hook would take the model for a new one), and the model must come
out as it went in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .._torch.patches import hooks_set_aside
from ..incident import rng_restore, rng_snapshot


@contextlib.contextmanager
def quiet(model: nn.Module) -> Iterator[None]:
    """Inside: nanguard's hooks (on ``model`` and process-wide) are set aside. After: they are
    back, and so are ``model``'s buffers and every RNG state as they were before."""
    buffers = saved_buffers(model)
    rng = rng_snapshot()
    try:
        with hooks_set_aside(model):
            yield
    finally:
        restore_buffers(buffers)
        rng_restore(rng)


def restore_buffers(buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)


def saved_buffers(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b, b.detach().clone()) for b in model.buffers()]
