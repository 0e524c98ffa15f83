"""Hooks and device flags: find non-finite values without syncing the host. No I/O.

Every checked tensor leaves one *probe*: its minimum and maximum from one reduction
(``torch.aminmax``), written into two places made in advance (``places.Slots``), with a record
of what it looked at appended to the step's log. The probe is exact: a NaN makes both NaN, +Inf
the maximum, -Inf the minimum, and a finite tensor's extremes are finite (a float32 sum, by
contrast, overflows on huge finite values). Nothing is read on the hot path: the decision joins
the step's probes (and the gradient norms) into one small vector and reads it once per optimizer
step; only when a value in it is non-finite does the diagnosis look at the records one by one.
(On the CPU, where reading syncs nothing, a forward's probes are also read at its end, to let go
of the tensors it kept for detail when they are all finite: ``let_go_clean``.)

What is probed:
- the floating-point tensors in the output of every module, leaves and containers (an output
  that is just a child's output is recognised and not checked again; a plain ``nn.Sequential``,
  whose output always is, is not hooked at all);
- the inputs of a module, positional and keyword, unless they are outputs already probed and not
  modified in place since (so a value born in code *between* modules is told apart from one born
  inside). These are evidence, not faults: models pass -inf on purpose (additive attention masks),
  so a non-finite input never stops a step by itself; it tells where a value that did reach an
  output came from;
- the root module's inputs (the batch, evidence too, checked only once a step is bad), tensors
  given to ``Guard.check``, and each DDP gradient bucket before its all-reduce;
- the parameters' gradients as the backward pass leaves them (``StepLog.produced``), before the
  training loop clips, unscales or otherwise rewrites them, so that what it does to them cannot
  move the blame.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                    register_module_parameter_registration_hook)

from .._torch import graph_task_id
from .._tree import floating_tensors, named_floating_tensors
from . import forensics
from .backward import BackwardWatch, keep_summed, probe
from .buffers import Buffers
from .fed import Feeds
from .modules import ddp_inner, plain_names
from .._torch.patches import handed_to, watch_handed_weights
from .records import BATCH, CHECK, IN, OUT, Catalog, Context, Probe, StepLog, gradless, version_of
from .hooks import MAX_PARTS, call_tensors, hook_added, hook_modules, hook_parts, hook_root, on_registration

LET_GO_BYTES = 512 << 10
"""kept tensors worth a read of the probes at a forward's end (``let_go_clean``): below it the
read (about 17 us inside a small MLP's step here) costs more than the memory it gives back saves
(glibc serves small blocks from its heap; a fresh mapping of 512 KiB is ~128 page faults), unless
they hold more than half the detail budget, which the next micro-batch needs"""
HELD_ON_CPU = 64 << 10
"""the largest tensor a step holds by reference through its backward pass on a CPU (a root's output, the
gradient that reached it): glibc serves one this small from its heap; a larger one kept alive past the point
where the script lets it go keeps that memory from the backward pass and the next micro-batch, which map fresh
pages instead (nanoGPT's 256 KiB logits held over 4 micro-batches: about 200 page faults a step, a seventh of
its time). A caching allocator (CUDA's) reuses the memory it holds: there the detail budget alone bounds it"""
_logger = logging.getLogger("nanguard")
_transformed = forensics.transformed
_graph_task = graph_task_id
"""-1 outside a backward pass"""


class Budget:
    """The step's detail budget (``detail_mb``): bytes of tensors held by reference until its decision."""

    __slots__ = ("limit", "kept")

    def __init__(self, limit: int):
        self.limit, self.kept = limit, 0

    def take(self, size: int) -> bool:
        """Whether ``size`` bytes more fit; taken when they do."""
        if size > self.limit - self.kept:
            return False
        self.kept += size
        return True

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is held through the backward pass (taken when it is): on a CPU only up to
        ``HELD_ON_CPU``."""
        size = tensor.numel() * tensor.element_size()
        return (size <= HELD_ON_CPU or not tensor.is_cpu) and self.take(size)


class Detector:
    """Installs the hooks and keeps the probes of the current step (``log``)."""

    def __init__(self, *, skip_types: Iterable[str | type] = (), skip_modules: Iterable[str] = (),
                 detail_bytes: int = 0, on_root_end: Callable[[], None] | None = None,
                 on_step_start: Callable[[], None] | None = None, keep_batches: bool = False,
                 on_settle: Callable[[str], None] | None = None, sentinel: bool = False, verdict: bool = False,
                 outputs_decide=lambda: True):
        self._skip_types, self._skip_modules = tuple(skip_types), tuple(skip_modules)
        self.on_root_end = on_root_end
        self.on_step_start = on_step_start
        self.on_settle = on_settle
        """a training forward follows forwards of no training step: settle those apart ("evaluation",
        "dropped": see ``Decider.settle_early``)"""
        self.keep_batches = keep_batches
        self.catalog = Catalog()
        self.log = StepLog()
        self.budget = Budget(detail_bytes)
        self._judged = 0
        """records of this step whose kept tensors were let go, or kept for good (``let_go_clean``)"""
        self._handles: list[Any] = []
        self._modules: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        self._root_slots: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        """the model a DDP root wraps -> the root's slot (its forwards are the root's micro-batches)"""
        self._seen: dict[int, tuple[weakref.ref, int, int | None]] = {}
        """id -> (the tensor, its version when seen, its probe record if it was probed)"""
        self._forwards: dict[int, int] = {}
        self.steps_elsewhere = False  # (``new_step``)
        self.backward = BackwardWatch(self.log, attached=lambda: bool(self._handles), holds=verdict and self.budget.holds)
        self.depth = 0
        """root forwards in progress (a root called inside another's is not a micro-batch)"""
        self.aside = False
        """the root forward in progress is an evaluation amid a training step's micro-batches"""
        self.warned_copy = False
        """a copy of a guarded module ran its hooks (said once: ``copied``)"""
        self.added: list[tuple[weakref.ref, str]] = []
        """(module, attribute) of modules and parameters registered into hooked modules since the
        last forward began (a head, a LoRA adapter, a replaced layer): hooked and named then"""
        self.skipped: list[str] = []
        """names of the modules skipped (``skip_types``, ``skip_modules``): their children are too"""
        self.registrations: list[Any] = []
        """the process-wide hooks that note what is registered into hooked modules (``on_registration``)"""
        self.buffers = Buffers()
        self.feeds = Feeds()
        self.sentinel = sentinel  # tier 1: module probes only in the microscope's re-run (``Probes``)
        self.verdict = verdict or sentinel
        """a bad step is re-run from memory for the verdict inside the job: each micro-batch's ``Context`` is kept"""
        self.outputs_decide = outputs_decide  # a root's output decides (no optimizer): probed in sentinel mode
        self.probes = Probes(on=not sentinel)
        self.rerunning = False  # the microscope re-runs a micro-batch: the root hooks keep out of it
        self.parts: list[Any] = []  # the pre-hooks of the roots' children until a root's forward runs (``hook_parts``)

    # ------------------------------------------------------------------ installing
    def owns(self, module: nn.Module) -> bool:
        return module in self._modules

    def slot_of(self, root: nn.Module) -> int:
        """The slot of a root's micro-batches: its own, or its DDP wrapper's (``attach``)."""
        return self._root_slots.get(root, self._modules[root])

    def attach(self, root: nn.Module, prefix: str = "") -> int:
        """Hook ``root`` and every module below it; returns the root's slot."""
        names = plain_names(root, prefix)
        hook_modules(self, names, root)
        if not self.registrations:  # what is added into these modules later is hooked too
            self.registrations += [register_module_module_registration_hook(on_registration(self)),
                                   register_module_parameter_registration_hook(on_registration(self)),
                                   watch_handed_weights(self)]
        self.backward.watch_collectives(root, names)
        hook_root(self, root)
        return self._modules[root]

    def handed(self, module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """A call of ``module`` runs with ``weights`` in the place of its own (``torch.func.functional_call``):
        held by reference until the step's decision, so a report names a non-finite one (``MAX_PARTS`` calls)."""
        log = self.log
        if module in self._modules and torch.is_grad_enabled() and len(log.handed) < MAX_PARTS and not any(
                map(_transformed, (t for t in weights.values() if isinstance(t, torch.Tensor)))):
            log.handed.append((weakref.ref(module), dict(weights)))  # (inside vmap: nothing to read, nor keep)

    def detach(self) -> None:
        for handle in self._handles + self.registrations:
            handle.remove()
        self._handles.clear()
        self.backward.close()
        self.probes.forget()
        self.registrations.clear()
        self._modules = weakref.WeakKeyDictionary()
        self._root_slots = weakref.WeakKeyDictionary()
        self.reset()

    # ------------------------------------------------------------------ hot path
    def _add(self, tensor: torch.Tensor, role: int, slot: int, lazy: bool = False,
             field: str | None = None, passed: bool | None = False) -> None:
        """Probe a forward tensor and remember it as checked. A ``lazy`` one (the batch) is only
        kept, when the byte budget allows, and checked exactly once the step is known bad."""
        if _transformed(tensor):
            return  # inside torch.func (vmap, grad): no value to read; the result outside is checked
        # forensics.plain without its detach: a reduction with autograd off needs none (a detach
        # makes a tensor: 5-9 us inside a step here), and what reads a kept tensor later detaches
        local = tensor if type(tensor) is torch.Tensor and not (tensor.is_complex() or tensor.is_nested) else \
            forensics.plain(tensor)
        numel = local.numel()
        if not numel:
            return  # nothing in it can be non-finite
        ref = weakref.ref(tensor)
        kept: Any = ref  # beyond the budget: described only while the tensor is still alive
        # Keep the step's first tensors (up to a byte budget) so a bad one can be described
        # exactly after the backward pass has freed the activations.
        size = numel * local.element_size()
        if self.budget.take(size):
            kept = local
        log = self.log
        version = version_of(tensor)
        pos = -1
        if not lazy:
            values, slots = (log.evidence, log.evidence_slots) if role == IN else (log.values, log.value_slots)
            pos = len(values)
            # (a 0-d tensor, a loss, is copied into its places: it may be changed in place later)
            values.extend(gradless(torch.aminmax, local, out=slots.take(local)))
        records = log.records
        self._seen[id(tensor)] = (ref, version, len(records))
        shape = tensor.shape if local is tensor or not tensor.is_nested else local.shape  # (a nested one has none)
        records.append(Probe(role, slot, kept, version, shape, tensor.dtype, lazy, False, field, None, pos,
                             passed, -1, log.calls))

    def _unchecked(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``tensors`` not probed or marked yet (or modified in place since)."""
        seen = self._seen
        out = []
        for tensor in tensors:
            entry = seen.get(id(tensor))
            if entry is None or entry[0]() is not tensor or entry[1] != version_of(tensor):
                out.append(tensor)
        return out

    def _evidence(self, tensor: torch.Tensor) -> int | None:
        """The record of the evidence probe that covers ``tensor`` as it is now (another call's
        input, or a value passed on), or None: not seen, or covered by an output probe."""
        entry = self._seen.get(id(tensor))
        if entry is None or entry[2] is None or entry[0]() is not tensor or entry[1] != version_of(tensor):
            return None
        return entry[2] if self.log.records[entry[2]].role == IN else None

    def mark_seen(self, tensors: list[torch.Tensor]) -> None:
        """``tensors`` count as checked (a batch's copies, probed as the batch)."""
        for tensor in tensors:
            self._seen[id(tensor)] = (weakref.ref(tensor), version_of(tensor), None)


    def root_pre(self, root_slot: int, args: tuple, kwargs: dict, module: nn.Module | None = None) -> None:
        """A root forward begins: a new micro-batch, its inputs (the batch) probed; ``module`` called."""
        if self.added:
            hook_added(self)
        if self.parts and module is not None:  # a root's forward runs: the script does not call its parts itself
            for handle in self.parts:
                handle.remove()
            self.parts = []
        log = self.log
        grad = torch.is_grad_enabled()
        if grad and log.started and self.on_settle is not None and (not log.trained or _dropped(log)):
            self.on_settle("dropped" if log.trained else "evaluation")
        if not log.started:
            self.step_starts()
        log.trained = log.trained or grad
        if log.bucket_passes:
            keep_summed(self.backward)
        log.mark_backward(_graph_task() != -1)
        micro_batch = self._forwards[root_slot] = self._forwards.get(root_slot, -1) + 1
        log.spans.append((len(log.records), root_slot, micro_batch))
        inputs = call_tensors(args, kwargs)
        decides = self.outputs_decide()  # (no optimizer steps: the outputs are what is decided on)
        if self.keep_batches and (grad or decides) and not any(map(_transformed, inputs)):
            # held for the capture and the microscope (not inside torch.func, whose tensors do not outlive
            # it; nor an evaluation amid training, which stops nothing: a long one would hold every batch): copies,
            # once a batch was found changed in place by its step's decision (a refilled buffer),
            # probed (lazily) as those copies; the forward's own are seen
            held, held_kwargs, versions = self.feeds.hold(args, kwargs)
            log.batches.append((root_slot, held, held_kwargs, versions))
            if self.verdict:
                called = (ddp_inner(module) or module) if module is not None else None
                log.contexts.append(Context.now(module, micro_batch, called, handed_to(called)))
            if self.feeds.copying:
                self.mark_seen(self._unchecked(inputs))
                inputs = call_tensors(held, held_kwargs)
        if not self.sentinel or not grad or decides:
            # (a sentinel's training step needs none: the microscope's re-run probes the batch it re-runs)
            batch_probes(self, inputs, root_slot)

    def new_step(self) -> None:
        """Another model's optimizer stepped, in a guard with none of its own: micro-batches count
        from here, not from this guard's last decision."""
        self.steps_elsewhere = True
        self._forwards.clear()

    def step_starts(self) -> None:
        """The step's first forward begins: its buffers are kept, and ``on_step_start`` told."""
        log = self.log
        log.started = True
        self.buffers.step_started()
        log.buffers_at_start, log.buffer_versions = self.buffers.kept, self.buffers.versions
        if self.on_step_start is not None:
            self.on_step_start()

    def root_end(self, output: Any) -> None:
        """A root forward returned ``output`` (None: it raised)."""
        self.depth = max(self.depth - 1, 0)
        if self.depth:
            return
        if self.aside:  # an evaluation amid the step's micro-batches ended: nothing of it was checked
            self.aside = False
            return
        log = self.log
        if log.spans:
            log.span_ends[len(log.spans) - 1] = len(log.records)
        if output is None:
            return
        floating = floating_tensors(output)
        if self.sentinel and not self.probes.on:
            _sentinel_output(self, output, floating)
        kept = self.budget.kept
        if (kept >= LET_GO_BYTES or 2 * kept > self.budget.limit) and torch.is_grad_enabled():
            let_go_clean(self)
        self.backward.forward_done(output, floating)  # (after the budget let go of: it charges what it keeps)
        if self.on_root_end is not None:
            self.on_root_end()

    def check(self, tensor: torch.Tensor, name: str) -> None:
        index = self.catalog.check_index(name)
        if not (tensor.is_floating_point() or tensor.is_complex()) or not tensor.numel():
            return
        seen = self._seen.get(id(tensor))
        if seen is not None and seen[0]() is tensor and seen[1] == version_of(tensor) and seen[2] is not None:
            record = self.log.records[seen[2]]
            record.check = index  # a loss the model returned: named, not probed again
        else:
            self._add(tensor, CHECK, index)
            record = self.log.records[-1]
        if name == "loss" and record.pos >= 0 and tensor.numel() == 1:
            self.log.loss_at = record.pos

    # ------------------------------------------------------------------ the step
    @property
    def pending(self) -> int:
        """Probes made since the last decision."""
        return len(self.log.records)

    def reset(self, decided: bool = True) -> None:
        """Forget this step's probes: after a decision, or (``decided=False``) for the microscope's
        re-run to make them again."""
        if decided:
            self.feeds.step_decided(self.log.batches)
            self.buffers.forget()
            if not self.steps_elsewhere:
                self._forwards.clear()
            self.backward.armed = False  # (an output whose backward never ran: the next step's arms again)
            self.backward.step_decided()
        self.log.clear()
        self._seen.clear()
        self.budget.kept = self._judged = 0


class Probes:
    """Every module's forward hook, installed while ``on``: for good in full mode, for the microscope's
    re-run of a bad step in sentinel mode (a clean step then runs no module hook at all)."""

    def __init__(self, on: bool):
        self.on = on
        self._hooks: list[tuple[weakref.ref, Callable]] = []
        self._handles: list[Any] = []

    def add(self, module: nn.Module, hook: Callable) -> None:
        self._hooks.append((weakref.ref(module), hook))
        if self.on:
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def install(self) -> None:
        self.on = True
        if not self._handles:
            self._handles = [module.register_forward_hook(hook, with_kwargs=True)
                             for ref, hook in self._hooks if (module := ref()) is not None]

    def remove(self) -> None:
        self.on = False
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def forget(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._hooks = [], []


def optimizer_steps(detector: Detector, optimizer: object) -> None:
    """An optimizer (None: no optimizer) steps: where no root forward ran in its step, the script calls
    the model's parts itself (the model a wrapper held): their calls are held for the microscope from now on.
    The last backward pass's norms, where they were put off, are measured now (``BackwardWatch.settle``)."""
    detector.backward.settle()
    if optimizer is not None and detector.verdict and not detector.parts and not detector.log.spans:
        alive = {slot.name: slot.module() for slot in detector.catalog.slots}
        # the roots' children, and a model whose wrapper was let go
        parts = [child for root in detector._root_slots if ddp_inner(root) is None for child in root.children()]
        parts += [module for name, module in alive.items() if module is not None and "." in name
                  and name.rsplit(".", 1)[0] in alive and alive[name.rsplit(".", 1)[0]] is None]
        hook_parts(detector, parts)


def let_go_clean(detector: Detector) -> None:
    """At the end of a forward on the CPU, let go of the tensors it kept for detail when every
    output it probed is finite: none of them can be the one a report describes. Held until
    the step's decision, activations outlive the backward pass that frees them, and the next
    micro-batch can reuse none of their memory: glibc maps fresh pages for it, 0.12 of a
    nanoGPT step with 4 micro-batches here. The budget they held goes to the next micro-batch,
    so a value that goes bad in the last one is still described exactly. Only where the probes
    sit in CPU memory, whose read syncs nothing: on a device, the step's one read stays the
    only one (a caching allocator reuses the memory of kept tensors, so they cost no time there)."""
    log = detector.log
    # the outputs alone: a non-finite input (an additive -inf mask) is described only beside
    # the bad output of its own call, which a forward with finite outputs does not have
    outputs = log.value_slots.read_if_free(log.values)
    records = log.records
    if outputs is None or not all(map(math.isfinite, outputs)):
        detector._judged = len(records)  # something is bad (or not free to read): keep it all
        return
    for record in records[detector._judged:]:
        kept = record.kept
        if record.role in (OUT, IN) and type(kept) is not weakref.ref and kept is not None:
            detector.budget.kept -= kept.numel() * kept.element_size()
            record.kept = None
    detector._judged = len(records)


def batch_probes(detector: Detector, inputs: list[torch.Tensor], root_slot: int) -> None:
    """The batch's (lazy) probes: checked exactly only once the step is known bad."""
    for tensor in detector._unchecked(inputs):
        detector._add(tensor, BATCH, root_slot, lazy=True)


def _sentinel_output(detector: Detector, output: Any, outputs: list[torch.Tensor]) -> None:
    """Tier 1 at a root forward's end: where the output is what is decided on (no optimizer steps,
    autograd off), its probe; else each output held by reference (``Budget.holds``), or its extremes,
    told finite or not on a bad step only, for the microscope's verdict. ``outputs``: its floating tensors."""
    log = detector.log
    if not log.spans:
        return
    if any(map(_transformed, outputs)):
        return  # inside torch.func: nothing to read, nor to keep past the transform
    if not torch.is_grad_enabled() or detector.outputs_decide():
        fields = {id(t): path or None for path, t in named_floating_tensors(output)}
        for tensor in detector._unchecked(outputs):
            detector._add(tensor, OUT, log.spans[-1][1], field=fields.get(id(tensor)))
        return
    # each one held, or where holding it costs (``Budget.holds``), its extremes (exact, on the device: no sync)
    log.outputs[len(log.spans) - 1] = [(t, version_of(t)) if detector.budget.holds(t) else
                                       (gradless(_extremes, t), -1) for t in outputs]


def _extremes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s minimum and maximum as one tensor of two: non-finite exactly when ``tensor`` is."""
    return torch.stack(probe(tensor))


def _dropped(log: StepLog) -> bool:
    """Whether the script dropped the step so far: a backward pass left gradients, and they are
    all gone now (``zero_grad()`` without an optimizer step; accumulating micro-batches keep them)."""
    owners = log.produced[0] if log.produced is not None else None
    return bool(owners) and owners[0].grad is None and all(p.grad is None for p in owners)


