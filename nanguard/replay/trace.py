"""The replay's synchronous trace: every module output, every gradient flowing back into a
module's output and every parameter gradient, checked exactly as it happens (slow: the replay
runs one step)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._tree import floating_tensors
from ..rank import forensics
from ..rank.modules import plain_names, untraced

_TRACE_LIMIT = 16  # records per trace list: the first ones are what matter


class Trace:
    """The first bad values of the step, forward and backward. ``micro_batch(name)`` says which
    forward of the model (of the one holding module or parameter ``name``) is running; ``quiet()``
    is the context its own checks run in (so that the operation check does not judge them)."""

    def __init__(self, micro_batch: Callable[[str | None], int],
                 quiet: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.records: dict[str, list[dict[str, Any]]] = {"forward": [], "gradients": []}
        self.micro_batch = micro_batch
        self.quiet = quiet

    def install(self, root: nn.Module, param_names: dict[int, str], prefix: str = "") -> list[Any]:
        """Hook every module of ``root`` (its names after ``prefix``) and every trainable parameter;
        returns the handles."""
        handles = []
        traced = set()
        for module, name in plain_names(root, prefix).items():
            if name not in traced:  # a wrapper (DDP) and the model it wraps share one name
                traced.add(name)
                handles.append(module.register_forward_hook(untraced(self._forward_hook(name)), with_kwargs=True))
        for param in root.parameters():
            if param.requires_grad:
                handles.append(param.register_post_accumulate_grad_hook(
                    self._param_hook(param_names.get(id(param), "?"))))
        return handles

    def record(self, kind: str, entry: dict[str, Any]) -> None:
        records = self.records[kind]
        if len(records) < _TRACE_LIMIT:
            records.append(entry)

    def bad_batch(self, batch: Any, index: int) -> None:
        """Note a captured micro-batch that is itself non-finite."""
        with self.quiet():
            bad = next((t for t in floating_tensors(batch) if not forensics.is_finite(t)), None)
            if bad is not None:
                self.record("forward", {"module": "<the captured batch>", "module_type": "input",
                                        "micro_batch": index, "inputs_finite": False,
                                        "output": forensics.describe(bad)})

    def _forward_hook(self, name: str):
        def hook(module, args, kwargs, output):  # (a module called by keyword, as transformers calls attention)
            outputs = floating_tensors(output)
            with self.quiet():
                bad = next((t for t in outputs if not forensics.is_finite(t)), None)
                if bad is not None and len(self.records["forward"]) < _TRACE_LIMIT:
                    self.record("forward", {
                        "module": name, "module_type": type(module).__name__, "micro_batch": self.micro_batch(name),
                        "inputs_finite": all(forensics.is_finite(t) for t in floating_tensors((args, kwargs))),
                        "output": forensics.describe(bad)})
            if torch.is_grad_enabled():
                for tensor in outputs:
                    if tensor.requires_grad:
                        tensor.register_hook(self._grad_hook(name))
            return None

        return hook

    def _grad_hook(self, name: str):
        def hook(grad):
            with self.quiet():
                if len(self.records["gradients"]) < _TRACE_LIMIT and not forensics.is_finite(grad):
                    self.record("gradients", {"gradient_of": f"output of {name or 'the model'}",
                                              "micro_batch": self.micro_batch(name), **forensics.describe(grad)})
            return None

        return hook

    def _param_hook(self, name: str):
        def hook(param):
            with self.quiet():
                if (len(self.records["gradients"]) < _TRACE_LIMIT and param.grad is not None
                        and not forensics.is_finite(param.grad)):
                    self.record("gradients", {"gradient_of": f"parameter {name}",
                                              "micro_batch": self.micro_batch(name),
                                              **forensics.describe(param.grad)})

        return hook
