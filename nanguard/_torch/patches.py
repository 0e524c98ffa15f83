"""The three places where the guard wraps one of torch's callables, each with its undo (beside
torch's private symbols, ``nanguard._torch``: what a new torch can break is in this package).

- ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS) runs the forward and
  backward inside the step, after the step pre-hook: the decision must wait for the closure.
- A step that a GradScaler skips never calls ``optimizer.step()``, so the step pre-hook never
  decides it: the scaler's ``update()`` then has to.
- ``torch.func.functional_call`` runs a module with weights it is handed (MAML's fast weights, a
  hypernetwork's), put in the place of its own for the call by torch's
  ``nn.utils.stateless._reparametrize_module``: the guard is told which (``handed_to``), so that a
  report names a non-finite weight a module ran with whoever owns it, and a re-run runs with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from torch.nn.utils import stateless

from . import reparametrize_module

_listeners: weakref.WeakSet = weakref.WeakSet()
"""what is told of each call given weights (``Detector.handed``)"""
_in_force: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
"""the calls given weights that are running, innermost last"""
_reparametrize = reparametrize_module()
"""torch's own (None where this torch has none: calls given weights are then not told apart)"""


@contextmanager
def _handing(module: torch.nn.Module, parameters_and_buffers: dict[str, torch.Tensor], *args: Any,
             **kwargs: Any) -> Iterator[None]:
    for listener in list(_listeners):
        listener.handed(module, parameters_and_buffers)
    entry = (module, parameters_and_buffers)
    _in_force.append(entry)
    try:
        with _reparametrize(module, parameters_and_buffers, *args, **kwargs):
            yield
    finally:
        _in_force.remove(entry)


def watch_handed_weights(listener: Any) -> SimpleNamespace:
    """Tell ``listener.handed(module, weights)`` of every call run with weights it is handed; returns a
    handle whose ``remove()`` undoes it, as a hook's does: torch's own function is put back when the
    last listener is removed (where this torch has none, nothing is wrapped: ``_torch``)."""
    if _reparametrize is not None:
        stateless._reparametrize_module = _handing
    _listeners.add(listener)
    held = weakref.ref(listener)  # (the handle is the listener's own: no cycle back to it)

    def remove() -> None:
        if (alive := held()) is not None:
            _listeners.discard(alive)
        if not _listeners and stateless.__dict__.get("_reparametrize_module") is _handing:
            stateless._reparametrize_module = _reparametrize

    return SimpleNamespace(remove=remove)


def handed_to(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The weights ``module`` runs with now in the place of its own, or None."""
    return next((weights for held, weights in reversed(_in_force) if held is module), None) if _in_force else None


def wrap_closure(args: tuple, kwargs: dict, after: Callable[[bool, Any], Any]) -> tuple[tuple, dict] | None:
    """The arguments of an optimizer step pre-hook (``args`` holds the optimizer first) with the
    closure replaced by one that calls ``after(first, loss)`` once it has run and returns what that
    returns (the loss, or what the optimizer is to get instead); None without a closure.

    LBFGS calls the closure several times in one step: ``first`` is True only the first time.
    """
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        return None
    first = True

    def guarded_closure():
        nonlocal first
        loss = closure()
        count, first = first, False
        return after(count, loss)

    if "closure" in kwargs:
        return args, {**kwargs, "closure": guarded_closure}
    return (args[0], guarded_closure, *args[2:]), kwargs


def patch_scaler_update(scaler: Any, after: Callable[[], None]) -> Callable[[], None]:
    """Make ``scaler.update()`` call ``after()`` once it has run; returns the undo."""
    update = scaler.update

    def guarded_update(*args, **kwargs):
        result = update(*args, **kwargs)
        after()
        return result

    scaler.update = guarded_update
    return lambda: scaler.__dict__.pop("update", None)
