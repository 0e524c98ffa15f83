"""Extra runs of the model that leave no trace: nanguard's own hooks set aside, floating and
integer buffers (BatchNorm statistics) and every random state put back afterwards.

A replay's sample search runs the model again on parts of the batch after the step's verdict is
known. The guard's hooks must not see those runs (they would count as forwards of the step, and a
bare ``init()``'s process-wide hook would take the model for a new one), and the model must come
out as it went in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
import torch.nn.modules.module as module_hooks
from torch import nn

from ..incident import rng_restore, rng_snapshot

_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


def _ours(hook: Any) -> bool:
    hook = getattr(hook, "func", hook)  # functools.partial
    name = getattr(hook, "__module__", None) or ""
    return name == "nanguard" or name.startswith("nanguard.")


@contextlib.contextmanager
def _without_ours(tables: list[MutableMapping[int, Any]]) -> Iterator[None]:
    saved = []
    for table in tables:
        ours = [key for key, hook in table.items() if _ours(hook)]
        if ours:
            saved.append((table, dict(table)))
            for key in ours:
                del table[key]
    try:
        yield
    finally:
        for table, before in saved:
            added = {key: hook for key, hook in table.items() if key not in before}
            table.clear()
            table.update(before)  # in their order: hooks run in registration order
            table.update(added)


@contextlib.contextmanager
def quiet(model: nn.Module) -> Iterator[None]:
    """Inside: nanguard's hooks (on ``model`` and process-wide) are set aside. After: they are
    back, and so are ``model``'s buffers and every RNG state as they were before."""
    tables = [getattr(module_hooks, name) for name in _GLOBAL_HOOKS]
    tables += [getattr(m, name) for m in model.modules() for name in _MODULE_HOOKS]
    buffers = saved_buffers(model)
    rng = rng_snapshot()
    try:
        with _without_ours(tables):
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
