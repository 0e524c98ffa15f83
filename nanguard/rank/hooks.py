"""Where the detector's hooks go in, and what the forward hook does: which modules are checked,
passed or skipped (``mode_of``), the hooks a guarded model, its root and the parts a script calls
itself get (registered as modules, parameters and hooks are added), and the forward hook that
probes a module's inputs and outputs into the detector's step log.
"""

from __future__ import annotations

import fnmatch
import logging
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._torch import graph_task_id
from .._tree import floating_tensors, named_floating_tensors
from .backward import probe
from .modules import ddp_inner, is_wrapper, plain_names, type_name, untraced
from .records import IN, LINK, OUT, Context, Probe, Slot, StepLog

if TYPE_CHECKING:
    from .detector import Detector

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
_logger = logging.getLogger("nanguard")
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


def call_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The floating tensors a call was given, positional then keyword."""
    return floating_tensors(args) + floating_tensors(kwargs) if kwargs else floating_tensors(args)


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


def hook_modules(detector: Detector, names: dict[nn.Module, str], root: nn.Module | None) -> None:
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


def on_registration(detector: Detector):
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


def hook_added(detector: Detector) -> None:
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
            hook_modules(detector, plain_names(child, qualified), None)
        param = parent._parameters.get(name)
        if param is not None and not detector.backward.watches(param):
            detector.backward.add_parameter(param)
            catalog.name_param(param, qualified, detector._modules[parent])


def copied(detector: Detector, module: nn.Module) -> None:
    """A module that is not the one a hook was registered on runs it: a copy of a guarded module
    made after init (``copy.deepcopy``, an EMA's ``AveragedModel``) carries its hooks. Its calls
    are not checked (they would be taken for the original's, and count as its micro-batches);
    said once."""
    if not detector.warned_copy:
        detector.warned_copy = True
        _logger.warning("nanguard: a copy of a guarded %s, made after nanguard.init (copy.deepcopy, an EMA's"
                        " AveragedModel), runs nanguard's hooks: its forwards are not checked; give the copy to"
                        " nanguard.init too, or copy the model before init", type(module).__name__)


def hook_root(detector: Detector, root: nn.Module) -> None:
    """Put the root hooks on ``root``, and on the model it wraps when it is a DDP: that model is a
    root too, of the same micro-batches, since a script that wraps it again (a new DDP, to sync a
    module added later) calls it from the new wrapper. Called from the old one, it is a root
    inside a root's forward: nothing more."""
    root_slot = detector._modules[root]
    if type(root).forward is nn.Module.forward:  # a ModuleDict of a GAN: the script calls its children
        detector._handles += [child.register_forward_pre_hook(_step_start(detector)) for child in root.children()]
    inner = ddp_inner(root)
    if detector.verdict:
        hook_parts(detector, (inner or root).children())
    for module in (root,) if inner is None else (root, inner):
        detector._root_slots[module] = root_slot
        pre, post = _root_hooks(detector, root_slot, module)
        detector._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        detector._handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))


def hook_parts(detector: Detector, parts: Iterable[nn.Module]) -> None:
    """Pre-hooks on a root's children (``parts``) for a script that calls them itself, outside any root
    forward (a GAN's ``ModuleDict``, a LightningModule's training_step): each such call is held with
    its ``Context`` (``StepLog.parts``), so that the microscope re-runs it. Taken off as soon as a
    root's forward runs (``Detector.root_pre``): its children are called inside it, and a clean step
    then runs no hook of theirs."""

    @untraced
    def hook(module, args, kwargs):
        log = detector.log
        if detector.depth or detector.rerunning:
            return
        if not torch.is_grad_enabled():
            log.parts_unchecked += 1  # (what a report of the step that says its forward was finite tells)
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
            return copied(detector, module)
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
        hook_added(detector)
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
            return copied(detector, module)  # a copy made after init carries this hook: not this slot's
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
