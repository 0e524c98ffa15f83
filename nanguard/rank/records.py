"""What the hooks leave behind: the catalogue of guarded modules, and one step's probe records.

The detector writes these; the decision reads the probes' values once per step; the diagnosis
turns the records of a bad step into an Event. Plain data, no hooks, no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from operator import methodcaller
import weakref
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._torch import any_autocast_enabled
from .._torch import set_grad_enabled as _set_grad_enabled
from ..incident.rng import cuda_in_use
from .places import Slots

_UNTRACKED = itertools.count(-1, -1)
_clear = methodcaller("clear")


def version_of(tensor: torch.Tensor) -> int:
    """A tensor's in-place version. An inference tensor (made under ``torch.inference_mode``)
    keeps none: it gets a new negative number at every call, so it is never taken as unchanged
    since it was probed (it is probed again, and never described as if it were the same)."""
    try:
        return tensor._version
    except RuntimeError:
        return next(_UNTRACKED)


def gradless(op, *args, **kwargs):
    """``op(*args, **kwargs)`` with autograd off, as ``torch.no_grad()`` would run it: that context
    manager costs several us inside a training step here, more than many of the ops it guards."""
    if not torch.is_grad_enabled():
        return op(*args, **kwargs)
    _set_grad_enabled(False)
    try:
        return op(*args, **kwargs)
    finally:
        _set_grad_enabled(True)


def changed_since(versions: dict[str, tuple[int, int]], name: str, tensor: torch.Tensor) -> bool:
    """Whether ``tensor``, known as ``name``, was written or replaced since ``versions`` (its
    (``version_of``, id) then) were taken; False for a name they do not hold."""
    then = versions.get(name)
    return then is not None and then != (version_of(tensor), id(tensor))


OUT, IN, BATCH, CHECK, LINK = range(5)
"""what a probe looked at: a module's output, a module's input that nothing had checked (or a value
it passed on), the batch given to a root module, a tensor given to ``Guard.check``; a LINK is no
probe: a module took a value already probed as evidence (``same_as``), read from there. OUT and
CHECK probes can stop a step; IN and BATCH probes are evidence of where a value came from"""
MAX_CHECK_NAMES = 1024


@dataclass(slots=True)
class Slot:
    """One guarded module: its name as reports show it."""

    name: str
    module_type: str
    module: weakref.ref
    container: bool = False
    """has children: its own parameters (a ViT's cls_token) are used where its forward begins"""


@dataclass(slots=True)
class Probe:
    """One checked tensor of the step. ``kept`` is the tensor itself while the detail budget
    lasts, else a weak reference (None inside a compiled graph, or once a clean forward on the CPU
    let it go); ``version`` is its in-place version when probed, so a tensor changed since is not
    described as if it were the same."""

    role: int
    slot: int
    """the module's slot (OUT, IN, BATCH), or the index of the check's name (CHECK)"""
    kept: Any
    version: int = 0
    shape: torch.Size | None = None
    dtype: torch.dtype | None = None
    lazy: bool = False
    """the batch: its probe is a zero, checked exactly only once the step is known bad"""
    compiled: bool = False
    """made inside a compiled graph, where inputs and containers are not checked"""
    field: str | None = None
    """where in a root's output the tensor was ("loss"), when that output is a container"""
    check: int | None = None
    """the index of the name ``Guard.check`` later gave this same tensor (a loss the model returned)"""
    pos: int = -1
    """where its (minimum, maximum) are in ``StepLog.values`` (OUT and CHECK probes)"""
    passed: bool | None = False
    """an IN probe of a value the module passed on, probed as it left the module: True, as it came
    (a finite-preserving module, a dropout that returned its input), so non-finite here was
    non-finite before the module; None, its input tensor itself, maybe changed in place here (born
    here or before, unknown which). Evidence, as every IN probe: an additive -inf mask is passed on
    on purpose, and only a module that makes a non-finite output of it stops a step"""
    same_as: int = -1
    """a LINK's record: the evidence probe of the value this call took; a value passed on changed
    in place: the probe of that tensor before"""
    call: int = 0
    """how many module calls of the step had returned when it was made (``StepLog.calls``): its place
    in the step's program, the same on every rank of a model whatever the values (a module that
    returns its input makes no probe, one that makes a NaN does)"""

    def held(self) -> torch.Tensor | None:
        """The probed tensor if it is still there, changed since or not."""
        return self.kept() if isinstance(self.kept, weakref.ref) else self.kept

    def tensor(self) -> torch.Tensor | None:
        """The probed tensor as it was, or None (freed, or changed in place since)."""
        tensor = self.held()
        if tensor is not None and version_of(tensor) != self.version:
            return None
        return tensor


@dataclass(slots=True)
class Catalog:
    """Every module, parameter and check name a guard knows; grows as models are attached."""

    slots: list[Slot] = field(default_factory=list)
    param_names: dict[int, str] = field(default_factory=dict)
    """qualified parameter names by ``id(param)``, of live parameters only (``name_param``)"""
    param_holders: dict[int, list[int]] = field(default_factory=dict)
    """the slots of every module that holds a parameter directly, by ``id(param)``, its owner (the
    first attached) first: a tied weight is the embedding's and the output layer's"""
    check_names: dict[str, int] = field(default_factory=dict)
    _refs: dict[int, weakref.ref] = field(default_factory=dict)

    def name_param(self, param: torch.Tensor, name: str, holder: int | None = None, first: bool = False) -> None:
        """Name ``param`` (``first``: unless it has a name already), held by module slot ``holder``.
        Its entries go when it is freed: a tensor that takes its id later (a model built after
        another was let go, in a sweep) never inherits its name, nor its holders."""
        key = id(param)
        ref = self._refs.get(key)
        if ref is None or ref() is not param:
            self.param_names.pop(key, None)
            self.param_holders.pop(key, None)
            self._refs[key] = weakref.ref(param, _forget(self, key))
        if first:
            self.param_names.setdefault(key, name)
        else:
            self.param_names[key] = name
        if holder is not None:
            self.param_holders.setdefault(key, []).append(holder)

    def check_index(self, name: str) -> int:
        index = self.check_names.get(name)
        if index is None:
            if len(self.check_names) >= MAX_CHECK_NAMES:
                name = "(other)"  # bounded: a name per step would grow without end
            index = self.check_names.setdefault(name, len(self.check_names))
        return index

    def check_name(self, index: int) -> str:
        return next(name for name, i in self.check_names.items() if i == index)

    def param_name(self, param: torch.Tensor) -> str:
        name = self.param_names.get(id(param))
        return name if name is not None else f"<unnamed parameter of shape {list(param.shape)}>"


def _forget(catalog: Catalog, key: int):
    """The callback of a parameter's weak reference: its entries go with it."""
    def forget(ref: weakref.ref) -> None:
        if catalog._refs.get(key) is ref:
            del catalog._refs[key]
            catalog.param_names.pop(key, None)
            catalog.param_holders.pop(key, None)

    return forget


_AUTOCAST_DEVICES = ("cpu", "cuda")
_any_autocast = any_autocast_enabled
_default_generator = torch.default_generator
"""(one call, where asking each device costs a few us on every micro-batch)"""


@dataclass(slots=True)
class Context:
    """What a re-run of one micro-batch needs beside its arguments, taken as its forward began."""

    module: weakref.ref | None
    """the module the script called (a root, or the model its DDP wraps); None: no module to call"""
    torch_rng: torch.Generator
    """torch's CPU random state (a cloned generator: a few us, where the state tensor costs more)"""
    cuda_rng: list[torch.Tensor]
    """each CUDA device's random state, where CUDA is in use"""
    autocast: tuple[tuple[str, torch.dtype], ...]
    """(device type, dtype) of each autocast in force"""
    grad: bool
    micro_batch: int = -1
    """the micro-batch it began (-1: a call of no micro-batch)"""
    forward: Any = None
    """the forward the module held as an attribute of its own then (Lightning's DDP strategy points a
    LightningModule's ``forward`` at its ``training_step`` for the call), else None"""
    handed: dict[str, torch.Tensor] | None = None
    """the weights it ran with in the place of its own (``torch.func.functional_call``), else None"""

    @classmethod
    def now(cls, module: nn.Module | None, micro_batch: int = -1, called: nn.Module | None = None,
            handed: dict[str, torch.Tensor] | None = None) -> Context:
        """``called``: the module whose forward runs (the model a DDP wraps), where not ``module``."""
        autocast = tuple((device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
                         if torch.is_autocast_enabled(device)) if _any_autocast() else ()
        runs = called if called is not None else module
        return cls(weakref.ref(module) if module is not None else None, _default_generator.clone_state(),
                   list(torch.cuda.get_rng_state_all()) if cuda_in_use() else [], autocast, torch.is_grad_enabled(),
                   micro_batch, runs.__dict__.get("forward") if runs is not None else None, handed)

    @property
    def rng(self) -> dict[str, Any]:
        """The random states as ``rng_snapshot(host=False)`` gives them."""
        return {"python": None, "numpy": None, "torch": self.torch_rng, "cuda": self.cuda_rng}


@dataclass(slots=True)
class StepLog:
    """One step's probes, in the order they were made, until its decision."""

    values: list[torch.Tensor] = field(default_factory=list)
    """(minimum, maximum) of every OUT and CHECK probe, flattened: 0-d device tensors, non-finite
    when their tensor is (read once, by the decision)"""
    evidence: list[torch.Tensor] = field(default_factory=list)
    """the same for IN probes: read with the rest, but never a reason to stop"""
    records: list[Probe] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    """(first probe index, root slot, micro-batch) of every root forward"""
    span_ends: dict[int, int] = field(default_factory=dict)
    """the probe index where the forward of ``spans[k]`` returned, by k (when its end was seen)"""
    recomputed: list[int] = field(default_factory=list)
    """the probe indexes where module calls began and stopped being made inside a backward pass
    (activation checkpointing runs forwards again there), alternately"""
    buckets: list[torch.Tensor] = field(default_factory=list)
    """probes of the gradients before they are summed across ranks (DDP buckets, FSDP2 reduce-scatters)"""
    bucket_groups: list[str] = field(default_factory=list)
    """for FSDP2, the ``fully_shard``-ed module whose gradients each of ``buckets``' pairs probed"""
    bucket_passes: list[int] = field(default_factory=list)
    """how many ``buckets`` probes there were when each backward pass that made some ended: with
    several passes in a step (accumulation without ``no_sync``), a later pass's buckets hold the
    gradients an earlier pass's all-reduce brought in"""
    unpropagated: set[int] = field(default_factory=set)
    """root forwards of the step (``spans`` indexes) whose output has not been backpropagated yet:
    one still there at the decision was dropped by the script (its own check of the loss, before
    its backward pass), and no update comes from it"""
    summed_after: list[torch.Tensor] = field(default_factory=list)
    """the largest gradient norm after the sum across ranks of each backward pass but the last of
    those (``bucket_passes``), taken as the next forward begins: read only when the step is bad, to
    tell gradients a sum made non-finite from those a rank's own backward made"""
    batches: list[tuple[int, tuple, dict, list[tuple[torch.Tensor, int]]]] = field(default_factory=list)
    """(root slot, args, kwargs, (tensor, ``version_of``) of each tensor in them) of every root
    forward: references, no copies; the versions tell a tensor refilled in place since (a static
    input buffer) from what the forward was fed"""
    contexts: list[Context] = field(default_factory=list)
    """what a re-run of each of ``batches`` needs beside its arguments (``microscope.Context``): the
    module called, the RNG, autocast and grad mode as its forward began (sentinel mode)"""
    parts: list[tuple[int, tuple, dict, list[tuple[torch.Tensor, int]], Context]] = field(default_factory=list)
    """(the ``spans`` index of the micro-batch the script began itself that it belongs to, or -1; args,
    kwargs, their tensors' versions, ``Context``) of each call of a root's child that the script
    made itself, outside any root forward (a GAN's ``ModuleDict``, a LightningModule's training_step):
    references, for the microscope (``hooks.MAX_PARTS`` a step at most)"""
    parts_over: int = 0
    """calls of the model's parts beyond ``MAX_PARTS`` in this step: not held, so not re-run"""
    parts_unchecked: int = 0
    """calls of the model's parts the script made with autograd off in this step (an EMA teacher's
    targets): neither checked nor re-run"""
    handed: list[tuple[weakref.ref, dict[str, torch.Tensor]]] = field(default_factory=list)
    """(the module, the weights by name) of each call of a guarded module run with weights it was handed
    (``torch.func.functional_call``), by reference (``hooks.MAX_PARTS`` a step at most)"""
    outputs: dict[int, list[tuple[torch.Tensor, int]]] = field(default_factory=dict)
    """references to each root forward's floating outputs (with ``version_of``), by ``spans`` index,
    where they fit in the detail budget: whether the original forward made them non-finite is told
    exactly on a bad step only (sentinel mode)"""
    output_grads: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    """(index in ``floating_tensors(output)``, the gradient that reached it) of each root forward's
    output whose backward pass ran, by ``spans`` index, where it fits in the detail budget: the
    microscope re-runs the backward from there (sentinel mode)"""
    produced: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = None
    """(parameters, the norms of their gradients) as the last backward pass left them; the norms are None
    while put off (``BackwardWatch.settle`` measures them before the decision)"""
    unmeasured: bool = False
    """the last pass's norms were put off, and the loop changed its gradients before the decision: how that
    pass left them is not known (``BackwardWatch.settle``)"""
    left: tuple[list[torch.Tensor], list[torch.Tensor], list[int]] | None = None
    """(the parameters, each one's gradient, its in-place version) then: the optimizer applies what the norms
    measured only while each is the same tensor, unchanged (not summed across ranks, clipped,
    unscaled or divided since)"""
    loss_at: int | None = None
    """where the tensor checked as "loss" is in ``values``, for the flight recorder"""
    value_slots: Slots = field(default_factory=Slots)
    """where the probes of ``values`` write, when they can (see Slots)"""
    evidence_slots: Slots = field(default_factory=Slots)
    calls: int = 0
    """module calls of the step that have returned (their forward hooks)"""
    started: bool = False
    """the step's first forward began (``Detector.step_starts``)"""
    trained: bool = False
    """a root forward with autograd on began in this step (else its forwards so far were an evaluation)"""
    buffers_at_start: dict[str, torch.Tensor] = field(default_factory=dict)
    """copies of the buffers the step may write, as they were when it began, by qualified name
    (``Buffers.kept``)"""
    buffer_versions: dict[str, tuple[int, int]] = field(default_factory=dict)
    """(``version_of``, id) of every buffer when the step began: one not kept is as it began unless
    these moved (a buffer first written in this step, or changed between its micro-batches)"""

    def clear(self) -> None:
        # (one call over them all, where a loop of Python lines is most of what a clean step's reset costs)
        deque(map(_clear, (self.values, self.evidence, self.records, self.spans, self.span_ends, self.recomputed,
                           self.buckets, self.bucket_groups, self.bucket_passes, self.summed_after, self.batches,
                           self.unpropagated, self.contexts, self.parts, self.outputs, self.output_grads,
                           self.handed)), 0)
        self.value_slots.clear()
        self.evidence_slots.clear()
        self.produced = self.left = self.loss_at = None
        self.calls = self.parts_over = self.parts_unchecked = 0
        self.started = self.trained = self.unmeasured = False
        self.buffers_at_start, self.buffer_versions = {}, {}

    def forget_probes(self) -> None:
        """Forget the probes made so far (a re-run's that failed), keeping what else the step left."""
        for part in (self.values, self.evidence, self.records, self.span_ends, self.recomputed):
            part.clear()
        self.value_slots.clear()
        self.evidence_slots.clear()
        self.loss_at = None

    def extremes(self, probes: list[float], evidence: list[float]) -> list[tuple[float, float] | None]:
        """Each record's (minimum, maximum) as read, by record: None for the batch (never read)."""
        positions = {OUT: 0, IN: 0}  # OUT and CHECK share one list
        out: list[tuple[float, float] | None] = []
        for record in self.records:
            if record.role == BATCH:
                out.append(None)
                continue
            if record.role == LINK:
                out.append(out[record.same_as])
                continue
            group, values = (IN, evidence) if record.role == IN else (OUT, probes)
            i = positions[group]
            positions[group] = i + 2
            out.append((values[i], values[i + 1]))
        return out

    def micro_batch_of(self, index: int) -> int | None:
        """Which forward of its root (within the step) probe ``index`` was made in; None outside
        any (before the first, or after one returned: the script called a module itself). A probe
        of a forward run again inside a backward pass is of the last forward before it, whose
        backward that is."""
        position = bisect_right(self.spans, (index, math.inf, math.inf)) - 1
        inside = index < self.span_ends.get(position, math.inf) or self.in_backward(index)
        return self.spans[position][2] if position >= 0 and inside else None

    def mark_backward(self, backward: bool) -> bool:
        """Notes whether the probes made from now on are made inside a backward pass; returns it."""
        if backward != bool(len(self.recomputed) % 2):
            self.recomputed.append(len(self.records))
        return backward

    def in_backward(self, index: int) -> bool:
        """Whether probe ``index`` was made inside a backward pass (a checkpointed forward run again)."""
        return bisect_right(self.recomputed, index) % 2 == 1

    def backward_order(self, slots: list[Slot]) -> list[int]:
        """Module slots in the order their gradients are produced: the reverse of the order in
        which they began. A leaf begins at its first probe; a container at the first probe of its
        subtree, so its own parameters count as used first (a compiled graph probes a root that
        owns parameters only at its end, which must not put them first in backward order)."""
        began: dict[int, int] = {}
        for index, record in enumerate(self.records):
            if record.role in (OUT, IN, LINK):
                began.setdefault(record.slot, index)
        for slot, info in enumerate(slots):
            if info.container:
                prefix = f"{info.name}." if info.name else ""
                inside = [i for s, i in began.items() if s == slot or slots[s].name.startswith(prefix)]
                if inside:
                    began[slot] = min(inside)
        return sorted(began, key=lambda slot: -began[slot])
