"""Hooks and device flags: find non-finite values without syncing the host. No I/O.

Every checked tensor leaves one *probe*: a 0-d device tensor (its float32 sum, exact for
NaN and Inf: NaN + x = NaN, Inf + -Inf = NaN) appended to a list with a little metadata.
Nothing is read on the hot path: the guard stacks the step's probes (and the gradient norms)
into one small vector and reads it once per optimizer step; only when a value in it is
non-finite does ``first_bad()`` look at the probes one by one, in the order they were made.

What is probed:
- the floating-point tensors in the output of every leaf module (and of every module that
  owns parameters directly, such as ``nn.MultiheadAttention``, whose ``out_proj`` never runs);
- the inputs of such a module, unless they are outputs already probed and not modified in
  place since (so a value born in code *between* modules is told apart from one born inside);
- the root module's inputs (the batch), the gradient flowing back into its outputs (what
  the loss sent), tensors given to ``Guard.check``, and every parameter gradient.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import weakref
from bisect import bisect_right
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from . import forensics
from ._tree import floating_tensors

# probe roles
OUT, IN, BATCH, CHECK = range(4)

# Modules whose output is finite whenever their input is: their outputs need no probe of
# their own, the probe of their input covers them.
_FINITE_PRESERVING = (
    nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softsign, nn.Identity, nn.Flatten,
    nn.Unflatten, nn.GELU, nn.SiLU, nn.Mish, nn.ELU, nn.Hardswish, nn.Hardsigmoid, nn.Softmax,
    nn.LogSoftmax, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
# Wrappers whose child is the user's model: their attribute name is left out of layer names.
_WRAPPERS = {
    "DistributedDataParallel", "DataParallel", "OptimizedModule", "FullyShardedDataParallel",
    "CheckpointWrapper", "OffloadWrapper", "_LightningModuleWrapperBase",
}
_MAX_CHECK_NAMES = 1024

CHECK_MODE, PASS_MODE, SKIP_MODE = range(3)
_COMPILED = -1  # the "version" of a probe made inside a compiled graph


def probe(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor that is non-finite when ``tensor`` has a NaN or an Inf (no host sync).

    Half-precision tensors are summed in float32. A float32 sum can also overflow on huge
    finite values (|sum| > 3.4e38): ``first_bad`` confirms such a case exactly when it can.
    """
    return _sum(forensics.plain(tensor))


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.sum(dtype=torch.float32)
    return tensor.sum()


def plain_name(root: nn.Module) -> dict[nn.Module, str]:
    """Qualified names of every submodule, with wrapper attributes (DDP's ``module.``) left out."""
    names: dict[nn.Module, str] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        if module in names:
            return
        names[module] = prefix
        wrapper = type(module).__name__ in _WRAPPERS
        for child_name, child in module.named_children():
            walk(child, prefix if wrapper else f"{prefix}.{child_name}".lstrip("."))

    walk(root, "")
    return names


def type_name(module: nn.Module) -> str:
    cls = type(module)
    # FSDP2's fully_shard swaps the class for FSDP<Original>(FSDPModule, Original).
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2:
        cls = cls.__bases__[1]
    return cls.__name__


@dataclasses.dataclass(slots=True)
class _Slot:
    name: str
    module_type: str
    module: weakref.ref


class Detector:
    """Installs the hooks and keeps the probes of the current step."""

    def __init__(self, *, skip_types: Iterable[str | type] = (), skip_modules: Iterable[str] = (),
                 detail_bytes: int = 0, on_root_end: Callable[[], None] | None = None,
                 on_step_start: Callable[[], None] | None = None, keep_batches: bool = False):
        self._skip_types = tuple(skip_types)
        self._skip_modules = tuple(skip_modules)
        self.on_root_end = on_root_end
        self.on_step_start = on_step_start
        self.keep_batches = keep_batches
        self.batches: list[tuple[int, tuple, dict]] = []
        """(root slot, args, kwargs) of every root forward of the step: references, no copies"""
        self._detail_bytes = detail_bytes
        self._kept_bytes = 0
        self.slots: list[_Slot] = []
        self.param_names: dict[int, str] = {}
        self.param_owner: dict[int, int] = {}
        self._handles: list[Any] = []
        self._modules: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        self._check_names: dict[str, int] = {}
        self._vals: list[torch.Tensor] = []
        self._meta: list[tuple] = []
        self._zeros: dict[torch.device, torch.Tensor] = {}
        self._bucket_vals: list[torch.Tensor] = []
        self.watches_buckets = False
        self._spans: list[tuple[int, int, int]] = []  # (first probe index, root slot, micro-batch)
        self._seen: dict[int, tuple[weakref.ref, int]] = {}
        self._forwards: dict[int, int] = {}

    # ------------------------------------------------------------------ installing
    def owns(self, module: nn.Module) -> bool:
        return module in self._modules

    def attach(self, root: nn.Module, prefix: str = "") -> int:
        """Hook ``root`` and every leaf below it; returns the root's slot."""
        names = plain_name(root)
        skipped: list[str] = []
        for module, name in names.items():
            if module in self._modules:
                continue
            qualified = f"{prefix}.{name}".strip(".") if prefix else name
            slot = len(self.slots)
            self.slots.append(_Slot(qualified, type_name(module), weakref.ref(module)))
            self._modules[module] = slot
            for pname, param in module.named_parameters(recurse=False):
                self.param_names.setdefault(id(param), f"{qualified}.{pname}".lstrip("."))
                self.param_owner.setdefault(id(param), slot)
            mode = self._mode(module, qualified)
            if any(qualified == s or qualified.startswith(s + ".") for s in skipped):
                mode = SKIP_MODE
            elif mode == SKIP_MODE:
                skipped.append(qualified)
            # Containers are hooked too, so a value born in their own forward code is blamed on
            # them; an output that is a child's output again is recognised and not re-checked.
            leaf = next(module.children(), None) is None or any(
                p is not None for p in module._parameters.values())
            # Keyword tensors of non-root modules are not looked at: hooks that take kwargs cost
            # several microseconds more per call. A value passed by keyword is still caught at the
            # output it poisons.
            hook = self._make_hook(slot, mode, leaf)
            self._handles.append(module.register_forward_hook(hook))
        for module in names:
            if type(module).__name__ == "DistributedDataParallel":
                self._watch_buckets(module)
        root_slot = self._modules[root]
        self._handles.append(root.register_forward_pre_hook(
            self._make_root_pre(root_slot), with_kwargs=True))
        self._handles.append(root.register_forward_hook(
            self._make_root_post(root_slot), with_kwargs=True))
        return root_slot

    def _watch_buckets(self, ddp: nn.Module) -> None:
        """Probe each DDP gradient bucket *before* its all-reduce, so that a rank can tell a
        NaN born in its own backward from one the all-reduce brought in from another rank.

        DDP takes one communication hook: ours does the default all-reduce, and a hook the
        user registers later is called by ours instead (it replaces the default).
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        route = {"state": getattr(ddp, "process_group", None), "hook": allreduce_hook}

        def bucket_hook(state, bucket):
            if self._handles:  # still attached
                self._bucket_vals.append(probe(bucket.buffer()))
            return route["hook"](route["state"], bucket)

        def register_comm_hook(state, hook):
            route["state"], route["hook"] = state, hook

        try:
            ddp.register_comm_hook(None, bucket_hook)
        except RuntimeError:
            return  # the user registered a hook first: no per-rank origin for backward NaNs
        ddp.register_comm_hook = register_comm_hook
        self.watches_buckets = True

    @property
    def bucket_probes(self) -> list[torch.Tensor]:
        """Probes of this step's local gradients before DDP's all-reduce (read with the rest)."""
        return self._bucket_vals

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._modules = weakref.WeakKeyDictionary()
        self.reset()

    def _mode(self, module: nn.Module, name: str) -> int:
        cls = type(module)
        if any(t is cls or t in (cls.__name__, type_name(module), f"{cls.__module__}.{cls.__qualname__}")
               for t in self._skip_types) or any(fnmatch.fnmatchcase(name, p) for p in self._skip_modules):
            return SKIP_MODE
        if isinstance(module, _FINITE_PRESERVING) and getattr(module, "negative_slope", 0) <= 1:
            return PASS_MODE
        return CHECK_MODE

    # ------------------------------------------------------------------ hot path
    def _add(self, tensor: torch.Tensor, role: int, slot: int, lazy: bool = False) -> None:
        """Probe a forward tensor and remember it as checked. A ``lazy`` one (the batch) is only
        kept, when the byte budget allows, and checked exactly once the step is known bad."""
        local = forensics.plain(tensor)
        kept: Any = None
        if self._kept_bytes < self._detail_bytes:
            # Keep the step's first tensors (up to a byte budget) so a bad one can be described
            # exactly after the backward pass has freed the activations.
            size = local.numel() * local.element_size()
            if self._kept_bytes + size <= self._detail_bytes:
                self._kept_bytes += size
                kept = local
        ref = weakref.ref(tensor)
        if kept is None:
            kept, lazy = ref, False
        self._vals.append(self._zero(local.device) if lazy else _sum(local))
        self._meta.append((role, slot, kept, tensor._version, tensor.shape, tensor.dtype, lazy))
        self._seen[id(tensor)] = (ref, tensor._version)

    def _zero(self, device: torch.device) -> torch.Tensor:
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros((), device=device)
        return zero

    def _unchecked(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``tensors`` not probed or marked yet (or modified in place since)."""
        seen = self._seen
        out = []
        for tensor in tensors:
            entry = seen.get(id(tensor))
            if entry is None or entry[0]() is not tensor or entry[1] != tensor._version:
                out.append(tensor)
        return out

    def _mark_seen(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            self._seen[id(tensor)] = (weakref.ref(tensor), tensor._version)

    def _make_hook(self, slot: int, mode: int, leaf: bool):
        is_compiling = torch.compiler.is_compiling
        add, unchecked = self._add, self._unchecked

        def hook(module, args, output):
            if is_compiling():
                # Inside a compiled graph only tensor math and list appends (no graph break),
                # and only leaves: without identity tracking a container would re-check.
                if mode == CHECK_MODE and leaf:
                    for tensor in floating_tensors(output):
                        self._vals.append(probe(tensor))
                        self._meta.append((OUT, slot, None, _COMPILED, None, None, False))
                return None
            outputs = floating_tensors(output)
            if mode == SKIP_MODE:
                self._mark_seen(outputs)
                return None
            for tensor in unchecked(floating_tensors(args)):
                add(tensor, IN, slot)
            if mode == PASS_MODE:
                self._mark_seen(outputs)
            else:
                for tensor in unchecked(outputs):
                    add(tensor, OUT, slot)
            return None

        return hook

    def _make_root_pre(self, root_slot: int):
        def root_pre(module, args, kwargs):
            # A root compiled in place (module.compile()) runs its hooks inside the graph: leave
            # out the bookkeeping there, Dynamo would recompile on every new micro-batch number.
            if not torch.compiler.is_compiling():
                self.root_pre(root_slot, args, kwargs)
            return None

        return root_pre

    def root_pre(self, root_slot: int, args: tuple, kwargs: dict) -> None:
        """A root forward begins: a new micro-batch, whose inputs (the batch) are probed."""
        if not self._spans and self.on_step_start is not None:
            self.on_step_start()
        micro_batch = self._forwards.get(root_slot, 0)
        self._forwards[root_slot] = micro_batch + 1
        self._spans.append((len(self._meta), root_slot, micro_batch))
        if self.keep_batches:
            self.batches.append((root_slot, args, kwargs))
        for tensor in self._unchecked(floating_tensors(args) + floating_tensors(kwargs)):
            self._add(tensor, BATCH, root_slot, lazy=True)

    def slot_of(self, module: nn.Module) -> int:
        return self._modules[module]

    def _make_root_post(self, root_slot: int):
        def root_post(module, args, kwargs, output):
            if self.on_root_end is not None and not torch.compiler.is_compiling():
                self.on_root_end()
            return None

        return root_post

    def check(self, tensor: torch.Tensor, name: str) -> None:
        index = self._check_names.get(name)
        if index is None:
            if len(self._check_names) >= _MAX_CHECK_NAMES:
                name = "(other)"
            index = self._check_names.setdefault(name, len(self._check_names))
        if tensor.is_floating_point() or tensor.is_complex():
            self._add(tensor, CHECK, index)

    # ------------------------------------------------------------------ decision support
    @property
    def pending(self) -> int:
        return len(self._vals)

    @property
    def probes(self) -> list[torch.Tensor]:
        """This step's probes, oldest first (the guard stacks and reads them)."""
        return self._vals

    def reset(self) -> None:
        """Forget this step's probes (after a decision)."""
        self._vals.clear()
        self._meta.clear()
        self._bucket_vals.clear()
        self.batches.clear()
        self._spans.clear()
        self._seen.clear()
        self._kept_bytes = 0
        self._forwards.clear()

    def micro_batch_of(self, index: int) -> int | None:
        """Which forward of its root (within the step) the probe ``index`` was made in."""
        position = bisect_right(self._spans, (index, math.inf, math.inf)) - 1
        return self._spans[position][2] if position >= 0 else None

    def first_bad(self, values: list[float]) -> dict[str, Any] | None:
        """Event fields of the step's first non-finite probe, confirmed exactly; slow.

        ``values`` are the probes as read by the guard, in order.
        """
        return self._scan(values, self._meta)

    def _scan(self, values: list[float], meta: list[tuple]) -> dict[str, Any] | None:
        for index, value in enumerate(values):
            role, slot, ref, version, shape, dtype, lazy = meta[index]
            if math.isfinite(value) and not lazy:
                continue
            tensor = ref() if isinstance(ref, weakref.ref) else ref
            if tensor is not None and tensor._version != version:
                tensor = None  # changed in place since: its content is no longer what was probed
            if tensor is not None:
                stats = forensics.describe(tensor)
                if not stats["bad_count"]:
                    continue  # lazy and finite, or a float32 sum that overflowed on finite values
            elif lazy:
                continue  # changed in place since it was kept: nothing to tell
            else:
                stats = {"has_nan": math.isnan(value), "has_inf": not math.isnan(value)}
                if shape is not None:
                    stats |= {"shape": tuple(shape), "numel": math.prod(shape),
                              "dtype": str(dtype).removeprefix("torch.")}
            return self._explain(index, role, slot, stats, values)
        return None

    def _explain(self, index: int, role: int, slot: int, stats: dict[str, Any],
                 values: list[float]) -> dict[str, Any]:
        micro_batch = self.micro_batch_of(index)
        fields: dict[str, Any] = {"micro_batch": micro_batch, **stats}
        unexact = "bad_count" not in stats
        if unexact:
            fields["message"] = ("no element detail: the tensor was freed and lay beyond the"
                                 " step's detail_mb budget (raise detail_mb to keep it)")
        if role == CHECK:
            name = next(n for n, i in self._check_names.items() if i == slot)
            return fields | {"kind": "loss" if name == "loss" else "check", "layer": name,
                             "micro_batch": None}
        info = self.slots[slot]
        fields |= {"layer": info.name, "module_type": info.module_type}
        later_out = [i for i in range(index + 1, len(values)) if self._meta[i][0] == OUT]
        bad_out = next((i for i in later_out if not math.isfinite(values[i])), None)
        if role == OUT and self._meta[index][3] == _COMPILED:
            return fields | {"kind": "forward", "input_nonfinite": None, "output_nonfinite": True,
                             "message": _join(
                                 "first non-finite module output seen in a compiled graph, where"
                                 " inputs and containers are not checked: it may have been born just"
                                 " before this module", fields.get("message"))}
        if role == OUT:
            note = "inputs were finite: the value was born in this module"
            module = info.module()
            # all of its parameters: nn.MultiheadAttention uses out_proj's weight without calling it
            bad_params = [n for n, p in (module.named_parameters() if module else [])
                          if not forensics.is_finite(p)]
            if bad_params:
                note = f"inputs were finite but its parameter(s) {', '.join(bad_params)} are not"
            return fields | {"kind": "forward", "input_nonfinite": False, "output_nonfinite": True,
                             "message": _join(note, fields.get("message"))}
        same_call_bad = bad_out is not None and self._meta[bad_out][1] == slot
        if role == IN:
            before = [self.slots[m[1]].name for m in self._meta[:index] if m[0] == OUT]
            parent = _common_parent(info.name, before[-1] if before else "")
            where = f"the forward code of {parent or 'the root module'}"
            return fields | {"kind": "forward", "input_nonfinite": True,
                             "output_nonfinite": same_call_bad, "message": _join(
                                 "its input was already non-finite: the value was born outside any"
                                 f" module, in {where} (before this module ran)", fields.get("message"))}
        # BATCH: the root's own inputs; name the first module the bad batch reached
        if bad_out is not None:
            first = self.slots[self._meta[bad_out][1]]
            fields |= {"layer": first.name, "module_type": first.module_type}
        return fields | {"kind": "forward", "input_nonfinite": True,
                         "output_nonfinite": bad_out is not None, "message": _join(
                             f"the input batch of {info.name or 'the model'} was already non-finite",
                             fields.get("message"))}

    def backward_order(self) -> list[int]:
        """Module slots in the order their gradients are produced: reverse of execution order."""
        order: dict[int, None] = {}
        for role, slot, *_ in self._meta:
            if role in (OUT, IN):
                order.setdefault(slot, None)
        return list(reversed(order))


def _join(*parts: str | None) -> str:
    return "; ".join(p for p in parts if p)


def _common_parent(name: str, previous: str) -> str:
    """The innermost module containing both names (whose forward code ran between them)."""
    own = name.split(".")[:-1]
    other = previous.split(".")[:-1] if previous else own
    common = []
    for a, b in zip(own, other):
        if a != b:
            break
        common.append(a)
    return ".".join(common)


def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` of 0-d tensors that may sit on several devices (pipeline stages)."""
    try:
        return torch.stack(tensors)
    except RuntimeError:
        device = tensors[0].device
        return torch.stack([t.to(device, non_blocking=True) for t in tensors])


def gradients(params: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters that have a gradient, their gradients as plain dense tensors)."""
    owners, grads = [], []
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse:
            grad = grad.coalesce().values()
        owners.append(param)
        grads.append(forensics.plain(grad))
    return owners, grads


def grad_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-gradient L2 norms from one fused pass (no host sync); non-finite when a gradient
    element is, or when a norm overflows on finite values (the caller confirms exactly)."""
    return list(torch._foreach_norm(grads))
