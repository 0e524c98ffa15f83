"""From the records of a bad step to the Event that names where the first non-finite value was
born. Slow and exact (it reads tensors), and only ever run once a step is known to be bad.

Forward first: the first non-finite probe in execution order, confirmed exactly when its tensor
is still there. Then gradients: the first bad parameter gradient in backward order.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any

import torch

from ..events import Event, within
from . import forensics
from .buffers import NORMS
from .reading import Finding, Reading
from .records import BATCH, CHECK, IN, LINK, OUT, Catalog, Probe, Slot, StepLog, changed_since

MakeEvent = Callable[[dict[str, Any]], Event]
"""builds an Event from its fields, adding rank, step, host and time"""

_UNEXACT = ("no element detail: the tensor was freed and lay beyond the step's detail_mb budget"
            " (raise detail_mb to keep it)")
_NOT_KEPT = ("no element detail: the tensor was not kept (a forward whose every output was finite lets go of what"
             " it kept at its end, and a compiled graph keeps nothing of its inside)")
_UNVERSIONED = ("no element detail: an inference tensor (torch.inference_mode) keeps no version, so it"
                " cannot be told unchanged since it was checked")
_CHANGED = ("no element detail: the tensor was changed in place after it was checked (an in-place"
            " activation, say)")
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
_RECOMPUTED = ("made in the backward pass, where activation checkpointing ran this forward again: the"
               " step's forward pass had made no non-finite output before; what follows is of that run")


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
        record = log.records[first]
        fields = forward_fields(catalog, log, extremes, first)
        info = catalog.slots[record.slot] if record.role != CHECK else None
        module = info.module() if info is not None else None
        own = module is not None and any(_sharded(p) for p in module.parameters()) and bool(_bad_state(log, info))
        return Finding(make(fields), position=None if record.compiled else (log.micro_batch_of(first) or 0, record.call),
                       own_state=own)
    fields = buffer_fields(catalog, log, written, reading.buffers)
    if fields is not None:
        return Finding(make(fields))
    fields = gradient_fields(catalog, log, owners, grads, reading.norms, extremes)
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
                 if record.role in (OUT, CHECK) and not _finite(pair)), None)


def forward_fields(catalog: Catalog, log: StepLog, extremes: list[tuple[float, float] | None],
                   first: int) -> dict[str, Any]:
    """Event fields of ``first``, the first module output or checked tensor that is non-finite.
    The probes are exact (a tensor's minimum and maximum), so what they say needs no confirmation;
    the tensor, where it was kept, only adds the detail."""
    index = _passed_to(catalog, log, extremes, first)
    record, pair = log.records[index], extremes[index]
    tensor = record.tensor()
    stats = forensics.describe(tensor) if tensor is not None else _from_extremes(record, pair)
    fields = _explain(catalog, log, extremes, index, stats)
    if log.in_backward(first):
        fields["message"] = _join(_RECOMPUTED, fields.get("message"))
    return fields


def _own_inputs(log: StepLog, index: int) -> list[int]:
    """The evidence records of the call that made output ``index``, nearest first: its IN probes
    and its links (``LINK``), which come right before its outputs."""
    slot, found, j = log.records[index].slot, [], index - 1
    while j >= 0 and log.records[j].slot == slot and log.records[j].role in (IN, OUT, LINK):
        if log.records[j].role != OUT:
            found.append(j)
        j -= 1
    return found


def _passed_to(catalog: Catalog, log: StepLog, extremes: list[tuple[float, float] | None], index: int) -> int:
    """Where the bad value of output ``index`` was first seen, when a module passed it on
    (``Probe.passed``): the value its call took (a LINK), or one passed on inside it (a container
    whose own code computed its output from it); else ``index``. Only a NaN is followed: infinities
    come in on purpose (an additive -inf mask), and a module that takes them may make its own."""
    records = log.records
    carried = (lambda j: records[j].passed is not False and extremes[j] is not None and math.isnan(extremes[j][0]))
    inputs = _own_inputs(log, index)
    found = next((records[j].same_as for j in inputs if records[j].role == LINK and carried(records[j].same_as)), None)
    made = next((j for j in inputs if records[j].role == IN and not _finite(extremes[j])), None)
    if found is None and made is not None:
        # made in code from a value passed on since the last checked output (a mean of it)
        last = next((i for i in range(made - 1, -1, -1) if records[i].role == OUT), -1)
        found = next((i for i in range(last + 1, made) if records[i].role == IN and carried(i)), None)
    if found is None and records[index].role == OUT:
        name = catalog.slots[records[index].slot].name
        j = index - 1
        while j >= 0 and records[j].role != CHECK and within(catalog.slots[records[j].slot].name, name):
            if records[j].role == IN and carried(j):
                found = j  # the earliest, as the walk goes back
            j -= 1
    if found is None:
        return index
    # back to where it was first passed on, when changed in place since by a module passing it on
    while (back := records[found].same_as) >= 0 and records[back].role == IN and carried(back):
        found = back
    return found


def _finite(pair: tuple[float, float] | None) -> bool:
    return pair is None or (math.isfinite(pair[0]) and math.isfinite(pair[1]))


def _from_extremes(record: Probe, pair: tuple[float, float]) -> dict[str, Any]:
    """What a probe alone says of a tensor that is gone: NaN (both extremes are NaN then) or Inf."""
    has_nan = math.isnan(pair[0])
    kept = record.held()
    why = (_NOT_KEPT if record.kept is None else _UNEXACT) if kept is None else \
        _UNVERSIONED if kept.is_inference() else _CHANGED
    stats: dict[str, Any] = {"has_nan": has_nan, "has_inf": not has_nan and not (
        math.isfinite(pair[0]) and math.isfinite(pair[1])), "message": why}
    if record.shape is not None:
        stats |= {"shape": tuple(record.shape), "numel": math.prod(record.shape),
                  "dtype": str(record.dtype).removeprefix("torch.")}
    return stats


def _explain(catalog: Catalog, log: StepLog, extremes: list[tuple[float, float] | None], index: int,
             stats: dict[str, Any], checked: bool = True) -> dict[str, Any]:
    record = log.records[index]
    fields: dict[str, Any] = {"micro_batch": log.micro_batch_of(index), **stats}
    if checked and (record.role == CHECK or record.check is not None):
        name = catalog.check_name(record.slot if record.role == CHECK else record.check)
        kind = {"kind": "loss" if name == "loss" else "check", "layer": name}
        if record.role == CHECK:
            return fields | kind | {"micro_batch": None, "message": _join(_checked_first(log, index), fields.get("message"))}
        owner = catalog.slots[record.slot]
        where = f"{record.field!r} of the output of {owner.name or 'the model'} ({owner.module_type})"
        out = _explain(catalog, log, extremes, index, stats, checked=False)  # (what the probes knew, kept)
        return out | kind | {"message": _join(f"the tensor checked as {name!r} is {where}: the model computed it",
                                              out.get("message"))}
    info = catalog.slots[record.slot]
    fields |= {"layer": info.name, "module_type": info.module_type, "output_field": record.field}
    if record.compiled:
        batch = _bad_batch(catalog, log, index)  # (taken outside the graph, at the root's call)
        came = f"{batch[2]}, and " if batch is not None and batch[0] is not None else ""
        return fields | {"kind": "forward", "input_nonfinite": True if came else None, "output_nonfinite": True,
                         "message": _join(
            f"{came}this is the first non-finite module output seen in a compiled graph, where inputs and"
            " containers are not checked: it may have been born just before this module", fields.get("message"))}
    if record.passed is not False:
        return fields | _passed_on(catalog, log, extremes, index, info, fields.get("message"))
    source = _bad_input(catalog, log, extremes, index)
    if source is None:
        return fields | _explain_output(log, info, fields.get("message"))
    nan_in, tensor, where = source
    if nan_in is None:  # the batch could not be checked: where the value was born is not known
        return fields | {"kind": "forward", "input_nonfinite": None, "output_nonfinite": True,
                         "message": _join(where, fields.get("message"))}
    if nan_in:  # the value was passed on: describe it where it entered, which is more precise
        described = forensics.describe(tensor) if tensor is not None else {}
        if described.get("bad_count"):
            fields = {key: value for key, value in fields.items() if key != "message"} | described
        bad = _bad_state(log, info)  # an input it did not use for this value may be the one with NaN
        return fields | {"kind": "forward", "input_nonfinite": True, "output_nonfinite": True, "message": _join(
            where, f"or it was made here, where its {bad}" if bad else None, fields.get("message"))}
    # infinities alone came in (an additive -inf mask does that on purpose): the output may have
    # been made bad here, from them or not, or may carry them on. With a bad parameter of its own
    # and a NaN out, the NaN is this module's (an attention's bad projection under a mask), not its
    # input's: named so; otherwise where the infinities came from leads
    bad = _bad_state(log, info)
    if fields.get("has_nan") and bad:
        note = ("inputs held infinities but no NaN (as an additive attention mask does): the NaN was born in"
                f" this module, from them or otherwise; its {bad}")
        return fields | {"kind": "forward", "input_nonfinite": False, "output_nonfinite": True,
                         "message": _join(note, fields.get("message"))}
    made = ("the NaN was made here, from them or otherwise" if fields.get("has_nan")
            else "the output's infinities came with it, or were made here")
    note = _join(f"{where}; it held infinities but no NaN (as an additive attention mask does): {made}",
                 f"its {bad}" if bad else None)
    return fields | {"kind": "forward", "input_nonfinite": True, "output_nonfinite": True,
                     "message": _join(note, fields.get("message"))}


def _checked_first(log: StepLog, index: int) -> str:
    """Where a tensor given to ``Guard.check`` (record ``index``), the step's first non-finite value,
    came from: the code that computed it, from module outputs checked finite, or from other inputs."""
    if not any(record.role == OUT for record in log.records[:index]):
        return ("no module output was checked before it in this step: it was made by the code that computed it,"
                " or came with what that code took")
    return ("every module output checked before it was finite: it was made by the code that computed it from"
            " them (the loss function: a log of zero, a division by zero), or came with its other inputs (the"
            " batch's targets, say)")


def _bad_input(catalog: Catalog, log: StepLog, extremes: list[tuple[float, float] | None],
               index: int) -> tuple[bool | None, torch.Tensor | None, str] | None:
    """(held NaN, the tensor if still there, where it came from) for a non-finite input of the call
    that made output ``index``; None when its inputs were finite; held NaN None when they may not
    have been (a tensor of the batch is gone or was changed in place since, unchecked).

    Its inputs are the IN probes of that call (values made between modules) or the batch of its
    root's forward, checked exactly now; the outputs of other modules it took were checked finite
    already (they come earlier)."""
    for j in _own_inputs(log, index):
        pair = extremes[j]
        if not _finite(pair):
            seen = log.records[j].same_as if log.records[j].role == LINK else j  # where it was probed
            code = _code_between(catalog, log, extremes, seen)
            batch = _bad_batch(catalog, log, index)  # forward code computes from the batch too (a mask)
            compiled = any(record.compiled for record in log.records[:index])
            where = (f"{batch[2]}, with NaN, which the forward code of {code} may have carried here before this"
                     " module ran (or that code made the value)" if batch and batch[0] else
                     f"the non-finite input was born before this module ran: in the forward code of {code}, or in"
                     " a module that ran inside a compiled graph, where containers and inputs are not checked"
                     if compiled else
                     "the non-finite input was born outside any module, before this module ran, in the forward"
                     f" code of {code}")
            return math.isnan(pair[0]), log.records[seen].tensor(), f"its input was already non-finite: {where}"
    return _bad_batch(catalog, log, index)


def _batch_of(log: StepLog, index: int) -> tuple[int | None, list[Probe]]:
    """(root slot, BATCH records) of the forward that made probe ``index``."""
    start, root = next(((s[0], s[1]) for s in reversed(log.spans) if s[0] <= index), (0, None))
    return root, [log.records[k] for k in range(start, index) if log.records[k].role == BATCH]


def _bad_batch(catalog: Catalog, log: StepLog, index: int) -> tuple[bool | None, torch.Tensor | None, str] | None:
    """``_bad_input`` of the batch of the forward that made probe ``index``, checked exactly now."""
    root, batch = _batch_of(log, index)
    found, unchecked = None, False
    for record in batch:
        tensor = record.tensor()
        unchecked = unchecked or tensor is None
        if tensor is not None and not forensics.is_finite(tensor):
            nan = bool(torch.isnan(forensics.plain(tensor)).any())
            if found is None or (nan and not found[0]):
                found = (nan, tensor)
    name = catalog.slots[root].name if root is not None else ""
    if found is None and unchecked:
        # a static input buffer refilled in place for the next micro-batch, or a batch beyond the
        # detail budget with captures off: "born in this module" would be a guess
        return (None, None, f"born in this module, or it came in with the input batch of {name or 'the model'},"
                            " which could not be checked (changed in place since its forward, or not kept:"
                            " past detail_mb with capture off)")
    if found is None:
        return None
    return (*found, f"the input batch of {name or 'the model'} was already non-finite")


def _batch_as_fed(log: StepLog, index: int) -> str | None:
    """The batch of the forward that made probe ``index`` as it was fed: "finite" (a copy held as its
    forward began, or a tensor unchanged since, checked exactly now), "changed" (changed in place
    since: its forward, or the script, wrote it), else None (non-finite, freed, or no batch held)."""
    _, records = _batch_of(log, index)
    if any(r.held() is not None and r.tensor() is None for r in records):
        return "changed"
    batch = [r.tensor() for r in records]
    return "finite" if batch and all(t is not None and forensics.is_finite(t) for t in batch) else None


def _passed_on(catalog: Catalog, log: StepLog, extremes: list[tuple[float, float] | None], index: int,
               info: Slot, message: str | None) -> dict[str, Any]:
    """Fields of a bad output the module passed on (``Probe.passed``): from the batch, or made by
    forward code before the module (or, its input returned changed in place, maybe by it)."""
    batch = _bad_batch(catalog, log, index)
    if batch is not None and batch[0] is not None:
        return {"kind": "forward", "input_nonfinite": True, "output_nonfinite": True,
                "message": _join(batch[2], message)}
    before = f"in the forward code of {_code_between(catalog, log, extremes, index)}"
    if log.records[index].passed:
        note = (f"its input was already non-finite ({info.module_type} makes no non-finite value of finite"
                f" ones): the non-finite input was born outside any module, before this module ran, {before}")
        return {"kind": "forward", "input_nonfinite": True, "output_nonfinite": True, "message": _join(note, message)}
    bad = _bad_state(log, info)
    own = f" (its {bad})" if bad else ""
    note = ("it returned its input tensor itself, changed in place here or passed on as it came: the value"
            f" was born in this module{own}, or before it, outside any module, {before}")
    return {"kind": "forward", "input_nonfinite": None, "output_nonfinite": True, "message": _join(note, message)}


def _bad_state(log: StepLog, info: Slot | None, recurse: bool = True) -> str:
    """What of a module's state could make a non-finite value of finite ones ("" if nothing), as
    words to follow "its" or "whose": its non-finite parameters, and its buffers as the step began
    that held NaN, or a normalisation layer's running statistics, used in eval, that were
    non-finite or held a variance at or below -eps (it divides by the square root of variance +
    eps). A buffer not kept from the step's start that was written since (first written in this
    step, or changed between its micro-batches) is not known as it began, and not named; nor are
    statistics in training, which normalises by the batch's; nor infinities in other buffers:
    models keep -inf masks there. Its own alone unless ``recurse``: all of it by default, as
    nn.MultiheadAttention uses out_proj's weight without calling it."""
    module = info.module() if info is not None else None
    if module is None:
        return ""
    params = [n for n, p in module.named_parameters(recurse=recurse) if not forensics.is_finite(p)]
    params += _handed_bad(log, module, recurse)
    stale, negative = [], []
    for name, buffer in module.named_buffers(recurse=recurse):
        qualified = f"{info.name}.{name}".lstrip(".")
        start = log.buffers_at_start.get(qualified)
        if start is None and not changed_since(log.buffer_versions, qualified, buffer):
            start = buffer  # not written since the step began
        if start is None or not start.is_floating_point() or not start.numel():
            continue
        owner = module.get_submodule(name.rpartition(".")[0])
        statistic = isinstance(owner, NORMS) and name.rpartition(".")[2] in ("running_mean", "running_var")
        if statistic and owner.training:
            continue
        values = forensics.plain(start)
        if bool(torch.isnan(values).any()) or (statistic and not forensics.is_finite(values)):
            stale.append(name)
        elif statistic and name.endswith("running_var") and bool((values + owner.eps <= 0).any()):
            negative.append(name)
    return " and ".join(filter(None, (
        f"parameter(s) {', '.join(params)} are non-finite" if params else "",
        f"buffer(s) {', '.join(stale)} were non-finite when the step began" if stale else "",
        f"buffer(s) {', '.join(negative)} held a variance at or below -eps when the step began (it divides"
        " by the square root of variance + eps: NaN below, zero at it)" if negative else "")))


def _handed_bad(log: StepLog, module: torch.nn.Module, recurse: bool) -> list[str]:
    """The non-finite weights of ``module`` (of its own, unless ``recurse``) that a call in this step ran
    it with in the place of its own: handed to it, or to a module around it, by ``torch.func.functional_call``."""
    found = []
    for held, weights in log.handed:
        owner = held()
        prefix = next((name for name, m in owner.named_modules() if m is module), None) if owner is not None else None
        if prefix is None:
            continue
        lead = f"{prefix}." if prefix else ""
        for key, tensor in weights.items():
            name = key[len(lead):]
            if key.startswith(lead) and (recurse or "." not in name) and isinstance(tensor, torch.Tensor) and (
                    tensor.is_floating_point() and not forensics.is_finite(tensor)):
                found.append(f"{name} (handed to the call by torch.func.functional_call)")
    return list(dict.fromkeys(found))


def _explain_output(log: StepLog, info: Slot, message: str | None) -> dict[str, Any]:
    note = "inputs were finite: the value was born in this module"
    bad = _bad_state(log, info)
    if bad:
        note = f"inputs were finite but its {bad}"
    return {"kind": "forward", "input_nonfinite": False, "output_nonfinite": True,
            "message": _join(note, message)}


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
            "message": f"the forward was finite but {counted}, starting with {names[0]}, the first"
                       " in backward order: either the gradient entering the model's backward pass was"
                       " non-finite, most likely made by the loss (or code between the model and the"
                       " loss; guard.check(loss) shows the loss's value), or the backward of"
                       f" {catalog.slots[slot].name or 'the model'} itself made it (a custom autograd"
                       " Function there, say; a replay's operation check tells the two apart)"}
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
                f" NaN, made in the forward code of {_code_between(catalog, log, extremes, j)}, and an operation"
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


def _join(*parts: str | None) -> str:
    return "; ".join(p for p in parts if p)


def _code_between(catalog: Catalog, log: StepLog, extremes: list[tuple[float, float] | None], index: int) -> str:
    """Whose forward code ran between the last module output checked before probe ``index`` and
    that probe's call: the modules from their innermost common parent down to the call's parent
    (a plain ``nn.Sequential`` or ``nn.ModuleList`` runs none), and those in between that returned
    their input changed in place, non-finite. Those with a non-finite parameter of their own are
    named alone (a ViT's position embedding, a norm layer that calls ``F.batch_norm``)."""
    name = catalog.slots[log.records[index].slot].name
    # the last output checked before the call began: its own children's came before its probes
    last = next((i for i in range(index - 1, -1, -1) if log.records[i].role == OUT
                 and not within(catalog.slots[log.records[i].slot].name, name)), -1)
    previous = catalog.slots[log.records[last].slot].name if last >= 0 else ""
    own, other = name.split(".")[:-1] if name else [], previous.split(".")[:-1] if previous else []
    depth = next((i for i, (a, b) in enumerate(zip(own, other)) if a != b), min(len(own), len(other)))
    by_name = {s.name: s for s in catalog.slots}
    while depth and type(_module(by_name, ".".join(own[:depth]))) in (torch.nn.ModuleList, torch.nn.ModuleDict):
        depth -= 1  # a list of modules runs no code: its items are called by the code of its parent
    for cut in range(len(own), depth - 1, -1):  # innermost first: a NaN argument of a caller
        taken = _nan_argument(catalog, log, extremes, ".".join(own[:cut]), index)
        fed = _batch_as_fed(log, index) if taken is not None and not cut else None
        if fed == "finite":
            taken = None  # (the root's argument, probed as it returned: fed finite, so its forward changed it)
        if taken is not None:  # most likely its value came in with it; or the caller's code made it
            caller = ".".join(own[:cut])
            bad = _bad_state(log, by_name.get(caller), recurse=False)
            caller = caller or "the root module"
            passed = "changed in place since it was fed, so whether it came with NaN is not known" if fed == \
                "changed" else "already with NaN"
            return (f"{_code_between(catalog, log, extremes, taken)} (passed to {caller} as an argument"
                    f" {passed}), or of {caller} itself" + (f", whose {bad}" if bad else ""))
    labels = [".".join(own[:cut]) for cut in range(depth, len(own) + 1)] + [
        catalog.slots[r.slot].name for i, r in enumerate(log.records[last + 1:index + 1], last + 1)
        if r.role == IN and r.passed is None and not _finite(extremes[i])]  # (the probe's own module too)
    found, blamed = [], []
    outside = log.micro_batch_of(index) is None  # the script called the model's modules itself (a GAN's G and D)
    for label in dict.fromkeys(labels):
        module = _module(by_name, label)
        if not label and outside:
            found.append("the training script, outside the model (" + (
                "its root module ran no forward in this step" if not log.spans else
                "called outside the root module's forward") + ": the script called its modules directly), or the"
                " data it gave them")
            continue
        if type(module) in (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict):
            continue
        found.append(label or "the root module")
        bad = " and ".join(filter(None, (_bad_state(log, by_name.get(label), recurse=False),
                                         _uncalled_state(catalog, log, label))))
        if bad:
            blamed.append(f"{found[-1]}, whose {bad}")
    if blamed:
        return " or ".join(blamed)
    return " or ".join(found) or "the root module"


def _uncalled_state(catalog: Catalog, log: StepLog, name: str) -> str:
    """The non-finite parameters inside module ``name`` of modules that made no probe in this step
    (as words to follow "whose"), or "": no forward of theirs was checked, so the code of a module
    above them may use their parameters itself (Mamba's mixer hands its conv1d's weight to a
    convolution function, never calling conv1d)."""
    ran = set()  # modules that made a probe, and those around them (one returning its child's output makes none)
    for record in log.records:
        if record.role in (OUT, IN, LINK):
            parts = catalog.slots[record.slot].name.split(".")
            ran.update(".".join(parts[:k]) for k in range(len(parts) + 1))
    bad = []
    for info in catalog.slots:
        module = info.module() if info.name not in ran and within(info.name, name) else None
        if module is not None:
            bad += [f"{info.name}.{p}"[len(name) + 1 if name else 0:]
                    for p, param in module.named_parameters(recurse=False) if not forensics.is_finite(param)]
    return (f"parameter(s) {', '.join(bad)}, of modules it did not call in this step (its own code may use"
            " them), are non-finite") if bad else ""


def _nan_argument(catalog: Catalog, log: StepLog, extremes: list[tuple[float, float] | None], name: str,
                  index: int) -> int | None:
    """The record of a NaN argument (its probe, or a link to it) of the call of module ``name`` that
    encloses probe ``index`` (a parent's buffer handed to a child as a mask, say), or None. A
    call's own inputs are probed as it returns, after everything inside it: looked for after
    ``index`` (so following arguments outward always ends), until the call's output or a module
    outside it."""
    for j in range(index + 1, len(log.records)):
        record = log.records[j]
        if record.role in (BATCH, CHECK):
            if record.role == BATCH:
                break  # the next forward
            continue
        inside = catalog.slots[record.slot].name
        if inside != name:
            if within(inside, name):
                continue  # more of what ran inside the call
            break
        if record.role == OUT:
            break
        pair = extremes[j]
        if record.passed is False and pair is not None and math.isnan(pair[0]):
            return j  # (a link too: the value was made before this call, which began before its first taker)
    return None


def _module(by_name: dict[str, Slot], name: str) -> torch.nn.Module | None:
    slot = by_name.get(name)
    return slot.module() if slot is not None else None
