"""Hooks and device flags: find non-finite values without syncing the host. No I/O.

Every checked tensor leaves one *probe*: its minimum and maximum from one reduction
(``torch.aminmax``), written into two places made in advance (``records.Slots``), with a record
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

import fnmatch
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
from .modules import ddp_inner, is_wrapper, plain_names, type_name, untraced
from .patches import handed_to, watch_handed_weights
from .records import BATCH, CHECK, IN, LINK, OUT, Catalog, Context, Probe, Slot, StepLog, gradless, version_of

# Modules whose output is finite whenever their input is, for every finite input of every
# floating dtype: their outputs need no probe of their own, the probe of their input covers them.
# Not GELU nor Hardswish (x * (1 + erf) and x * relu6(x + 3) overflow past half and a sixth of the
# largest float32 or bf16), nor LogSoftmax (x - logsumexp(x) overflows when the extremes are far
# apart): tests/unit/test_trust.py tries each with the extremes of each dtype.
FINITE_PRESERVING = frozenset((
    nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softsign, nn.Identity, nn.Flatten,
    nn.Unflatten, nn.SiLU, nn.Mish, nn.ELU, nn.Hardsigmoid, nn.Softmax, nn.MaxPool1d,
    nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
))
CHECK_MODE, PASS_MODE, SKIP_MODE = range(3)
MAX_PARTS = 64
"""calls of a root's children that the script makes itself, held in a step for the microscope (``log.parts``)"""
LET_GO_BYTES = 512 << 10
"""kept tensors worth a read of the probes at a forward's end (``let_go_clean``): below it the
read (about 17 us inside a small MLP's step here) costs more than the memory it gives back saves
(glibc serves small blocks from its heap; a fresh mapping of 512 KiB is ~128 page faults), unless
they hold more than half the detail budget, which the next micro-batch needs"""
_logger = logging.getLogger("nanguard")
_transformed = forensics.transformed
_graph_task = graph_task_id
"""-1 outside a backward pass"""


def skipped(module: nn.Module, name: str, skip_types: Iterable[str | type], skip_modules: Iterable[str]) -> bool:
    """Whether settings ``skip_types`` / ``skip_modules`` name ``module`` (called ``name``): its
    outputs may be non-finite on purpose. Its children are skipped with it (``attach``)."""
    cls = type(module)
    return any(t is cls or t in (cls.__name__, type_name(module), f"{cls.__module__}.{cls.__qualname__}")
               for t in skip_types) or any(fnmatch.fnmatchcase(name, p) for p in skip_modules)


def mode_of(module: nn.Module, name: str, skip_types: Iterable[str | type], skip_modules: Iterable[str]) -> int:
    """How a module's hook treats it: skipped (it emits non-finite values on purpose), passed
    (its output is finite exactly when its input is), or checked."""
    if skipped(module, name, skip_types, skip_modules):
        return SKIP_MODE
    if _preserves_finite(type(module)) and getattr(module, "negative_slope", 0) <= 1:
        return PASS_MODE
    return CHECK_MODE


def _preserves_finite(cls: type) -> bool:
    """A finite-preserving torch module, or a subclass that keeps its forward: a subclass that
    writes its own (a scaled GELU) can make an Inf of a finite input, and is checked."""
    base = next((b for b in cls.__mro__ if b in FINITE_PRESERVING), None)
    return base is not None and cls.forward is base.forward


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
        self._detail_bytes = detail_bytes
        self._kept_bytes = self._judged = 0
        """(judged: records of this step whose kept tensors were let go, or kept for good: ``let_go_clean``)"""
        self._handles: list[Any] = []
        self._modules: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        self._root_slots: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        """the model a DDP root wraps -> the root's slot (its forwards are the root's micro-batches)"""
        self._seen: dict[int, tuple[weakref.ref, int, int | None]] = {}
        """id -> (the tensor, its version when seen, its probe record if it was probed)"""
        self._forwards: dict[int, int] = {}
        self.steps_elsewhere = False  # (``new_step``)
        self.backward = BackwardWatch(self.log, attached=lambda: bool(self._handles))
        self.depth = 0
        """root forwards in progress (a root called inside another's is not a micro-batch)"""
        self.aside = False
        """the root forward in progress is an evaluation amid a training step's micro-batches"""
        self.warned_copy = False
        """a copy of a guarded module ran its hooks (said once: ``_copied``)"""
        self.added: list[tuple[weakref.ref, str]] = []
        """(module, attribute) of modules and parameters registered into hooked modules since the
        last forward began (a head, a LoRA adapter, a replaced layer): hooked and named then"""
        self.skipped: list[str] = []
        """names of the modules skipped (``skip_types``, ``skip_modules``): their children are too"""
        self.registrations: list[Any] = []
        """the process-wide hooks that note what is registered into hooked modules (``_on_registration``)"""
        self.buffers = Buffers()
        self.feeds = Feeds()
        self.sentinel = sentinel  # tier 1: module probes only in the microscope's re-run (``Probes``)
        self.verdict = verdict or sentinel
        """a bad step is re-run from memory for the verdict inside the job: each micro-batch's ``Context`` is kept"""
        self.outputs_decide = outputs_decide  # a root's output decides (no optimizer): probed in sentinel mode
        self.probes = Probes(on=not sentinel)
        self.rerunning = False  # the microscope re-runs a micro-batch: the root hooks keep out of it
        self.parts: list[Any] = []  # the pre-hooks of the roots' children until a root's forward runs (``_hook_parts``)

    # ------------------------------------------------------------------ installing
    def owns(self, module: nn.Module) -> bool:
        return module in self._modules

    def slot_of(self, root: nn.Module) -> int:
        """The slot of a root's micro-batches: its own, or its DDP wrapper's (``attach``)."""
        return self._root_slots.get(root, self._modules[root])

    def attach(self, root: nn.Module, prefix: str = "") -> int:
        """Hook ``root`` and every module below it; returns the root's slot."""
        names = plain_names(root, prefix)
        _hook_modules(self, names, root)
        if not self.registrations:  # what is added into these modules later is hooked too
            self.registrations += [register_module_module_registration_hook(_on_registration(self)),
                                   register_module_parameter_registration_hook(_on_registration(self)),
                                   watch_handed_weights(self)]
        self.backward.watch_collectives(root, names)
        _hook_root(self, root)
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
        if size <= self._detail_bytes - self._kept_bytes:
            self._kept_bytes += size
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
            _hook_added(self)
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
        micro_batch = self._forwards.get(root_slot, 0)
        self._forwards[root_slot] = micro_batch + 1
        log.spans.append((len(log.records), root_slot, micro_batch))
        inputs = call_tensors(args, kwargs)
        if self.keep_batches and (grad or self.outputs_decide()) and not any(map(_transformed, inputs)):
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
        if not self.sentinel or not grad or self.outputs_decide():
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
        if self.sentinel and not self.probes.on:
            _sentinel_output(self, output)
        self.backward.forward_done(output)
        kept = self._kept_bytes
        if (kept >= LET_GO_BYTES or 2 * kept > self._detail_bytes) and torch.is_grad_enabled():
            let_go_clean(self)
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
        self.log.clear()
        self._seen.clear()
        self._kept_bytes = self._judged = 0


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
    the model's parts itself (the model a wrapper held): their calls are held for the microscope from now on."""
    if optimizer is not None and detector.verdict and not detector.parts and not detector.log.spans:
        alive = {slot.name: slot.module() for slot in detector.catalog.slots}
        # the roots' children, and a model whose wrapper was let go
        parts = [child for root in detector._root_slots if ddp_inner(root) is None for child in root.children()]
        parts += [module for name, module in alive.items() if module is not None and "." in name
                  and name.rsplit(".", 1)[0] in alive and alive[name.rsplit(".", 1)[0]] is None]
        _hook_parts(detector, parts)


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
            detector._kept_bytes -= kept.numel() * kept.element_size()
            record.kept = None
    detector._judged = len(records)


def batch_probes(detector: Detector, inputs: list[torch.Tensor], root_slot: int) -> None:
    """The batch's (lazy) probes: checked exactly only once the step is known bad."""
    for tensor in detector._unchecked(inputs):
        detector._add(tensor, BATCH, root_slot, lazy=True)


def _sentinel_output(detector: Detector, output: Any) -> None:
    """Tier 1 at a root forward's end: where the output is what is decided on (no optimizer steps,
    autograd off), its probe; else references to it (within the detail budget), told finite or not
    on a bad step only, for the microscope's verdict."""
    log = detector.log
    if not log.spans:
        return
    outputs = floating_tensors(output)
    if any(map(_transformed, outputs)):
        return  # inside torch.func: nothing to read, nor to keep past the transform
    if not torch.is_grad_enabled() or detector.outputs_decide():
        fields = {id(t): path or None for path, t in named_floating_tensors(output)}
        for tensor in detector._unchecked(outputs):
            detector._add(tensor, OUT, log.spans[-1][1], field=fields.get(id(tensor)))
        return
    size = sum(t.numel() * t.element_size() for t in outputs)
    if size <= detector._detail_bytes - detector._kept_bytes:
        detector._kept_bytes += size
        log.outputs[len(log.spans) - 1] = [(t, version_of(t)) for t in outputs]


def call_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The floating tensors a call was given, positional then keyword."""
    return floating_tensors(args) + floating_tensors(kwargs) if kwargs else floating_tensors(args)


def _dropped(log: StepLog) -> bool:
    """Whether the script dropped the step so far: a backward pass left gradients, and they are
    all gone now (``zero_grad()`` without an optimizer step; accumulating micro-batches keep them)."""
    owners = log.produced[0] if log.produced is not None else None
    return bool(owners) and owners[0].grad is None and all(p.grad is None for p in owners)


def _register(detector: Detector, module: nn.Module, qualified: str) -> int:
    """Give ``module`` a slot, named ``qualified``, and name its own parameters."""
    catalog = detector.catalog
    slot = len(catalog.slots)
    catalog.slots.append(Slot(qualified, type_name(module), weakref.ref(module),
                              container=next(module.children(), None) is not None))
    detector._modules[module] = slot
    detector.buffers.attach(module, qualified)
    for pname, param in module.named_parameters(recurse=False):
        if not detector.backward.watches(param):
            detector.backward.add_parameter(param)
        catalog.name_param(param, f"{qualified}.{pname}".lstrip("."), slot, first=True)
    return slot


def _hook_modules(detector: Detector, names: dict[nn.Module, str], root: nn.Module | None) -> None:
    """Register and hook the modules of ``names`` (by qualified name) not hooked yet; ``root``: the
    one whose output fields are named (None: modules added below a root)."""
    for module, qualified in names.items():
        if module in detector._modules:
            if root is None:  # moved into a module added later (the base layer a LoRA wrapper holds)
                _rename(detector, module, qualified)
            continue
        slot = _register(detector, module, qualified)
        mode = mode_of(module, qualified, detector._skip_types, detector._skip_modules)
        if any(qualified == s or qualified.startswith(s + ".") for s in detector.skipped):
            mode = SKIP_MODE
        elif mode == SKIP_MODE:
            detector.skipped.append(qualified)
        # Containers are hooked too, so a value born in their own forward code is blamed on
        # them; an output that is a child's output again is recognised and not re-checked.
        leaf = next(module.children(), None) is None or any(
            p is not None for p in module._parameters.values())
        if type(module) is nn.Sequential:
            continue  # in and out are its first and last child's, probed there (a subclass is hooked)
        # with its keyword arguments: transformers' layers pass tensors by keyword
        # (self_attn(hidden_states=..., attention_mask=...)), a value born before is told apart
        named = root is not None and (module is root or module is ddp_inner(root))
        hook = forward_hook(detector, slot, mode, leaf, named=named, untouched=isinstance(
            module, nn.modules.dropout._DropoutNd) and not module.inplace)
        detector.probes.add(module, hook)


def _rename(detector: Detector, module: nn.Module, qualified: str) -> None:
    """A hooked module now at ``qualified``: its name, and its own parameters', follow it."""
    catalog = detector.catalog
    catalog.slots[detector._modules[module]].name = qualified
    for name, param in module.named_parameters(recurse=False):
        catalog.name_param(param, f"{qualified}.{name}".lstrip("."))


def _on_registration(detector: Detector):
    """A process-wide registration hook (of modules, or of parameters): one registered into a
    hooked module is noted, to be hooked or named when the next forward begins (it is not in its
    place yet). Anything else is none of this detector's. It holds the detector weakly (a guard
    never closed goes with its models)."""
    ref = weakref.ref(detector)

    def hook(parent: nn.Module, name: str, value: Any) -> None:
        detector = ref()
        if value is None or detector is None:
            return
        if name == "module" and type(parent).__name__ == "DistributedDataParallel" and value in detector._root_slots:
            detector.added.append((weakref.ref(parent), name))  # a new DDP of a guarded model: its buckets
            detector.backward.watch_new_ddp(parent)
        elif parent in detector._modules:
            detector.added.append((weakref.ref(parent), name))

    return hook


def _hook_added(detector: Detector) -> None:
    """Hook the modules, and name the parameters, registered into hooked modules since the last
    forward: a NaN in a LoRA adapter, a new head or a replaced layer is named as theirs, and their
    gradients are checked before the update."""
    added, detector.added = detector.added, []
    catalog = detector.catalog
    for ref, name in added:
        parent = ref()
        if parent is not None and parent not in detector._modules and ddp_inner(parent) is not None:
            detector.backward.watch_ddp(parent)  # a new DDP wrapper of a guarded model: it is built by now
        if parent is None or parent not in detector._modules:
            continue
        base = catalog.slots[detector._modules[parent]].name
        qualified = base if is_wrapper(parent) else f"{base}.{name}".lstrip(".")
        child = parent._modules.get(name)
        if isinstance(child, nn.Module):
            _hook_modules(detector, plain_names(child, qualified), None)
        param = parent._parameters.get(name)
        if param is not None and not detector.backward.watches(param):
            detector.backward.add_parameter(param)
            catalog.name_param(param, qualified, detector._modules[parent])


def _copied(detector: Detector, module: nn.Module) -> None:
    """A module that is not the one a hook was registered on runs it: a copy of a guarded module
    made after init (``copy.deepcopy``, an EMA's ``AveragedModel``) carries its hooks. Its calls
    are not checked (they would be taken for the original's, and count as its micro-batches);
    said once."""
    if not detector.warned_copy:
        detector.warned_copy = True
        _logger.warning("nanguard: a copy of a guarded %s, made after nanguard.init (copy.deepcopy, an EMA's"
                        " AveragedModel), runs nanguard's hooks: its forwards are not checked; give the copy to"
                        " nanguard.init too, or copy the model before init", type(module).__name__)


def _hook_root(detector: Detector, root: nn.Module) -> None:
    """Put the root hooks on ``root``, and on the model it wraps when it is a DDP: that model is a
    root too, of the same micro-batches, since a script that wraps it again (a new DDP, to sync a
    module added later) calls it from the new wrapper. Called from the old one, it is a root
    inside a root's forward: nothing more."""
    root_slot = detector._modules[root]
    if type(root).forward is nn.Module.forward:  # a ModuleDict of a GAN: the script calls its children
        detector._handles += [child.register_forward_pre_hook(_step_start(detector)) for child in root.children()]
    inner = ddp_inner(root)
    if detector.verdict:
        _hook_parts(detector, (inner or root).children())
    for module in (root,) if inner is None else (root, inner):
        detector._root_slots[module] = root_slot
        pre, post = _root_hooks(detector, root_slot, module)
        detector._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        detector._handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))


def _hook_parts(detector: Detector, parts: Iterable[nn.Module]) -> None:
    """Pre-hooks on a root's children (``parts``) for a script that calls them itself, outside any root
    forward (a GAN's ``ModuleDict``, a LightningModule's training_step): each such call is held with
    its ``Context`` (``StepLog.parts``), so that the microscope re-runs it. Taken off as soon as a
    root's forward runs (``Detector.root_pre``): its children are called inside it, and a clean step
    then runs no hook of theirs."""

    @untraced
    def hook(module, args, kwargs):
        log = detector.log
        if detector.depth or detector.rerunning or not torch.is_grad_enabled():
            return
        if len(log.parts) >= MAX_PARTS:
            log.parts_over += 1
            return
        if not log.started:
            detector.step_starts()
        held, held_kwargs, versions = detector.feeds.hold(args, kwargs)
        began = len(log.spans) - 1  # a micro-batch the script began itself, not ended by a root forward
        log.parts.append((began if began >= 0 and began not in log.span_ends else -1, held, held_kwargs, versions,
                          Context.now(module)))

    @untraced
    def done(module, args, output):  # (the backward pass of what the script called is watched, as a root's)
        if not detector.depth and not detector.rerunning:
            _called_outside(detector, output)

    handles = [handle for child in parts for handle in (
        child.register_forward_pre_hook(hook, with_kwargs=True), child.register_forward_hook(done))]
    detector.parts += handles
    detector._handles += handles


def _root_hooks(detector: Detector, root_slot: int, module: nn.Module):
    """The forward pre- and post-hook of a root. Untraced: a root compiled in place runs them
    inside its compiled frame, where its bookkeeping would recompile on every new micro-batch
    number. A root called inside another's forward (a bare init() found a model's child first,
    when the script called it alone) is a module there: not a micro-batch, nor its input a batch.
    The post-hook runs when the forward raises too (``always_call``), with no output. ``module``:
    the one hooked (a root, or the model its DDP wraps)."""
    owner = weakref.ref(module)

    @untraced
    def pre(module, args, kwargs):
        if module is not owner():
            return _copied(detector, module)
        if detector.rerunning:
            return None
        detector.depth += 1
        if detector.depth == 1:
            # autograd off once a training forward of the step ran: an evaluation between its
            # micro-batches, which would count as one; not checked
            detector.aside = not torch.is_grad_enabled() and detector.log.trained
            if not detector.aside:
                detector.root_pre(root_slot, args, kwargs, module)

    @untraced
    def post(module, args, kwargs, output):
        if module is owner() and not detector.rerunning:
            detector.root_end(output)

    return pre, post


def _called_outside(detector: Detector, output: Any) -> bool:
    """Whether to check a module that returned ``output`` outside any root forward: the script
    calls the model's modules itself (a Lightning ``training_step``, a container of models), or a
    backward pass runs a checkpointed forward again. With autograd off it is an evaluation of a
    model's part (DDP's inner module, a validation step), not checked: its probes would join the
    next training step's. The first call of a step's forward tells when the backward pass starts,
    as a root forward would, so that the gradients are taken as it leaves them (before clipping
    spreads a NaN); calls inside a backward pass are marked as such. What was registered into
    hooked modules since is hooked and named here too (the script calls a wrapped model's inner one
    itself: PEFT's ``merge_and_unload()`` moved its base layers back into their places)."""
    if not torch.is_grad_enabled():
        return False
    if detector.added:
        _hook_added(detector)
    if not detector.log.mark_backward(_graph_task() != -1) and not detector.backward.armed:
        detector.backward.forward_done(output)
    return True


def _step_start(detector: Detector):
    """A pre-hook for the children of a root that has no forward (a ``ModuleDict``): the first
    of them to run starts the step, as the root's own forward would."""
    @untraced
    def hook(module, args):
        if not detector.log.started and not detector.rerunning:
            detector.step_starts()

    return hook


def forward_hook(detector: Detector, slot: int, mode: int, leaf: bool, named: bool = False,
                 untouched: bool = False):
    """The forward hook of one module (its slot and mode; ``named``: the root, whose output fields
    are named; ``untouched``: a dropout that never works in place, so its input returned is as it came).

    A value passed on (by a finite-preserving module, or an input returned) is probed as evidence
    (``Probe.passed``) unless checked as an output already; a call taking evidence links to it (LINK)."""
    is_compiling = torch.compiler.is_compiling
    add, seen = detector._add, detector._seen
    log, records = detector.log, detector.log.records
    compiled = Probe(OUT, slot, None, compiled=True)  # one record for every compiled call
    tensor_type = torch.Tensor
    passing = True if mode == PASS_MODE or untouched else None
    owner = detector.catalog.slots[slot].module

    def hook(module, args, kwargs, output):
        if is_compiling():
            if mode == CHECK_MODE and leaf:
                _compiled_call(log, compiled, output)
            return None
        if module is not owner():
            return _copied(detector, module)  # a copy made after init carries this hook: not this slot's
        if detector.aside or (not detector.depth and not _called_outside(detector, output)):
            return None  # an evaluation's call amid training, or of a model's part, autograd off: not checked
        log.calls += 1
        if type(output) is tensor_type and len(args) == 1 and not kwargs and type(args[0]) is tensor_type and \
                mode != SKIP_MODE and not (args[0].is_inference() or output.is_inference()):
            # the common call, one tensor in and one out, both with versions: the general path inlined
            x = args[0]
            entry = before = seen.get(id(x))
            if entry is not None and (entry[0]() is not x or entry[1] != x._version):
                entry = None  # another tensor, or changed in place since it was seen
            if mode == PASS_MODE or output is x:  # a value passed on
                if entry is not None and (output is x or entry[2] is None or records[entry[2]].role != IN):
                    if output is not x:  # what it took was checked: so is what it made of it
                        seen[id(output)] = (weakref.ref(output), output._version, entry[2])
                    return None  # (its input returned as it came is covered where it was seen)
                if output.is_floating_point() or output.is_complex():
                    add(output, IN, slot, passed=passing)
                    if output is x and before is not None and before[2] is not None and before[0]() is x:
                        records[-1].same_as = before[2]  # changed in place here: its probe before
                return None
            if entry is None:
                if x.is_floating_point() or x.is_complex():
                    add(x, IN, slot)
            elif entry[2] is not None and records[entry[2]].role == IN:
                records.append(Probe(LINK, slot, None, same_as=entry[2]))
            if output.is_floating_point() or output.is_complex():
                entry = seen.get(id(output))
                if entry is None or entry[0]() is not output or entry[1] != output._version:
                    add(output, OUT, slot)
            return None
        return _general_call(detector, slot, mode, passing, named, args, kwargs, output)

    return hook


def _compiled_call(log: StepLog, compiled: Probe, output: Any) -> None:
    """``forward_hook``'s work inside a compiled graph: only tensor math and list appends (no graph
    break), and only for leaves (without identity tracking a container would check again)."""
    for tensor in floating_tensors(output):
        if tensor.numel():
            log.values.extend(probe(tensor))
            log.records.append(compiled)


def _general_call(detector: Detector, slot: int, mode: int, passing: bool | None, named: bool,
                  args: tuple, kwargs: dict, output: Any) -> None:
    """``forward_hook``'s work for any call but one tensor in and one out."""
    add, unchecked, evidence = detector._add, detector._unchecked, detector._evidence
    # a root's output is named field by field (a model's loss is told from its logits)
    fields = ({id(t): path or None for path, t in named_floating_tensors(output)}
              if named and type(output) is not torch.Tensor else {})
    outputs = floating_tensors(output)
    if mode == SKIP_MODE:
        detector.mark_seen(outputs)
        return None
    inputs = call_tensors(args, kwargs)
    if mode == PASS_MODE:
        if unchecked(inputs) or any(evidence(t) is not None for t in inputs):
            for tensor in unchecked(outputs):
                add(tensor, IN, slot, passed=True)
        else:
            detector.mark_seen(outputs)
        return None
    given, returned = {id(t) for t in inputs}, {id(t) for t in outputs}
    fresh = {id(t) for t in unchecked(inputs)}
    for tensor in inputs:
        if id(tensor) in fresh:
            if id(tensor) not in returned:  # an input returned is probed as it leaves
                add(tensor, IN, slot)
        elif (same := evidence(tensor)) is not None:
            detector.log.records.append(Probe(LINK, slot, None, same_as=same))
    for tensor in unchecked(outputs):
        if id(tensor) in given:
            add(tensor, IN, slot, passed=passing)
        else:
            add(tensor, OUT, slot, field=fields.get(id(tensor)))
    return None
