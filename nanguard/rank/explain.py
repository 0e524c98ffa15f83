"""Why a non-finite value was born where it was: the fields of a forward event (the producer's output,
or the input, batch, state or call of the script's own code it came from, read exactly where the
tensor is still there), and the script's code run between two modules' calls that made a value
non-finite. The diagnosis (diagnose.py) calls it on a bad step only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..events import within
from . import forensics
from .buffers import NORMS
from .records import BATCH, CHECK, IN, LINK, OUT, Catalog, Probe, Slot, StepLog, changed_since

_UNEXACT = ("no element detail: the tensor was freed and lay beyond the step's detail_mb budget"
            " (raise detail_mb to keep it)")
_NOT_KEPT = ("no element detail: the tensor was not kept (a forward whose every output was finite lets go of what"
             " it kept at its end, and a compiled graph keeps nothing of its inside)")
_UNVERSIONED = ("no element detail: an inference tensor (torch.inference_mode) keeps no version, so it"
                " cannot be told unchanged since it was checked")
_CHANGED = ("no element detail: the tensor was changed in place after it was checked (an in-place"
            " activation, say)")
_RECOMPUTED = ("made in the backward pass, where activation checkpointing ran this forward again: the"
               " step's forward pass had made no non-finite output before; what follows is of that run")


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
    made = next((j for j in inputs if records[j].role == IN and not finite_extremes(extremes[j])), None)
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


def finite_extremes(pair: tuple[float, float] | None) -> bool:
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
        bad = bad_state(log, info)  # an input it did not use for this value may be the one with NaN
        return fields | {"kind": "forward", "input_nonfinite": True, "output_nonfinite": True, "message": _join(
            where, f"or it was made here, where its {bad}" if bad else None, fields.get("message"))}
    # infinities alone came in (an additive -inf mask does that on purpose): the output may have
    # been made bad here, from them or not, or may carry them on. With a bad parameter of its own
    # and a NaN out, the NaN is this module's (an attention's bad projection under a mask), not its
    # input's: named so; otherwise where the infinities came from leads
    bad = bad_state(log, info)
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
        if not finite_extremes(pair):
            seen = log.records[j].same_as if log.records[j].role == LINK else j  # where it was probed
            code = code_between(catalog, log, extremes, seen)
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
    before = f"in the forward code of {code_between(catalog, log, extremes, index)}"
    if log.records[index].passed:
        note = (f"its input was already non-finite ({info.module_type} makes no non-finite value of finite"
                f" ones): the non-finite input was born outside any module, before this module ran, {before}")
        return {"kind": "forward", "input_nonfinite": True, "output_nonfinite": True, "message": _join(note, message)}
    bad = bad_state(log, info)
    own = f" (its {bad})" if bad else ""
    note = ("it returned its input tensor itself, changed in place here or passed on as it came: the value"
            f" was born in this module{own}, or before it, outside any module, {before}")
    return {"kind": "forward", "input_nonfinite": None, "output_nonfinite": True, "message": _join(note, message)}


def bad_state(log: StepLog, info: Slot | None, recurse: bool = True) -> str:
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
    bad = bad_state(log, info)
    if bad:
        note = f"inputs were finite but its {bad}"
    return {"kind": "forward", "input_nonfinite": False, "output_nonfinite": True,
            "message": _join(note, message)}


def _join(*parts: str | None) -> str:
    return "; ".join(p for p in parts if p)


def code_between(catalog: Catalog, log: StepLog, extremes: list[tuple[float, float] | None], index: int) -> str:
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
            bad = bad_state(log, by_name.get(caller), recurse=False)
            caller = caller or "the root module"
            passed = "changed in place since it was fed, so whether it came with NaN is not known" if fed == \
                "changed" else "already with NaN"
            return (f"{code_between(catalog, log, extremes, taken)} (passed to {caller} as an argument"
                    f" {passed}), or of {caller} itself" + (f", whose {bad}" if bad else ""))
    labels = [".".join(own[:cut]) for cut in range(depth, len(own) + 1)] + [
        catalog.slots[r.slot].name for i, r in enumerate(log.records[last + 1:index + 1], last + 1)
        if r.role == IN and r.passed is None and not finite_extremes(extremes[i])]  # (the probe's own module too)
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
        bad = " and ".join(filter(None, (bad_state(log, by_name.get(label), recurse=False),
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
