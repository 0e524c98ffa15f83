"""Every place where nanguard changes what torch does, each with its undo (beside torch's private
symbols, ``nanguard._torch``: what a new torch can break is in this package). ``PATCHES`` names
them all, with how each is undone; ``tests/unit/test_torch_patches.py`` applies and undoes each
and checks torch is as it was.

- ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS) runs the forward and
  backward inside the step, after the step pre-hook: the decision must wait for the closure.
- A step that a GradScaler skips never calls ``optimizer.step()``, so the step pre-hook never
  decides it: the scaler's ``update()`` then has to.
- ``torch.func.functional_call`` runs a module with weights it is handed (MAML's fast weights, a
  hypernetwork's), put in the place of its own for the call by torch's
  ``nn.utils.stateless._reparametrize_module``: the guard is told which (``handed_to``), so that a
  report names a non-finite weight a module ran with whoever owns it, and a re-run runs with it.
- DDP's gradient buckets and FSDP2's reduce-scatter inputs are read before they are summed across
  ranks (a NaN born in one rank's backward pass is named as that rank's), through their
  communication hooks.
- A replay's extra runs of a model set nanguard's own hooks aside in torch's hook tables.
- ``nanguard.destroy_process_group()`` drops the destroyed default group from the default
  arguments of ``torch.distributed.nn.functional`` (``_dist``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.modules.module as module_hooks
from torch import nn
from torch.nn.utils import stateless

from . import fsdp_default_reduce_scatter, reparametrize_module

PATCHES = {
    "optimizer.step(closure)": "wrap_closure: the closure of one call, for that call (nothing stays)",
    "GradScaler.update": "patch_scaler_update: on the scaler; its undo is run by the guard's close()",
    "torch.nn.utils.stateless._reparametrize_module": "watch_handed_weights: put back by the last "
    "handle's remove(), which the guard's close() runs",
    "DistributedDataParallel.register_comm_hook, before the first forward": "before_first_comm_hook: on the "
    "wrapper; its undo is run by the guard's close()",
    "DistributedDataParallel's communication hook": "route_comm_hooks: for the wrapper's life (DDP takes one "
    "hook and cannot drop it); once the guard is closed it only sums, as the hook it routes to does",
    "FSDP2's reduce-scatter": "watch_reduce_scatters: its undo, run by the guard's close(), puts the default back",
    "torch's hook tables": "hooks_set_aside: nanguard's hooks are put back, in their order, as the block ends",
    "torch.distributed.nn.functional's default arguments": "release_destroyed_groups: none (a destroyed group "
    "in their place is a process group that no longer exists; None is what they meant: the default group)",
}
"""what nanguard changes in torch, and how each is undone"""

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


def before_first_comm_hook(ddp: nn.Module, first: Callable[[], None]) -> Callable[[], None]:
    """Make a communication hook registered on ``ddp`` (fp16 compression, right after the wrapper is
    built: before its reducer exists and nanguard's own can be) call ``first()`` before it is
    registered; returns the undo. ``first`` is expected to route it (``route_comm_hooks``)."""
    ref = weakref.ref(ddp)

    def undo() -> None:
        if (wrapper := ref()) is not None and wrapper.__dict__.get("register_comm_hook") is register_comm_hook:
            del wrapper.__dict__["register_comm_hook"]

    def register_comm_hook(state: Any, hook: Callable) -> None:
        undo()
        first()
        ref().register_comm_hook(state, hook)

    ddp.register_comm_hook = register_comm_hook
    return undo


def route_comm_hooks(ddp: nn.Module, on_bucket: Callable[[torch.Tensor], None]) -> bool:
    """Register on ``ddp`` a communication hook that calls ``on_bucket(buffer)`` with each bucket's
    gradients before it sums them, as torch's default all-reduce does; a hook the script registers
    later (DDP takes one) replaces the default behind ours. False where the script registered
    one first (nothing is changed). For the wrapper's life: see ``PATCHES``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp.__dict__.pop("register_comm_hook", None)  # (``before_first_comm_hook``'s, done with)
    route = {"state": getattr(ddp, "process_group", None), "hook": allreduce_hook}

    def bucket_hook(state, bucket):  # (no annotations: DDP checks them against its own types)
        on_bucket(bucket.buffer())
        return route["hook"](route["state"], bucket)

    def register_comm_hook(state: Any, hook: Callable) -> None:
        route["state"], route["hook"] = state, hook

    try:
        type(ddp).register_comm_hook(ddp, None, bucket_hook)
    except RuntimeError:
        return False
    ddp.register_comm_hook = register_comm_hook
    return True


def watch_reduce_scatters(modules: dict[nn.Module, str],
                          on_input: Callable[[str, torch.Tensor], None]) -> Callable[[], None] | None:
    """Make each FSDP2 reduce-scatter of ``modules`` (every ``fully_shard``-ed module of a model, by
    name) call ``on_input(name, input)`` with this rank's own gradients before it sums them, then do
    the default reduce-scatter; returns the undo. None (nothing changed) where any of them has
    another reduce-scatter (its own, or several parameter groups) or this torch's FSDP2 is not the
    one known here."""
    default = fsdp_default_reduce_scatter()
    if default is None:
        return None

    class Watched(default):
        def __init__(self, name: str):
            self.name = name

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            on_input(self.name, input_tensor)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    try:
        groups = {m: m._get_fsdp_state()._fsdp_param_groups for m in modules}
        if not all(len(found) <= 1 and all(type(g._reduce_scatter_comm) is default for g in found)
                   for found in groups.values()):
            return None
        before = {m: found[0]._reduce_scatter_comm for m, found in groups.items() if found}
        for module in before:
            module.set_custom_reduce_scatter(Watched(modules[module]))
    except (AttributeError, ValueError, RuntimeError):
        return None
    held = [(weakref.ref(m), comm) for m, comm in before.items()]

    def undo() -> None:
        for ref, comm in held:
            if (module := ref()) is not None:
                module.set_custom_reduce_scatter(comm)

    return undo


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


def _ours(hook: Any) -> bool:
    hook = getattr(hook, "func", hook)  # functools.partial
    name = getattr(hook, "__module__", None) or ""
    return name == "nanguard" or name.startswith("nanguard.")


@contextmanager
def hooks_set_aside(model: nn.Module) -> Iterator[None]:
    """Inside: nanguard's hooks on ``model``'s modules and process-wide are out of torch's hook tables.
    After: they are back, in their order, behind none of those registered meanwhile."""
    tables: list[MutableMapping[int, Any]] = [getattr(module_hooks, name) for name in _GLOBAL_HOOKS]
    tables += [getattr(m, name) for m in model.modules() for name in _MODULE_HOOKS]
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


_PINNING_MODULES = ("torch.distributed.nn.functional",)
"""modules that keep the default group as a default argument value (evaluated at their import)"""


def release_destroyed_groups() -> list:
    """Once no group is initialized, replace the process groups in the default arguments of
    ``_PINNING_MODULES``' functions by None (their "use the default group"); return them."""
    import torch.distributed as dist

    if dist.is_initialized():
        return []
    found = {}
    for name in _PINNING_MODULES:
        module = sys.modules.get(name)
        for function in list(vars(module).values()) if module is not None else ():
            defaults = getattr(function, "__defaults__", None)
            if defaults and any(isinstance(v, dist.ProcessGroup) for v in defaults):
                found.update((id(v), v) for v in defaults if isinstance(v, dist.ProcessGroup))
                function.__defaults__ = tuple(None if isinstance(v, dist.ProcessGroup) else v
                                              for v in defaults)
    return list(found.values())
