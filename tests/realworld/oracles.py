"""Oracles independent of nanguard: what really happened in a step, told by our own hooks.

Nothing here imports nanguard. Each oracle watches a model the plain PyTorch way (module forward
hooks, parameter gradient hooks, copies of the state) and answers the questions the suite asks
nanguard: which module's output went non-finite first and were its inputs finite; which
parameter's gradient went non-finite first in the backward pass; did the step change the model.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def tensors_in(obj: Any, _depth: int = 0, _seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every floating tensor reachable from ``obj``: containers, mappings (``ModelOutput``),
    dataclasses and plain objects' attributes (a ``torch.distributions.Normal``'s loc and scale)."""
    seen = set() if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() or obj.is_complex() else []
    if _depth > 8 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type, nn.Module)):
        return []
    seen.add(id(obj))
    if isinstance(obj, Mapping):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif dataclasses.is_dataclass(obj):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in tensors_in(item, _depth + 1, seen)]


def finite(obj: Any) -> bool:
    """True when every floating tensor in ``obj`` is finite (exact)."""
    return all(bool(torch.isfinite(t.detach()).all()) for t in tensors_in(obj))


@dataclass
class Call:
    """One module call, recorded when it returned."""

    name: str
    module_type: str
    inputs_finite: bool
    output_finite: bool
    params_finite: bool
    forward: int
    """which forward of the root (micro-batch) it belonged to"""


@dataclass
class ForwardOracle:
    """Forward hooks on every module of ``model`` (with keyword arguments), in the order they fire
    (a module when it returns, so a child before its parent). ``producer()``: the first call whose
    output held a non-finite value: the module that made it."""

    model: nn.Module
    calls: list[Call] = field(default_factory=list)
    forwards: int = 0

    def __post_init__(self):
        self._handles = []
        names = {m: n for n, m in self.model.named_modules()}
        for module, name in names.items():
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        self._handles.append(self.model.register_forward_pre_hook(self._count))

    def _count(self, module, args):
        self.forwards += 1

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            self.calls.append(Call(
                name, type(module).__name__, finite((args, kwargs)), finite(output),
                all(bool(torch.isfinite(p.detach()).all()) for p in module.parameters(recurse=False)),
                self.forwards - 1))

        return hook

    def producer(self) -> Call | None:
        return next((c for c in self.calls if not c.output_finite), None)

    def nonfinite_inputs(self) -> list[Call]:
        """Calls fed a non-finite value (a -inf mask) whose output stayed finite."""
        return [c for c in self.calls if not c.inputs_finite and c.output_finite]

    def reset(self) -> None:
        self.calls.clear()
        self.forwards = 0

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class GradOracle:
    """A hook on every parameter that fires when its gradient has been accumulated: the order in
    which gradients are produced, and the first that was non-finite. ``prefix`` is stripped from
    the names (a wrapper's ``module.``)."""

    model: nn.Module
    prefix: str = ""
    order: list[tuple[str, bool]] = field(default_factory=list)

    def __post_init__(self):
        self._handles = []
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(name)))

    def _hook(self, name: str):
        name = name.removeprefix(self.prefix)

        def hook(param):
            self.order.append((name, bool(torch.isfinite(param.grad).all())))

        return hook

    def first_bad(self) -> str | None:
        return next((name for name, ok in self.order if not ok), None)

    def first_bad_module(self) -> str | None:
        """The module that owns the first non-finite gradient."""
        name = self.first_bad()
        return None if name is None else name.rsplit(".", 1)[0]

    def bad_params_of_first_module(self) -> set[str]:
        module = self.first_bad_module()
        return {n for n, ok in self.order if not ok and n.rsplit(".", 1)[0] == module}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


# ------------------------------------------------------------------ the state before a step
def _copy_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers() if b.is_floating_point()},
        "optimizer": copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
    }


def identical(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of nested states (NaN equals NaN in the same place)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


class StateBefore:
    """A copy of a model's parameters, floating buffers and optimizer state, to compare with later."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer
        self.state = _copy_state(model, optimizer)

    def changed(self, model: nn.Module | None = None, optimizer: Any = None) -> list[str]:
        """What differs now: names of parameters and buffers, and "optimizer"."""
        now = _copy_state(model or self.model, optimizer or self.optimizer)
        diff = [n for part in ("params", "buffers") for n in self.state[part]
                if not identical(self.state[part][n], now[part].get(n))]
        if not identical(self.state["optimizer"], now["optimizer"]):
            diff.append("optimizer")
        return diff

    def differs_from_saved(self, saved: Mapping[str, torch.Tensor], prefix: str = "") -> list[str]:
        """Names whose value in a saved ``state_dict`` is not the one copied here."""
        buffers = {n: b for n, b in self.state["buffers"].items() if prefix + n in saved}  # persistent ones
        mine = {**self.state["params"], **buffers}
        return [n for n, value in mine.items() if not identical(value, saved.get(prefix + n))]
