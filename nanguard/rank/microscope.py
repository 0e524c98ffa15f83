"""Tier 2, the microscope: on a bad step only, re-run its micro-batches from memory under the full
probes, and say whether the re-run made the value non-finite again (the verdict inside the job).

Tier 1 (the sentinel, ``Detector`` in sentinel mode) decides every step from what the update
depends on and keeps, without copying, what a re-run needs: each micro-batch's arguments (their
in-place versions tell whether anything changed them since), the module it called, the RNG, autocast
and grad mode as its forward began (``Context``), references to the root's outputs and to the
gradient that reached them, within the detail budget (on a CPU only small ones: ``detector.HELD_ON_CPU``;
of a larger output, its extremes). Once every rank agreed that the step is bad,
and before anything is put back or the update is dropped, ``rerun`` fills the step's log with the
probes of a re-run of each micro-batch, as the full mode would have made them the first time: the
diagnosis reads that log as it reads a full-mode step's. The re-run draws from the RNG as the step
did, writes no gradient (the backward re-run goes through ``torch.autograd.grad``), and leaves the
RNG and the floating buffers as it found them.

A DDP root is re-run through the model it wraps, with no communication. A re-run proves only what it
reproduces: a clean re-run is a transient only where it re-ran everything the original saw go bad.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .._tree import floating_tensors, map_tensors
from ..incident.rng import cuda_in_use, rng_restore, rng_snapshot
from . import forensics
from .detector import Detector, batch_probes, let_go_clean
from .fed import moved, refilled
from .modules import ddp_inner, eager, type_name
from .records import CHECK, OUT, Context, version_of


_CARRIED_LISTS = ("buckets", "bucket_groups", "bucket_passes", "summed_after", "batches", "contexts", "parts")
"""what the original pass left in the step's log that the re-run does not make again"""
_CARRIED = ("produced", "left", "unmeasured", "started", "trained", "buffers_at_start", "buffer_versions", "parts_over",
            "parts_unchecked")


_UNKEPT = ("the backward pass of micro-batch(es) {} was not re-run: the gradient that reached the model's output was not"
           " kept (past what is left of detail_mb; on a CPU, larger than what a step holds through its backward pass,"
           " detector.HELD_ON_CPU), so whether it makes these gradients non-finite again is not known")
_REFILLED = ("micro-batch(es) {} were fed memory that a later micro-batch's input shares (one buffer refilled between"
             " them, through .data or a numpy view, which no in-place version tells), so what they were fed may be"
             " gone: a clean re-run of them proves no transient")
_BACKWARD_CLEAN = ("its backward pass, re-run from the gradient that reached the model's outputs, made every gradient"
                   " finite: the non-finite ones came from a transient fault of the original pass, or from the script's"
                   " own use of the model's parts or parameters outside its forward, which no re-run repeats (the full"
                   " mode names such a call)")


@dataclass(slots=True)
class Look:
    """What the microscope's re-run saw, beside the probes it left in the step's log."""

    ran: int = 0
    """micro-batches re-run"""
    missed: list[str] = field(default_factory=list)
    """why micro-batches (or their backward pass) could not be re-run"""
    forward_values: tuple[int, int] = (0, 0)
    """which of the log's ``values`` the re-run's forwards made: the checks made before the step's first
    forward come before them, the others after"""
    original_outputs_bad: bool | None = None
    """the original forwards' root outputs held a non-finite value (None: not kept, or changed since)"""
    bad_output: tuple[int | None, torch.Tensor, bool] | None = None
    """the original forwards' first non-finite kept output: (its micro-batch, the output itself or, where
    only they were kept, its extremes, whether it is the output itself)"""
    backward_bad: bool | None = None
    """the backward re-run from the kept output gradients made a non-finite parameter gradient (None: not run)"""
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """the floating outputs of each forward re-run, by micro-batch"""
    root_type: str = ""
    """the type of the model re-run (what a transient in its forward is reported on)"""
    bad: list[int] = field(default_factory=list)
    """the micro-batches (their forwards' indices) whose re-run made a non-finite output or gradient"""
    backward_first: int | None = None
    """the micro-batch whose backward re-run first made a non-finite gradient, of a finite output"""
    kept_outputs: dict[int, list[tuple[torch.Tensor, int]]] = field(default_factory=dict)
    """the original forwards' outputs as kept (``StepLog.outputs``), by micro-batch"""
    diverged: bool = False
    """a micro-batch's re-run made a non-finite output where its original forward's kept output is finite:
    what it ran with changed since (the script wrote the weights between micro-batches, or its model keys
    on the script's state), so the re-run's probes do not tell where the original's value was born"""
    parts_bad: bool = False
    """a re-run of a call the script made of a model's part (``StepLog.parts``) made a non-finite output"""
    output_grads: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    """the gradients that reached each forward's output in the original pass (``StepLog.output_grads``)"""
    gradient_in_bad: list[int | None] = field(default_factory=list)
    """the micro-batches (None: a forward that is none's) whose gradient that reached the root's output in the original pass was
    non-finite: it came from above the model (the loss), which no re-run of the model makes"""
    unkept: list[int] = field(default_factory=list)
    """the micro-batches whose backward pass ran but whose output's gradient was not kept: not re-run"""
    unchecked_parts: int = 0
    """calls of the model's parts with autograd off in the original pass: not checked (``StepLog.parts_unchecked``)"""
    refilled: list[int] = field(default_factory=list)
    """the micro-batches whose inputs, held by reference, begin where a later micro-batch's do: a buffer
    refilled between them where no in-place version tells it (written through ``.data``, or a numpy
    view), so what they were fed may be gone"""

    @property
    def unsure(self) -> bool:
        """Some of the step was not re-run, or not from what it was fed: a clean re-run proves nothing."""
        return bool(self.missed or self.refilled)

    def forward_probes(self, probes: list[float]) -> list[float]:
        """The probes (as read from the log) that the re-run's forwards made."""
        return probes[self.forward_values[0]:self.forward_values[1]]

    def reproduced(self, forward_bad: bool, own_fault: bool | None) -> bool | None:
        """True: the re-run made a value non-finite again; False: the original forward made a non-finite
        output and its re-run, of everything the original saw go bad, stayed finite; None: it cannot tell
        (and ``missed`` says why). Gradients alone (``own_fault``: this rank's own were bad, not another
        rank's) that a clean backward re-run does not make again are no proof of a transient."""
        if self.diverged:
            return None
        if forward_bad or self.bad or self.parts_bad or self.backward_bad:
            return True
        if self.missed or not self.ran:
            return None
        if self.original_outputs_bad and self.refilled:
            self.missed.append(_REFILLED.format(", ".join(map(str, self.refilled))))
            return None
        if self.original_outputs_bad:
            return False  # the original forward made it; the same forward, re-run, did not
        if own_fault and self.unkept:
            self.missed.append(_UNKEPT.format(", ".join(map(str, self.unkept))))
        elif own_fault and self.backward_bad is False and not self.gradient_in_bad:
            # no proof of a transient: the gradients also hold what the script's own code outside the model's
            # forwards added (a part it called, a parameter it used), which no re-run of the model makes
            self.missed.append(_BACKWARD_CLEAN)
        return None


def device_name() -> str:
    """The device this rank computes on, as a report names it: ``cuda:N`` with the GPU's UUID, or cpu."""
    if cuda_in_use():
        index = torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return f"cuda:{index} GPU-{uuid}" if uuid is not None else f"cuda:{index}"
    return "cpu"


@contextmanager
def rerun(detector: Detector, params: list[torch.Tensor], probes: list[float]) -> Iterator[Look]:
    """Re-run the step's micro-batches under the full probes; inside the block the step's log holds
    the re-run's forward probes, then the original checks, beside what the original backward pass left.
    ``params``: the parameters whose gradients the backward re-run reads; ``probes``: the original
    probes as the decision read them."""
    log = detector.log
    probed_bad = any(record.role == OUT and not (math.isfinite(probes[record.pos]) and math.isfinite(
        probes[record.pos + 1])) for record in log.records if record.pos >= 0 and record.pos + 1 < len(probes))
    carried = {name: list(getattr(log, name)) for name in _CARRIED_LISTS}
    kept = {name: getattr(log, name) for name in _CARRIED}
    unpropagated = set(log.unpropagated)
    outputs, output_grads = dict(log.outputs), dict(log.output_grads)
    first = log.spans[0][0] if log.spans else len(log.records)
    checks: tuple[list, list] = ([], [])  # (made before the step's first forward, after it)
    for index, record in enumerate(log.records):
        if record.role == CHECK:
            checks[index >= first].append((record.held(), record.slot, _place(record.held(), outputs)))
    look = Look(original_outputs_bad=True if probed_bad else _outputs_bad(outputs, len(log.spans)),
                output_grads=output_grads, kept_outputs=outputs)
    if look.original_outputs_bad and (first := _first_bad(outputs)) is not None:
        forward, tensor, version = first
        look.bad_output = (log.contexts[forward].micro_batch if forward < len(log.contexts) else None,
                           tensor, version >= 0)
    look.unchecked_parts = log.parts_unchecked
    look.refilled = [log.contexts[k].micro_batch if k < len(log.contexts) else k for k in refilled(log.batches)]
    look.gradient_in_bad = [log.contexts[k].micro_batch if 0 <= k < len(log.contexts) else None
                            for k, (_, g) in sorted(output_grads.items()) if not bool(torch.isfinite(g).all())]
    look.unkept = [context.micro_batch for k, context in enumerate(log.contexts)
                   if context.grad and k not in unpropagated and k not in output_grads]
    if log.parts_over:
        look.missed.append(f"{log.parts_over} calls of the model's parts by the script beyond the first {len(log.parts)}:"
                           " not held, so not re-run")
    detector.reset(decided=False)
    was_probing = detector.probes.on
    detector.probes.install()
    try:
        with untouched(detector):
            _rerun_all(detector, look, carried, output_grads, params, checks)
    finally:
        detector.depth = 0
        if not was_probing:
            detector.probes.remove()
        for name, value in carried.items():
            getattr(log, name)[:] = value
        for name, value in kept.items():
            setattr(log, name, value)
        log.unpropagated.update(unpropagated)
    yield look


def _rerun_all(detector: Detector, look: Look, carried: dict[str, list], output_grads: dict,
               params: list[torch.Tensor], checks: tuple[list, list]) -> None:
    """Each micro-batch again, the original checks in their place, before the forwards or after them (a
    loss the model returned: its re-run's)."""
    log = detector.log
    parts = carried["parts"]
    names = {index: name for name, index in detector.catalog.check_names.items()}
    _recheck(detector, look, checks[0], names)
    begun = len(log.values)
    for forward, ((slot, args, kwargs, versions), context) in enumerate(zip(carried["batches"],
                                                                            carried["contexts"])):
        if context.module is None and any(part[0] == forward for part in parts):
            # a micro-batch the script began itself (Guard.begin_micro_batch) is its calls of the model's parts
            log.spans.append((len(log.records), slot, context.micro_batch))
            copies: dict[int, torch.Tensor] = {}  # (a part given a tensor of the batch is given its copy)
            _fed(detector, args, kwargs, slot, copies)
            for k, part in enumerate(parts):
                if part[0] == forward:
                    _rerun_part(detector, look, k, *part[1:], copies=copies)
            log.span_ends[len(log.spans) - 1] = len(log.records)
        else:
            _rerun_one(detector, look, forward, slot, args, kwargs, versions, context,
                       output_grads.get(forward), params)
    for k, part in enumerate(parts):
        if part[0] < 0 or part[0] >= len(carried["batches"]):
            _rerun_part(detector, look, k, *part[1:])
    look.forward_values = (begun, len(log.values))
    _recheck(detector, look, checks[1], names)


def _recheck(detector: Detector, look: Look, checks: list, names: dict[int, str]) -> None:
    """The step's checks again, of the tensors they were given (a loss the model returned: its re-run's)."""
    for tensor, index, place in checks:
        if place is not None and place[0] in look.outputs and place[1] < len(look.outputs[place[0]]):
            tensor = look.outputs[place[0]][place[1]]
        if tensor is not None and index in names:
            detector.check(tensor, names[index])


@contextmanager
def untouched(detector: Detector) -> Iterator[None]:
    """A re-run inside the block leaves the RNG and the guarded models' floating buffers (BatchNorm's
    statistics, written in training mode) as they were, and the root hooks keep out of it."""
    rng = rng_snapshot(host=False)
    buffers = floating_buffers(detector)
    saved = [(version_of(b), b.detach().clone()) for b in buffers]
    detector.rerunning = True
    try:
        yield
    finally:
        detector.rerunning = False
        rng_restore(rng)
        with torch.no_grad():
            for buffer, (version, value) in zip(buffers, saved):
                if version_of(buffer) != version:  # written by the re-run (BatchNorm's statistics in training)
                    buffer.data.copy_(value)  # (through .data: what the step wrote is told by versions)


def called(module: torch.nn.Module, args: tuple, kwargs: dict, grad: bool,
           autocast: tuple[tuple[str, torch.dtype], ...], forward: Any = None,
           handed: dict[str, torch.Tensor] | None = None) -> Any:
    """``module(*args, **kwargs)`` under the grad mode and the autocasts a micro-batch's forward ran in,
    with the ``forward`` it held as its own attribute then, if any (``Context.forward``), and the weights
    it was handed in the place of its own (``Context.handed``)."""
    with ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        for device, dtype in autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        if forward is not None:
            stack.enter_context(_forward_as(module, forward))
        if handed is not None:
            return torch.func.functional_call(module, handed, args, kwargs)
        # eagerly: every module's probe sees its output exactly, where a compiled graph shows only
        # what its leaves return
        return eager(module)(*args, **kwargs)


@contextmanager
def _forward_as(module: torch.nn.Module, forward: Any) -> Iterator[None]:
    """``module.forward`` is ``forward`` inside the block, what it was after."""
    before = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if before is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = before


def _rerun_one(detector: Detector, look: Look, forward: int, slot: int, args: tuple, kwargs: dict,
               versions: list[tuple[torch.Tensor, int]], context: Context, output_grad: tuple[int, torch.Tensor] | None,
               params: list[torch.Tensor]) -> None:
    module = context.module() if context.module is not None else None
    if module is None:
        look.missed.append(f"micro-batch {forward}: no module to call again (the script called the model's parts)")
        return
    if any(moved(t, version) for t, version in versions):
        look.missed.append(f"micro-batch {forward}: its input was changed in place after its forward began")
        return
    inner = ddp_inner(module)
    module = inner or module  # (no communication: every rank re-runs its own)
    look.root_type = look.root_type or type_name(module)
    micro_batch = context.micro_batch  # (as counted: a guard without an optimizer counts the training model's)
    rng_restore(context.rng)
    log = detector.log
    log.spans.append((len(log.records), slot, micro_batch))
    args, kwargs = _fed(detector, args, kwargs, slot)
    detector.depth = 1
    try:
        output = called(module, args, kwargs, context.grad, context.autocast, context.forward, context.handed)
    except Exception as exc:  # noqa: BLE001 - the script's model failed on its own batch again
        look.missed.append(f"micro-batch {forward}: its re-run raised {type(exc).__name__}: {exc}")
        return
    finally:
        log.span_ends[len(log.spans) - 1] = len(log.records)
    look.ran += 1
    let_go_clean(detector)  # (a clean micro-batch's detail goes to the next, as in the original pass)
    look.outputs[forward] = floating_tensors(output)
    bad = not all_finite(look.outputs[forward])
    if bad and forward in look.kept_outputs and _outputs_bad({forward: look.kept_outputs[forward]}, 1) is False:
        look.diverged = True
        look.missed.append(f"micro-batch {forward}: its re-run made a non-finite output where its original forward"
                           " made none (what it ran with changed since: the weights written between micro-batches,"
                           " or the script's own state its model keys on)")
    # (not through FSDP2: its backward reduce-scatters, which every rank would have to run alike)
    if not bad and output_grad is not None and context.grad and not look.gradient_in_bad and not hasattr(
            module, "set_custom_reduce_scatter"):
        log.mark_backward(True)  # (what its probes see in there, checkpointing ran again: this micro-batch's)
        bad = backward_bad(look, output, output_grad, params, alone=inner is None)
        log.mark_backward(False)
        log.span_ends[len(log.spans) - 1] = len(log.records)
        look.backward_bad = bad or bool(look.backward_bad)
        if bad and look.backward_first is None:
            look.backward_first = micro_batch
    if bad:
        look.bad.append(forward)


def _rerun_part(detector: Detector, look: Look, k: int, args: tuple, kwargs: dict,
                versions: list[tuple[torch.Tensor, int]], context: Context,
                copies: dict[int, torch.Tensor] | None = None) -> None:
    """Re-run a call the script made of a model's part, outside any root forward: its probes are made
    as the full mode makes those of such a call (of no micro-batch)."""
    module = context.module() if context.module is not None else None
    if module is None or any(moved(t, version) for t, version in versions):
        look.missed.append(f"call {k + 1} of a model's part by the script: its module is gone or its input was"
                           " changed in place since")
        return
    rng_restore(context.rng)
    detector.depth = 0
    try:
        output = called(module, *_copies(args, kwargs, copies), context.grad, context.autocast, context.forward,
                        context.handed)
    except Exception as exc:  # noqa: BLE001 - the script's module failed on its own input again
        look.missed.append(f"call {k + 1} of a model's part by the script: its re-run raised {type(exc).__name__}: {exc}")
        return
    look.ran += 1
    look.parts_bad = look.parts_bad or not all_finite(floating_tensors(output))


def _fed(detector: Detector, args: tuple, kwargs: dict, slot: int,
         made: dict[int, torch.Tensor] | None = None) -> tuple[tuple, dict]:
    """The copies of a micro-batch's held arguments that its re-run is fed; the batch is probed as held (a
    forward that edits its input in place edits the copies), and the copies count as that batch."""
    batch_probes(detector, floating_tensors((args, kwargs)), slot)
    fed = _copies(args, kwargs, made)
    detector.mark_seen(floating_tensors(fed))
    return fed


def _copies(args: tuple, kwargs: dict, made: dict[int, torch.Tensor] | None = None) -> tuple[tuple, dict]:
    """Copies of a call's tensors to feed a re-run: a forward that edits its input in place must not edit
    what the capture holds. ``made``: the copies made so far, by ``id`` of the original, to share."""
    made = {} if made is None else made

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            made[id(tensor)] = tensor.detach().clone().requires_grad_(tensor.requires_grad)
        return made[id(tensor)]

    with torch.no_grad():
        return map_tensors((args, kwargs), copy)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (exact; reads the host: on a bad step only)."""
    with torch.no_grad():
        return all(bool(torch.isfinite(_dense(t)).all()) for t in tensors)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """What holds a tensor's values: a sparse one's (an embedding's sparse gradient), else its plain view."""
    return tensor.coalesce().values() if tensor.is_sparse else forensics.plain(tensor)


def backward_bad(look: Look, output: Any, output_grad: tuple[int, torch.Tensor],
                 params: list[torch.Tensor], alone: bool = False) -> bool:
    """The re-run's backward pass from its output, fed the gradient the original's output received:
    whether it made a parameter's gradient non-finite (``_gradients``; ``alone``: no DDP reducer listens
    on the parameters)."""
    at, grad = output_grad
    tensors = floating_tensors(output)
    wanted = [p for p in params if p.requires_grad]
    if at >= len(tensors) or not tensors[at].requires_grad or not wanted or tensors[at].shape != grad.shape:
        look.missed.append("a backward pass: the re-run's output differs from the original's")
        return False
    try:
        grads = _gradients(tensors[at], wanted, grad, alone)
    except RuntimeError as exc:
        look.missed.append(f"a backward pass: its re-run raised {exc}")
        return False
    return not all_finite([g for g in grads if g is not None])


def _gradients(output: torch.Tensor, params: list[torch.Tensor], grad: torch.Tensor,
               alone: bool) -> list[torch.Tensor | None]:
    """The parameters' gradients of ``output`` fed ``grad``, by ``torch.autograd.grad``; which reentrant
    checkpointing refuses: then, ``alone``, by ``output.backward(grad)`` into ``.grad``, which holds the step's
    own again after (not where a hook listens on a parameter's accumulation)."""
    try:
        return list(torch.autograd.grad(output, params, grad_outputs=grad, allow_unused=True, retain_graph=alone))
    except RuntimeError as exc:
        if not (alone and "use_reentrant=True" in str(exc)) or any(
                getattr(p, "_post_accumulate_grad_hooks", None) for p in params):
            raise
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        output.backward(grad)
        return [p.grad for p in params]
    finally:
        for p, kept in zip(params, saved):
            p.grad = kept


def _place(tensor: torch.Tensor | None, outputs: dict[int, list[tuple[torch.Tensor, int]]]) -> tuple[int, int] | None:
    """(forward, position among its floating outputs) of a checked tensor that a root forward
    returned (a model's own loss), or None."""
    for forward, held in outputs.items():
        for k, (output, _) in enumerate(held):
            if output is tensor:
                return forward, k
    return None


def _outputs_bad(outputs: dict[int, list[tuple[torch.Tensor, int]]], forwards: int) -> bool | None:
    """Whether the original forwards' kept outputs hold a non-finite value, exactly; None when one
    forward's are not kept or were changed in place since."""
    if len(outputs) < forwards or any(version >= 0 and version_of(tensor) != version
                                      for held in outputs.values() for tensor, version in held):
        return None
    return _first_bad(outputs) is not None


def _first_bad(outputs: dict[int, list[tuple[torch.Tensor, int]]]) -> tuple[int, torch.Tensor, int] | None:
    """The first non-finite kept output, in the order of the forwards: (forward, tensor, version)."""
    for forward, held in sorted(outputs.items()):
        for tensor, version in held:
            with torch.no_grad():
                if not bool(torch.isfinite(tensor).all()):
                    return forward, tensor, version
    return None


def floating_buffers(detector: Detector) -> list[torch.Tensor]:
    """Every floating buffer of the guarded models (a re-run in training mode writes BatchNorm's)."""
    seen: set[int] = set()
    found = []
    for info in detector.catalog.slots:
        module = info.module()
        if module is None:
            continue
        for buffer in module.buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point() and id(buffer) not in seen:
                seen.add(id(buffer))
                found.append(buffer)
    return found

