"""Every private symbol of torch that the rank side uses, found in one place, with what nanguard
does without it.

torch renames its private functions between releases. Looked up where they are used, one rename
would break ``import nanguard`` for everybody on that release. Here each is looked up once, on the
first import of this module; one that is gone is replaced by a fallback that does less, and said
once on the ``nanguard`` logger (what is missing, which torch, what is lost). ``MISSING`` lists
the ones that were gone. ``tests/unit/test_torch_internals.py`` takes each one away in turn and
runs a guarded step without it.

(The replay's op checks, ``replay/ops.py``, subclass torch's dispatch mode: only a replay imports
them, and ``init`` refuses a replay with a clear error where they fail to import; a guard never
imports them. What nanguard changes in torch's behaviour is in ``patches.py``.)
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("nanguard")

PRIVATE = ("torch._C._set_grad_enabled", "torch._C._is_any_autocast_enabled",
           "torch._C._functorch.is_functorch_wrapped_tensor", "torch._C._current_graph_task_id",
           "torch._C._current_autograd_node", "torch._foreach_norm",
           "torch.autograd.Variable._execution_engine.queue_callback", "torch._dynamo.disable",
           "torch.nn.utils.stateless._reparametrize_module")
"""every private symbol of torch looked up here (the first seven as this module is imported, the last
two as a guard starts)"""
PRIVATE_WHEN_MET = ("torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultReduceScatter",
                    "torch.amp.GradScaler._scale")
"""the private symbols looked up only once a guard meets what has them: an FSDP2 (``fully_shard``)
model, a GradScaler"""
MISSING: list[str] = []
"""the private symbols this torch does not have (their fallbacks are in use)"""


def _find(path: str) -> Any:
    found: Any = torch
    for part in path.split(".")[1:]:
        found = getattr(found, part)
    return found


def _find_in_module(path: str) -> Any:
    """``path``'s last name in its module, which is imported (``torch.distributed.…``)."""
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _private(path: str, fallback: Any, lost: str, find: Callable[[str], Any] = _find) -> Any:
    """``path`` (``torch.…``) as this torch has it, else ``fallback``, said once with what is ``lost``."""
    try:
        return find(path)
    except (AttributeError, ImportError):
        MISSING.append(path)
        log.warning("nanguard: torch %s has no %s: %s (nanguard goes on without it; please report it)",
                    torch.__version__, path, lost)
        return fallback


def _autocast_any() -> bool:
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(t) for t in tensors]


def _no_queue(callback: Callable[[], None]) -> None:
    raise RuntimeError("no autograd callback queue in this torch")


set_grad_enabled: Callable[[bool], None] = _private(
    "torch._C._set_grad_enabled", torch.set_grad_enabled, "autograd is switched through its context manager (slower)")
"""switches autograd on or off, as ``torch.no_grad()`` does, without a context manager's cost"""

any_autocast_enabled: Callable[[], bool] = _private(
    "torch._C._is_any_autocast_enabled", _autocast_any, "autocast is asked of each device (slower)")

functorch_wrapped: Callable[[torch.Tensor], bool] = _private(
    "torch._C._functorch.is_functorch_wrapped_tensor", lambda tensor: False,
    "tensors inside torch.func transforms are not told apart (a probe inside vmap or grad may fail)")
"""whether a tensor is one of torch.func's inside a transform (vmap, grad): it holds no value to read"""

graph_task_id: Callable[[], int] = _private(
    "torch._C._current_graph_task_id", lambda: -1,
    "forwards that activation checkpointing runs again in the backward pass are taken for new forwards")
"""-1 outside a backward pass"""

current_autograd_node: Callable[[], Any] = _private(
    "torch._C._current_autograd_node", lambda: None, "the replay's op checks cannot name the backward op")

foreach_norm: Callable[[list[torch.Tensor]], list[torch.Tensor]] = _private(
    "torch._foreach_norm", _norms, "gradient norms are taken one tensor at a time (slower)")

queue_callback: Callable[[Callable[[], None]], None] = _private(
    "torch.autograd.Variable._execution_engine.queue_callback", _no_queue,
    "the gradients are measured as the optimizer steps, not as the backward pass left them")
"""runs a callback when the current backward pass ends (raises where this torch has none)"""


def dynamo_disable(work: Callable[..., Any]) -> Callable[..., Any]:
    """``work``, never traced by Dynamo (``torch._dynamo.disable``): looked up when called, since
    importing Dynamo costs a second; where it is gone, ``work`` as it is (a hook compiled in place
    then runs traced)."""
    try:
        return torch._dynamo.disable(work, recursive=True)
    except AttributeError:
        if "torch._dynamo.disable" not in MISSING:
            _private("torch._dynamo.disable", None, "hooks of a model compiled in place are traced")
        return work


def reparametrize_module() -> Any:
    """torch.func.functional_call's own context manager (``nn.utils.stateless._reparametrize_module``),
    or None where this torch has none (a module run with weights it is handed is then not told apart)."""
    from torch.nn.utils import stateless

    found = getattr(stateless, "_reparametrize_module", None)
    return found if found is not None else _private(
        "torch.nn.utils.stateless._reparametrize_module", None,
        "a module run by torch.func.functional_call with weights it is handed is not told apart")


def fsdp_default_reduce_scatter() -> Any:
    """FSDP2's default reduce-scatter (the class of what ``set_custom_reduce_scatter`` replaces), or None
    where this torch has none (FSDP2's gradients are then not watched before they are summed); looked
    up, and a loss said, once."""
    global _fsdp_default
    if _fsdp_default is _UNSEEN:
        _fsdp_default = _private(
            "torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultReduceScatter", None,
            "FSDP2's gradients are not watched before they are summed (a NaN born in a backward pass is not "
            "traced to its rank)", find=_find_in_module)
    return _fsdp_default


_UNSEEN = object()
_fsdp_default: Any = _UNSEEN


def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """A GradScaler's scale as the device tensor it keeps (``GradScaler._scale``: ``get_scale()``
    reads it to the host), or None (no scaler, a scale not made yet, or a scaler that keeps none
    there: said once, and the flight recorder's scale column is then empty)."""
    if scaler is None:
        return None
    if not hasattr(scaler, "_scale"):
        if not getattr(scaler, "is_enabled", lambda: True)():
            return None  # (a disabled scaler keeps no scale)
        if "torch.amp.GradScaler._scale" not in MISSING:
            _private("torch.amp.GradScaler._scale", None, "the flight recorder does not record the GradScaler's scale",
                     find=lambda path: scaler._scale)
        return None
    scale = scaler._scale
    return scale if isinstance(scale, torch.Tensor) else None
