"""Names of modules as reports show them, what wrappers (DDP, torch.compile, accelerate,
Lightning) hold: the model, the optimizer; and hooks that a compiled frame runs untraced."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._torch import dynamo_disable

# Wrappers whose child is the user's model: their attribute name is left out of layer names. The
# first three also prefix the wrapped model's state_dict keys, so a capture saves the inner model.
_WRAPPERS = {
    "DistributedDataParallel": "module", "DataParallel": "module", "OptimizedModule": "_orig_mod",
    "FullyShardedDataParallel": None, "CheckpointWrapper": None, "OffloadWrapper": None,
    "_LightningModuleWrapperBase": None,
}


def is_wrapper(module: nn.Module) -> bool:
    return type(module).__name__ in _WRAPPERS


def plain_names(root: nn.Module, prefix: str = "") -> dict[nn.Module, str]:
    """Qualified names of every submodule, with wrapper attributes (DDP's ``module.``) left out,
    after ``prefix`` (a bare init()'s roots after the first: ``Sequential#2``)."""
    names: dict[nn.Module, str] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        if module in names:
            return
        names[module] = prefix
        wrapper = is_wrapper(module)
        for child_name, child in module.named_children():
            walk(child, prefix if wrapper else f"{prefix}.{child_name}".lstrip("."))

    walk(root, prefix)
    return names


def type_name(module: nn.Module) -> str:
    cls = type(module)
    # FSDP2's fully_shard swaps the class for FSDP<Original>(FSDPModule, Original).
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2:
        cls = cls.__bases__[1]
    return cls.__name__


def eager(module: nn.Module) -> Callable[..., Any]:
    """What runs ``module``'s forward, hooks and all, without a compiled graph: the model a
    ``torch.compile`` wrapper holds, or the uncompiled call of a module compiled in place
    (``module.compile()``)."""
    if type(module).__name__ == "OptimizedModule":
        module = module._orig_mod
    return module._call_impl if getattr(module, "_compiled_call_impl", None) is not None else module


def ddp_inner(module: nn.Module) -> nn.Module | None:
    """The model a DDP wrapper holds (None for any other module): a script may wrap it again in a
    new DDP (to sync a module added during training), which calls it as the old wrapper did."""
    return module.module if type(module).__name__ == "DistributedDataParallel" else None


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel / torch.compile wrappers (plain state names)."""
    while (attribute := _WRAPPERS.get(type(model).__name__)) is not None:
        model = getattr(model, attribute)
    return model


NON_PERSISTENT = "non_persistent_buffers"
"""the name an incident's extra states keep a model's non-persistent buffers under"""
STEP_PART = "optimizer_steps_before"
"""the name they keep, when not 0, how many optimizer steps of the stopped step came before the
one stopped (a GAN's critic's, before its generator's): the state is from after them"""
OPTIMIZER_PARAMS = "optimizer_params"
"""the name they keep the names of the captured optimizer's parameters under, in its order"""
MORE_MODELS = "more_models"
"""the name they keep a bare init()'s other models under (its roots after the first), by the
prefix of their names: {prefix: {"model": state_dict, NON_PERSISTENT: {name: tensor}}}"""


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict`` leaves out (``persistent=False``: transformers' rotary ``inv_freq``,
    causal masks), by qualified name: what the step's forward also read."""
    return {f"{prefix}.{name}".lstrip("."): buffer.detach() for prefix, module in model.named_modules()
            for name in module._non_persistent_buffers_set
            if (buffer := module._buffers.get(name)) is not None}


def dtensor(tensor: Any) -> bool:
    """A DTensor (FSDP2's shards, tensor parallelism): this rank holds its local part."""
    return hasattr(tensor, "to_local")


def sharding(model: nn.Module | None, optimizer: torch.optim.Optimizer | None = None) -> str | None:
    """How an incident's per-rank states must be loaded, when the model (FSDP2) or the optimizer
    state (``ZeroRedundancyOptimizer``) is sharded."""
    if model is not None and any(dtensor(p) for p in model.parameters()):
        return ("fsdp2: each rank's state.pt holds its own shards (DTensors); load rank k's file on"
                " rank k of a job with the same world size and the same fully_shard layout")
    if optimizer is not None and local_optimizer(optimizer) is not optimizer:
        return ("zero: each rank's state.pt holds its own shard of the optimizer state (the local optimizer"
                " of a ZeroRedundancyOptimizer); load rank k's file on rank k of a job with the same world size")
    return None


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that steps inside a wrapper (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``), which subclasses Optimizer without its hooks: the guard's
    step pre-hook goes on the inner one, which steps only when the wrapper really steps."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if "_optimizer_step_pre_hooks" in vars(optimizer):
            break
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds and steps: a ``ZeroRedundancyOptimizer``'s local
    one (its shard of the state; the whole is on no rank unless it is consolidated, a collective),
    else ``optimizer`` itself."""
    inner = getattr(optimizer, "optim", None)
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer" and isinstance(inner, torch.optim.Optimizer):
        return inner
    return optimizer


def params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer`` updates, group by group."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def untraced(work: Callable[..., Any]) -> Callable[..., Any]:
    """``work`` as a hook that Dynamo never traces: a module compiled in place
    (``module.compile()``) runs its hooks inside the compiled frame, and Dynamo's frame callback
    stays on for the frames they call even outside tracing. There it is a graph break, once a
    call, instead of Python bookkeeping traced (that Dynamo cannot trace, or would recompile for);
    elsewhere it costs about 0.3 us a call here."""
    return dynamo_disable(work)
