"""The replayed step under a dispatch mode: the first ATen operations whose output is non-finite
while their inputs were finite, forward and backward.

Each is named (``aten::log``), with the user's line that called it (frames of torch, nanguard and
Python left out), the module it ran in and its inputs' ranges. In backward the operation runs
inside an autograd node: the report names the node, the module whose forward made it (tagged in
the node's metadata as each module's forward ends) and, from anomaly mode's forward traceback,
the forward line that created it. Anomaly mode runs with ``check_nan=False`` for this one step: the
replay must finish and report, not raise inside ``loss.backward()``.

Slow on purpose (one device sync per operation); used for the replayed step only.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

from .._torch import current_autograd_node
from .._tree import floating_tensors
from ..rank import forensics
from ..rank.modules import plain_names, type_name
from .frames import NANGUARD, anomaly_frames, calling_frames
from .operands import base_name, describe_input, why

LIMIT = 4
"""operations kept per phase and kind (those that made a NaN, those that made infinities alone): the
first ones are what matter, and harmless infinities (T5's log of a zero distance, discarded) must not
crowd out the NaN"""
_MODULE_KEY = "nanguard_module"  # in an autograd node's metadata: (name, type) of the module that made it
_MAX_INPUTS = 8
_KEEP_BYTES = 16 << 20  # an in-place operation's input is copied, to be described, up to this size
# outputs that hold whatever the memory held: never judged (with any overload: empty.memory_format)
_UNINITIALISED = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                  "aten::new_empty_strided", "aten::empty_permuted", "aten::resize_", "aten::resize_as_",
                  "aten::set_"}
# a collective's output may still be in flight, and a value it brings came from another rank
_COLLECTIVES = {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor"}
# in-place operations whose old value of ``self`` is not one of their inputs
_OVERWRITES = {"copy", "fill", "zero", "uniform", "normal", "bernoulli", "random", "exponential",
               "geometric", "cauchy", "log_normal", "index_put", "masked_scatter", "set", "resize"}


class _Mode(TorchDispatchMode):
    def __init__(self, watch: OpWatch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.watch.on_op(func, args, kwargs or {})


def _first_bad(out: Any) -> torch.Tensor | None:
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and not forensics.is_finite(leaf):
            return leaf
    return None


class _Unkept:
    """An overwritten input too big to copy: only whether it was finite."""

    def __init__(self, finite: bool):
        self.finite = finite


def _finite(value: Any) -> bool:
    if isinstance(value, _Unkept):
        return value.finite
    if isinstance(value, torch.Tensor):
        return forensics.is_finite(value)
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, complex):
        return math.isfinite(value.real) and math.isfinite(value.imag)
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


class OpWatch:
    """Watches every ATen operation between ``start()`` and ``stop()``; ``result()`` for the report.
    ``micro_batch(module)`` says which forward of the model (of ``module``'s) is running."""

    def __init__(self, micro_batch: Callable[[str | None], int]):
        self.micro_batch = micro_batch
        self.records: dict[str, list[dict[str, Any]]] = {"forward": [], "backward": []}
        self._kept = {(phase, nan): 0 for phase in self.records for nan in (False, True)}
        """operations kept by (phase, made a NaN)"""
        self.checked = 0
        self.skipped: set[str] = set()
        """names of modules whose outputs may be non-finite on purpose (skip_types, skip_modules)"""
        self._stack: list[tuple[str, str, dict[int, Any]]] = []
        self._mode: _Mode | None = None
        self._anomaly: Any = None
        self._paused = False
        self._numbers: dict[int, weakref.ref] = {}
        """non-finite tensors the code wrote as numbers (``torch.tensor(nan)``, ``x[0] = nan``: lifted)"""

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Operations run inside are not judged: nanguard's own looks at tensors (the trace)."""
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused

    # ------------------------------------------------------------------ the modules
    def install(self, root: nn.Module, skipped: set[str], prefix: str = "") -> list[Any]:
        """Hooks that keep the stack of running modules (named after ``prefix``) and tag the
        autograd nodes each one makes; ``skipped``: the names of those not judged."""
        self.skipped |= skipped
        handles = []
        for module, name in plain_names(root, prefix).items():
            handles.append(module.register_forward_pre_hook(self._enter(name, type_name(module)),
                                                            with_kwargs=True))
            handles.append(module.register_forward_hook(self._leave(name), with_kwargs=True,
                                                        always_call=True))
        return handles

    def _enter(self, name: str, kind: str):
        def hook(module, args, kwargs):
            inputs = {id(t.grad_fn): t.grad_fn for t in floating_tensors((args, kwargs)) if t.grad_fn is not None}
            self._stack.append((name, kind, inputs))

        return hook

    def _leave(self, name: str):
        def hook(module, args, kwargs, output):
            if self._stack and self._stack[-1][0] == name:
                _, kind, inputs = self._stack.pop()
                if torch.is_grad_enabled():
                    _tag(output, inputs, (name, kind))

        return hook

    # ------------------------------------------------------------------ the mode
    def start(self) -> None:
        if self._mode is None:
            self._anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False)
            self._mode = _Mode(self)
            self._mode.__enter__()

    def stop(self) -> list[str]:
        """Leaves the mode and anomaly mode; notes when something else was left on top of it."""
        notes = []
        if self._mode is not None:
            if _get_current_dispatch_mode() is self._mode:
                self._mode.__exit__(None, None, None)
            else:
                notes.append("another dispatch mode entered during the step was still active at its end;"
                             " the operation check stayed on under it")
            self._anomaly.__exit__(None, None, None)
            self._mode = None
        return notes

    def result(self) -> dict[str, Any]:
        return {"forward": self.records["forward"], "backward": self.records["backward"],
                "operations_checked": self.checked, "limit": LIMIT}

    # ------------------------------------------------------------------ each operation
    def on_op(self, func, args: tuple, kwargs: dict) -> Any:
        name = func.name()
        if (self._paused or name.partition(".")[0] in _UNINITIALISED or func.namespace in _COLLECTIVES
                or all(count >= LIMIT for count in self._kept.values())):
            return func(*args, **kwargs)
        before = _before(func, args, kwargs)
        out = func(*args, **kwargs)
        self.checked += 1
        bad = _first_bad(out)
        if bad is not None and name.startswith("aten::lift_fresh"):
            self._numbers[id(bad)] = weakref.ref(bad)  # a number of the code's, made a tensor
        elif bad is not None:
            self._judge(func, name, args, kwargs, before, bad)
        return out

    def _number(self, value: Any) -> bool:
        """A NaN the code gave as a number: a Python float, or a tensor lifted from one."""
        if isinstance(value, float):
            return math.isnan(value)
        ref = self._numbers.get(id(value)) if isinstance(value, torch.Tensor) else None
        return ref is not None and ref() is value and bool(torch.isnan(value).all())

    def _judge(self, func, name: str, args: tuple, kwargs: dict, before: dict[str, Any],
               bad: torch.Tensor) -> None:
        node = current_autograd_node()
        phase = "forward" if node is None else "backward"
        if self._kept[phase, False] >= LIMIT and self._kept[phase, True] >= LIMIT:
            return
        inputs = _inputs(func, args, kwargs, before)
        written = _nan_written(func, inputs, self._number)
        if written is None and not all(_finite(value) for _, value in inputs):
            return  # it passed a non-finite value on: not where it was made
        nan = bool(torch.isnan(bad).any())
        if self._kept[phase, nan] >= LIMIT:
            return
        who, frames = calling_frames()
        if who == NANGUARD:
            return  # nanguard's own bookkeeping (a probe's sum of huge finite values)
        module, kind = self._module(node)
        if module is not None and module in self.skipped:
            return
        described = [d for d in (describe_input(n, v) for n, v in inputs[:_MAX_INPUTS]) if d is not None]
        record = {"op": name, "phase": phase, "micro_batch": self.micro_batch(module), "module": module,
                  "module_type": kind, "inputs": described,
                  "why": f"{written} is NaN, a number the code gave it to write" if written else why(
                      name, described, bad.dtype),
                  "output": forensics.describe(bad)}
        if node is None:
            record.update(source=frames[0] if frames else None, stack=frames)
        else:
            record.update(_backward_fields(node, frames))
        self.records[phase].append(record)
        self._kept[phase, nan] += 1

    def _module(self, node: Any) -> tuple[str | None, str | None]:
        if node is None:
            return (self._stack[-1][0], self._stack[-1][1]) if self._stack else (None, None)
        tag = node.metadata.get(_MODULE_KEY)
        return tag if tag is not None else (None, None)


def _backward_fields(node: Any, frames: list[dict[str, Any]]) -> dict[str, Any]:
    custom = isinstance(node, BackwardCFunction)
    forward = anomaly_frames(node.metadata.get("traceback_"))
    return {"node": node.name(), "custom_backward": custom,
            # a custom Function's backward is the user's code; a built-in node's Python stack is
            # only the line that called backward()
            "source": frames[0] if custom and frames else None,
            "backward_call": None if custom or not frames else frames[0],
            "forward_source": forward[0] if forward else None, "stack": forward}


def _tag(output: Any, inputs: dict[int, Any], tag: tuple[str, str]) -> None:
    """Marks the autograd nodes made inside a module's forward (from its outputs back to its
    inputs' nodes) with the module, unless an inner module marked them first."""
    todo = [t.grad_fn for t in floating_tensors(output) if t.grad_fn is not None]
    seen: set[int] = set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in inputs:
            continue
        seen.add(id(node))
        node.metadata.setdefault(_MODULE_KEY, tag)
        todo.extend(next_node for next_node, _ in node.next_functions)


def _arguments(func, args: tuple, kwargs: dict):
    for index, argument in enumerate(func._schema.arguments):
        if index < len(args):
            yield argument, args[index]
        elif argument.name in kwargs:
            yield argument, kwargs[argument.name]


def _nan_written(func, inputs: list[tuple[str, Any]], number: Callable[[Any], bool]) -> str | None:
    """The input that the code gave as a NaN number (``number``) to an operation that writes into
    a tensor in place, its other inputs finite (``grad[0] = float("nan")`` in a custom backward):
    it put the NaN there. A NaN number given to an operation that makes a new tensor
    (``torch.full(shape, nan)``, a placeholder filled in later) is not blamed, nor an infinity (an
    additive mask's -inf)."""
    if not any(a.alias_info is not None and a.alias_info.is_write and not a.is_out for a in func._schema.arguments):
        return None
    numbers = [name for name, value in inputs if number(value)]
    return numbers[0] if numbers and all(_finite(v) for n, v in inputs if n not in numbers) else None


def _written(func, argument) -> bool:
    """An argument the operation changes in place whose old value it reads."""
    return (argument.alias_info is not None and argument.alias_info.is_write and not argument.is_out
            and base_name(func.name()) not in _OVERWRITES)


def _before(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The inputs an operation will overwrite, as they are before it runs: a copy when small,
    else only whether they are finite."""
    kept: dict[str, Any] = {}
    for argument, value in _arguments(func, args, kwargs):
        if _written(func, argument) and isinstance(value, torch.Tensor):
            small = value.numel() * value.element_size() <= _KEEP_BYTES
            kept[argument.name] = value.detach().clone() if small else _Unkept(_finite(value))
    return kept


def _inputs(func, args: tuple, kwargs: dict, before: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, value) of every input an operation read: out= arguments left out, overwritten ones
    as they were before it ran, lists of tensors one by one."""
    found: list[tuple[str, Any]] = []
    for argument, value in _arguments(func, args, kwargs):
        if argument.is_out or (argument.alias_info is not None and argument.alias_info.is_write
                               and argument.name not in before):
            continue
        value = before.get(argument.name, value)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            found += [(f"{argument.name}[{i}]", v) for i, v in enumerate(value)]
        else:
            found.append((argument.name, value))
    return found
