"""From the records of a bad step to the Event that names where the first non-finite value was
born. Slow and exact (it reads tensors), and only ever run once a step is known to be bad.

Forward first: the first non-finite probe in execution order, confirmed exactly when its tensor
is still there (explain.py says why it was born there). Then gradients: the first bad parameter
gradient in backward order.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any

import torch

from ..events import Event, within
from . import forensics
from .explain import bad_state, code_between, finite_extremes, forward_fields
from .reading import Finding, Reading
from .records import CHECK, IN, OUT, Catalog, StepLog

MakeEvent = Callable[[dict[str, Any]], Event]
"""builds an Event from its fields, adding rank, step, host and time"""

_FROM_OTHER_RANK = ("this rank's own gradients were finite before they were summed across ranks (DDP's"
                    " all-reduce, FSDP's reduce-scatter): another rank sent the non-finite values")
_SUMMED_BEFORE = ("the gradients were already non-finite right after the sum across ranks of backward pass {0} of"
                  " this step (accumulation without no_sync: every pass is summed), which this rank's own"
                  " gradients went into finite: that sum made them (an overflow, a communication hook such as"
                  " fp16 compression), or brought them from another rank")
_SCATTERED = ("the gradients of a sharded model (FSDP2) are reduce-scattered across ranks before they are"
              " checked: this rank holds the shard where the non-finite values landed, and the rank whose"
              " backward pass made them is not known")


_LOSS_ACROSS_RANKS = ("with several ranks, that loss may hold another rank's values (an all_gather of"
                      " every rank's outputs, in a contrastive loss), which its backward sends back here")


_UNMEASURED = ("how the step's last backward pass left them was not measured (the step had fewer micro-batches than"
               " the steps before it, and the training loop changed the gradients in place before the optimizer step:"
               " clipping, unscaling), so whether that pass or the loop made them non-finite, and where, is not known")

def first_bad(catalog: Catalog, log: StepLog, reading: Reading, make: MakeEvent,
              owners: list[torch.Tensor] = (), grads: list[torch.Tensor] = (),
              written: list[tuple[str, torch.Tensor]] = (), later: list[torch.Tensor] = ()) -> Finding | None:
    """The step's first non-finite value: a module output or a checked tensor, else a buffer the
    forward wrote, else a parameter gradient as the backward pass left it, else one made
    non-finite after it. ``reading``: what the decision read; ``owners``/``grads``: the parameters
    that have a gradient and those gradients; ``written``: the buffers the step wrote, by name;
    ``later``: the parameters of ``reading.applied``. None when nothing is bad (a norm that
    overflowed on finite values)."""
    extremes = log.extremes(reading.probes, reading.evidence)
    first = _first_bad_output(log, extremes)
    if first is not None:
        first, fields = _past_masks(catalog, log, extremes, first)
        record = log.records[first]
        info = catalog.slots[record.slot] if record.role != CHECK else None
        module = info.module() if info is not None else None
        own = module is not None and any(_sharded(p) for p in module.parameters()) and bool(bad_state(log, info))
        return Finding(make(fields), position=None if record.compiled else (log.micro_batch_of(first) or 0, record.call),
                       own_state=own)
    fields = buffer_fields(catalog, log, written, reading.buffers)
    if fields is not None:
        return Finding(make(fields))
    fields = gradient_fields(catalog, log, owners, grads, reading.norms, extremes)
    if fields is not None and log.unmeasured:
        return Finding(make(fields | {"kind": "grad", "layer": "unknown", "module_type": "", "message": (
            f"{len(fields['extra']['bad_params'])} parameter gradient(s) are non-finite as the optimizer is to apply"
            f" them; {_UNMEASURED}")}))
    group = _first_bad_group(log, reading.buckets)
    if group is not None:  # FSDP2: where this rank's own gradients were bad, whatever its shards hold
        fields = _group_fields(catalog, log, group, fields, owners, reading.norms)
    if fields is None:
        # after the sum across ranks, a NaN another rank's backward made is that rank's to report
        summed = reading.local_grads_bad is not None or reading.several
        fields = _changed_after_backward(catalog, log, later, reading.applied, summed)
        return Finding(make(fields), born_here=not summed) if fields is not None else None
    local_grads_bad = reading.local_grads_bad
    if local_grads_bad is None and any(_sharded(p) for p in owners):
        fields["message"] = f"{fields['message']}; {_SCATTERED}"
        return Finding(make(fields), born_here=False)
    position = _backward_position(catalog, log, owners, fields)
    if local_grads_bad is None:
        return Finding(make(fields), position=position)
    summed_pass = _first_bad_pass(log, reading.buckets)
    if local_grads_bad and summed_pass and not _finite_after_sum(log, summed_pass - 1):
        # an earlier pass's sum made them, or brought them from another rank: not born here
        return Finding(make(_summed_before(catalog, owners, fields, summed_pass)), born_here=False,
                       position=position, summed_pass=summed_pass)
    fields["extra"]["born_here"] = local_grads_bad
    if not local_grads_bad:  # not this rank's loss: what the all-reduce brought in
        fields |= {"kind": "grad", "message": f"{fields['message']}; {_FROM_OTHER_RANK}"}
    elif fields["kind"] == "loss":
        fields["message"] = f"{fields['message']}; {_LOSS_ACROSS_RANKS}"
    return Finding(make(fields), born_here=local_grads_bad, position=position, summed_pass=summed_pass)


def _summed_before(catalog: Catalog, owners: list[torch.Tensor], fields: dict[str, Any],
                   summed_pass: int) -> dict[str, Any]:
    """``fields`` of a gradient finding whose gradients an earlier backward pass's sum across ranks
    had made non-finite already: named by its first bad parameter, with that as the cause (what the
    gradients alone said, the loss or a module's backward, is not)."""
    names = fields["extra"]["bad_params"]
    param = next((p for p in owners if catalog.param_name(p) == names[0]), None)
    slot = _owner(catalog, param) if param is not None else None
    return fields | {"kind": "grad", "layer": names[0], "extra": {**fields["extra"], "born_here": False},
                     "module_type": catalog.slots[slot].module_type if slot is not None else "",
                     "message": f"{len(names)} parameter gradient(s) are non-finite, {names[0]} first in backward"
                                f" order; {_SUMMED_BEFORE.format(summed_pass)}"}


def _finite_after_sum(log: StepLog, index: int) -> bool:
    """Whether the gradients were finite right after backward pass ``index``'s sum across ranks
    (``StepLog.summed_after``; True when not known)."""
    return index >= len(log.summed_after) or math.isfinite(float(log.summed_after[index]))


def _first_bad_pass(log: StepLog, buckets: list[float]) -> int:
    """The backward pass of the step (0: its first) whose probes before the sum across ranks were
    first non-finite (``StepLog.bucket_passes``); 0 when none was."""
    first = next((i for i, value in enumerate(buckets) if not math.isfinite(value)), None)
    return 0 if first is None else bisect.bisect_right(log.bucket_passes, first)


def _backward_position(catalog: Catalog, log: StepLog, owners: list[torch.Tensor],
                       fields: dict[str, Any]) -> tuple[float, int] | None:
    """Where in the backward pass a gradient finding's first bad gradient was made, comparable
    between ranks of one model (after every forward position): a NaN that a collective inside the
    backward (a synchronised norm's) hands to another rank shows there later in backward order."""
    if fields["kind"] != "grad":
        return None  # "loss" ranks with buffers and checks, which have no place in the backward pass
    first = fields["extra"]["bad_params"][0]
    param = next((p for p in owners if catalog.param_name(p) == first), None)
    slot = _owner(catalog, param) if param is not None else None
    order = log.backward_order(catalog.slots)
    return (math.inf, order.index(slot)) if slot in order else None


def _first_bad_output(log: StepLog, extremes: list[tuple[float, float] | None]) -> int | None:
    """The record of the step's first non-finite module output or checked tensor, or None."""
    return next((index for index, (record, pair) in enumerate(zip(log.records, extremes))
                 if record.role in (OUT, CHECK) and not finite_extremes(pair)), None)


_MASKED_BEFORE = ("{} made -inf before it in this step, and nothing else non-finite (as an intended mask does,"
                  " which the loss may take finite): not taken for the cause of a value made here, by a"
                  " module whose own state is non-finite")


_MASK_OR_NOT = ("its only non-finite values are -inf, as an intended mask makes: if it masks on purpose, what"
                " made the step bad after it may have another cause (the loss, its target, code outside the model's"
                " modules), which guard.check on the loss and its inputs tells")


def _past_masks(catalog: Catalog, log: StepLog, extremes: list[tuple[float, float] | None],
                first: int) -> tuple[int, dict[str, Any]]:
    """(record, its event fields) of the step's first bad forward value: ``first``, unless its only
    non-finite values are -inf (an intended mask, say: a policy's illegal actions) and a later module
    whose own parameters or buffers are non-finite made a NaN or +inf, which is then what the step is
    stopped for."""
    fields = forward_fields(catalog, log, extremes, first)
    if log.records[first].role != OUT or not _minus_inf_only(extremes[first]):
        return first, fields
    # a later output made NaN or +inf by a module whose own state is non-finite: a fault of its own, whatever it took
    index = next((i for i in range(first + 1, len(log.records)) if log.records[i].role == OUT and not (
        finite_extremes(extremes[i]) or _minus_inf_only(extremes[i])) and bad_state(
        log, catalog.slots[log.records[i].slot])), None)
    if index is not None:
        later = forward_fields(catalog, log, extremes, index)
        mask = catalog.slots[log.records[first].slot].name or "the model"
        return index, later | {"message": "; ".join(filter(None, (later.get("message"), _MASKED_BEFORE.format(mask))))}
    fields["message"] = "; ".join(filter(None, (fields.get("message"), _MASK_OR_NOT)))
    return first, fields


def finite_forward(unchecked: int) -> str:
    """That the step's forward was finite, as far as it was checked (``StepLog.parts_unchecked``: what was not)."""
    if not unchecked:
        return "the forward was finite"
    return (f"the forward was finite where it was checked ({unchecked} call(s) of the model's parts"
            " with autograd off in this step, a teacher's targets say, were not: a NaN they made would show"
            " only in the loss; guard.check what they return)")


def _minus_inf_only(pair: tuple[float, float] | None) -> bool:
    """Whether a probe's non-finite values are -inf alone (its minimum -inf, its maximum below +inf)."""
    return pair is not None and pair[0] == -math.inf and not math.isnan(pair[1]) and pair[1] != math.inf


def buffer_fields(catalog: Catalog, log: StepLog, written: list[tuple[str, torch.Tensor]],
                  probes: list[float]) -> dict[str, Any] | None:
    """Event fields of the first buffer the step's forward wrote non-finite (its outputs were
    finite: BatchNorm's running statistics can overflow while its normalised output does not), or
    that was non-finite already when the step began (written outside the guarded steps).
    ``probes``: what ``Buffers.probes`` read of them."""
    if all(map(math.isfinite, probes)):
        return None
    bad = next(((name, b) for name, b in written if not forensics.is_finite(b)), None)
    if bad is None:
        return None
    name, buffer = bad
    owner = next((s for s in catalog.slots if s.name == name.rpartition(".")[0]), None)
    start = log.buffers_at_start.get(name)
    if start is not None and not forensics.is_finite(start):
        message = ("it was non-finite already when the step began (written before it: by an earlier step"
                   " let through, a checkpoint loaded, code between steps); this step's outputs were finite,"
                   " and putting the buffer back as the step began does not mend it")
    else:
        message = ("written by this step's forward, whose outputs were finite; the buffer is put back as it"
                   " was before the step when the step is stopped or skipped")
    return {"kind": "buffer", "layer": name, "module_type": owner.module_type if owner else "",
            **forensics.describe(buffer), "message": message}


def gradient_fields(catalog: Catalog, log: StepLog, owners: list[torch.Tensor],
                    grads: list[torch.Tensor | None], norms: list[float],
                    extremes: list[tuple[float, float] | None] = ()) -> dict[str, Any] | None:
    """Event fields of the first non-finite parameter gradient in backward order, or None.

    ``norms`` are the gradients' norms as the backward pass left them (the training loop may have
    clipped or unscaled them since: a clipped NaN spreads to every gradient); ``extremes``: the
    step's probes by record (``StepLog.extremes``)."""
    bad, order = _bad_gradients(catalog, log, owners, grads, norms)
    if not bad:
        return None  # norms that overflowed on finite gradients
    fields = _gradient_event(catalog, bad)
    names = fields["extra"]["bad_params"]
    slot = _owner(catalog, bad[0][0])
    counted = f"{len(bad)} of {len(grads)} parameter gradients are non-finite"
    if not any(record.role == OUT for record in log.records):
        # no module output of this step was checked: nothing says the forward was finite
        return fields | {"message": f"{counted}, this one first in backward order; no module output of the"
                                    " model was checked in this step (a forward inside torch.func's vmap or"
                                    " grad is not, nor one the microscope could not re-run; a model compiled in"
                                    " place with module.compile() before a bare nanguard.init() is never seen:"
                                    " pass it to init), so whether it was born in the forward or the backward"
                                    " is unknown"}
    hidden = _hidden_nan(catalog, log, extremes)
    if hidden:
        return fields | {"message": f"{counted}, this one first in backward order; {hidden}"}
    last = next(iter(order), None)  # the last module to run: the first in backward order
    if last is not None and slot == last:
        # Even the first gradients of the backward pass are bad: what entered it was.
        described = ("shape", "dtype", "numel", "bad_count", "nan_count", "inf_count", "first_index", "first_value",
                     "finite_min", "finite_max", "finite_mean")  # (the gradient's, not the loss's)
        return {key: value for key, value in fields.items() if key not in described} | {
            "kind": "loss", "layer": "loss", "module_type": "",
            "message": f"{finite_forward(log.parts_unchecked)} but {counted}, starting with {names[0]}, the first"
                       " in backward order: either the gradient entering the model's backward pass was"
                       " non-finite, most likely made by the loss (or code between the model and the"
                       " loss; guard.check(loss) shows the loss's value), or the backward of"
                       f" {catalog.slots[slot].name or 'the model'} itself made it (a custom autograd"
                       " Function there, say; a replay's operation check tells the two apart)"}
    if slot is None and id(bad[0][0]) not in catalog.param_names:
        return fields | {"message": f"{counted}, this one first in backward order; it belongs to no module of the"
                                    " guarded model (an optimizer given to init steps another model's parameters:"
                                    " guard that model too, in one container with this one, or with a guard"
                                    " of its own), so where it was born is not known here"}
    if slot not in order:
        return fields | {"message": f"{counted}; the forward of its module did not run in this step (since the"
                                    " last optimizer step): its output was made earlier and used again, as a"
                                    " GAN's generator's is, so what the backward pass went through before it"
                                    " is not known here: it was born in that backward pass, or came in with"
                                    " the loss's gradient"}
    return fields | {"message": f"{counted}, this one first in backward order; {_before(catalog, list(order), slot, owners, norms)}"}


def _hidden_nan(catalog: Catalog, log: StepLog, extremes: list[tuple[float, float] | None]) -> str:
    """Where a backpropagated forward of the step held a NaN that reached no module output checked
    (an input made between modules, as evidence), as words to follow the gradients' count; "" if
    none did. An operation can hide a NaN in its forward and not in its backward (attention over
    NaN scores, a max, a masked select): the forward was not finite. Infinities alone are not
    looked at: models make -inf on purpose (additive masks)."""
    for j, pair in enumerate(extremes):
        record = log.records[j]
        if record.role != IN or pair is None or not (math.isnan(pair[0]) or math.isnan(pair[1])):
            continue
        if bisect.bisect_right(log.spans, (j, math.inf, math.inf)) - 1 in log.unpropagated:
            continue  # (a forward the script never backpropagated)
        name = catalog.slots[record.slot].name or "the root module"
        return (f"the forward was not finite, though no module output checked was: the input of {name} held"
                f" NaN, made in the forward code of {code_between(catalog, log, extremes, j)}, and an operation"
                " after it hid it (as attention over NaN scores, a max or a masked select can) from the outputs,"
                " not from the backward pass: most likely the gradients took it from there")
    return ""


def _bad_gradients(catalog: Catalog, log: StepLog, owners: list[torch.Tensor], grads: list[torch.Tensor | None],
                   norms: list[float]) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], dict[int, int]]:
    """(the (parameter, gradient) pairs whose gradient is non-finite, in backward order; that order,
    module slot to place). A NaN norm means a NaN gradient; an infinite one, an Inf or an overflow
    of huge finite values, which only the gradient itself can tell apart."""
    bad = [(p, g) for p, g, n in zip(owners, grads, norms) if math.isnan(n) or (
        not math.isfinite(n) and (g is None or not forensics.is_finite(g)))]
    order = {slot: i for i, slot in enumerate(log.backward_order(catalog.slots))} if bad else {}
    bad.sort(key=lambda pg: order.get(_owner(catalog, pg[0]), len(order)))
    return bad, order


def _gradient_event(catalog: Catalog, bad: list[tuple[torch.Tensor, torch.Tensor | None]]) -> dict[str, Any]:
    """Event fields of the first of ``bad`` gradients, the others' names beside it."""
    param, grad = bad[0]
    slot = _owner(catalog, param)
    names = [catalog.param_name(p) for p, _ in bad]
    return {"kind": "grad", "layer": names[0], "module_type": catalog.slots[slot].module_type if slot is not None else "",
            **(forensics.describe(grad) if grad is not None else {"has_nan": True}), "extra": {"bad_params": names[:16]}}


def _changed_after_backward(catalog: Catalog, log: StepLog, owners: list[torch.Tensor], norms: list[float],
                            summed: bool) -> dict[str, Any] | None:
    """Event fields of the gradients the optimizer is about to apply, non-finite though every one
    was finite as the backward pass left them; None if none is. ``summed``: this rank's gradients
    are summed across ranks after the backward pass (DDP)."""
    grads = [None if p.grad is None else forensics.plain(p.grad) for p in owners]
    bad, _ = _bad_gradients(catalog, log, owners, grads, norms)
    if not bad:
        return None
    fields = _gradient_event(catalog, bad)
    fields["extra"]["after_backward"] = True
    by = ("the sum across ranks (an all-reduce whose sum overflowed, a communication hook such as fp16"
          " compression) or the script's own code there" if summed else "the script's own code there")
    return fields | {"message": (
        f"{len(bad)} of {len(grads)} parameter gradients are non-finite as the optimizer is about to apply them,"
        f" {fields['layer']} first in backward order, though every gradient was finite as the backward pass left"
        f" it: they were made non-finite after it, before the optimizer step, by {by} (unscaling, clipping, a"
        " division by a count that was zero)")}


def _first_bad_group(log: StepLog, buckets: list[float]) -> tuple[str, bool] | None:
    """(the ``fully_shard``-ed module, held NaN) of the first FSDP2 reduce-scatter of the step,
    in backward order, whose input (this rank's own gradients) was non-finite; None if none was
    or the model is not FSDP2's."""
    for k, name in enumerate(log.bucket_groups):
        low, high = buckets[2 * k:2 * k + 2]
        if not (math.isfinite(low) and math.isfinite(high)):
            return name, math.isnan(low) or math.isnan(high)
    return None


def _group_fields(catalog: Catalog, log: StepLog, group: tuple[str, bool], fields: dict[str, Any] | None,
                  owners: list[torch.Tensor], norms: list[float]) -> dict[str, Any] | None:
    """The gradient event of an FSDP2 rank whose own gradients of module ``group`` were bad before
    the reduce-scatter: ``fields`` when its first bad shard is that module's first parameter in
    backward order (or the loss's), else that module's first parameter, named as one of them: the
    bad values may have gone to other ranks' shards (a finite shard of a parameter before it says
    nothing of its whole gradient), and which of its parameters held them is not known here."""
    name, nan = group
    groups = sorted(set(log.bucket_groups), key=len, reverse=True)

    def group_of(param: str) -> str:
        return next((g for g in groups if within(param, g)), "")

    order = {slot: i for i, slot in enumerate(log.backward_order(catalog.slots))}
    members = sorted((p for p in owners if group_of(catalog.param_name(p)) == name),
                     key=lambda p: order.get(_owner(catalog, p), len(order)))
    first = next((p for p in owners if fields is not None and catalog.param_name(p) == fields["layer"]), None)
    if fields is not None and (fields["kind"] == "loss" or (
            members and first is not None and _owner(catalog, first) == _owner(catalog, members[0]))):
        return fields
    if not members:
        return fields
    slot = _owner(catalog, members[0])
    names = [catalog.param_name(p) for p in members]
    where = (f"this one first in backward order; {_before(catalog, list(order), slot, owners, norms)}"
             if slot in order else "where in the backward pass is not known (its module ran no forward in this step)")
    return {"kind": "grad", "layer": names[0], "module_type": catalog.slots[slot].module_type if slot is not None else "",
            "has_nan": nan, "extra": {"bad_params": names[:16]},
            "message": f"this rank's own gradients of {name or 'the root module'} (fully_shard-ed: {', '.join(names[:4])}"
                       f"{' ...' if len(names) > 4 else ''}) were non-finite before FSDP's reduce-scatter, the first"
                       " module's to be; each one's bad values went to whichever rank's shard holds their rows, so"
                       f" this rank's shards do not tell which of its parameters held them: {where}"}


def _before(catalog: Catalog, order: list[int], slot: int, owners: list[torch.Tensor], norms: list[float],
            most: int = 4) -> str:
    """Where in the backward pass the first bad gradient (of ``slot``, in backward ``order``) was
    born: after the gradients of the module made just before it, when those were produced by this
    backward and finite, and through what ran between the two in the forward. When no module
    after it in the forward left a gradient checked at this step (no trainable parameters, frozen,
    another optimizer's), the gradient may as well have come in with the loss's."""
    finite: dict[int, bool] = {}
    for param, norm in zip(owners, norms):
        if param.requires_grad:  # a frozen one's gradient is not this backward's
            for holder in catalog.param_holders.get(id(param), ()):  # (a tied weight: each module using it)
                finite[holder] = finite.get(holder, True) and math.isfinite(norm)
    position = order.index(slot)
    earlier = [i for i in range(position) if order[i] in finite]
    after = order[earlier[-1]] if earlier else None
    between = [catalog.slots[s] for s in reversed(order[earlier[-1] + 1 if earlier else 0:position])
               if not catalog.slots[s].container]
    ran = ", ".join(f"{info.name} ({info.module_type})" for info in between[:most])
    if after is None:
        return ("the forward was finite, but no module that ran after it in the forward left a gradient"
                " checked at this step (no trainable parameters, frozen, or another optimizer's"
                f"{': ' + ran if ran else ''}), so it was born in their backward pass or in its own"
                " module's, or came in with the loss's gradient; guard.check(loss) shows the loss's value")
    # bad gradients are in order of their owners: a module that ran after it with a bad one holds a
    # weight tied to a module that ran before (an output layer's, the embedding's), whose gradient
    # sums both uses: which use made the NaN is not known
    tied = [catalog.slots[s].name for s in order[:position] if not finite.get(s, True)]
    if not finite[after]:
        name = catalog.slots[after].name
        return (f"it was born in the backward pass between the gradients of {name} and this one, or in {name}'s"
                " own backward, or came in with the loss's gradient: the gradient of"
                f" {name} is non-finite too, but through a weight it shares with a module that ran before it"
                " (tied), whose gradient sums both uses, so it does not tell which; guard.check(loss) shows the"
                " loss's value")
    text = ("the forward and the gradients of the modules that ran after it were finite"
            f"{' (but for ' + ', '.join(tied[:4]) + ', whose weight is tied to a module that ran before it)' if tied else ''},"
            " so it was born in the backward pass")
    if finite[after]:
        text += (f" between the gradients of {catalog.slots[after].name} (finite) and this one, or before those"
                 " on a path that went around its parameters (a residual connection, a ReLU that was off there)")
        if ran:
            text += "; what ran between them in the forward, without parameters: " + ran
    return text


def _owner(catalog: Catalog, param: torch.Tensor) -> int | None:
    """The slot of the module that owns ``param`` (the first attached that holds it: of a tied
    weight, the embedding)."""
    return catalog.param_holders.get(id(param), [None])[0]


def _sharded(param: torch.Tensor) -> bool:
    """A parameter this rank holds a shard of (a DTensor over several ranks: FSDP2, tensor parallel)."""
    mesh = getattr(param, "device_mesh", None) if type(param) is not torch.Tensor else None
    return mesh is not None and mesh.size() > 1


