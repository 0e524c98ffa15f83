"""From the records of a bad step to the Event that names where the first non-finite value was
born. Slow and exact (it reads tensors), and only ever run once a step is known to be bad.

Forward first: the first non-finite probe in execution order, confirmed exactly when its tensor
is still there. Then gradients: the first bad parameter gradient in backward order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..events import Event
from . import forensics
from .records import BATCH, CHECK, IN, OUT, Catalog, StepLog

MakeEvent = Callable[[dict[str, Any]], Event]
"""builds an Event from its fields, adding rank, step, host and time"""

_UNEXACT = ("no element detail: the tensor was freed and lay beyond the step's detail_mb budget"
            " (raise detail_mb to keep it)")
_FROM_OTHER_RANK = ("this rank's own gradients were finite before DDP's all-reduce: another rank"
                    " sent the non-finite values")


@dataclass(frozen=True, slots=True)
class Finding:
    """A rank's first non-finite value of a step."""

    event: Event
    born_here: bool = True
    """False when the value came from another rank through DDP's all-reduce: that rank's event"""


def first_bad(catalog: Catalog, log: StepLog, values: list[float], make: MakeEvent,
              owners: list[torch.Tensor] = (), grads: list[torch.Tensor] = (),
              local_grads_bad: bool | None = None) -> Finding | None:
    """The step's first non-finite value: a forward probe, else a parameter gradient.

    ``values``: the probes as read, in order; ``owners``/``grads``: the parameters that have a
    gradient and those gradients; ``local_grads_bad``: whether this rank's own gradient buckets
    were bad before DDP's all-reduce (None when they were not watched). None when nothing is
    bad (a float32 sum or a norm that overflowed on finite values).
    """
    fields = forward_fields(catalog, log, values)
    if fields is not None:
        return Finding(make(fields))
    fields = gradient_fields(catalog, log, owners, grads)
    if fields is None:
        return None
    if local_grads_bad is None:
        return Finding(make(fields))
    fields["extra"]["born_here"] = local_grads_bad
    if not local_grads_bad:  # not this rank's loss: what the all-reduce brought in
        fields |= {"kind": "grad", "message": f"{fields['message']}; {_FROM_OTHER_RANK}"}
    return Finding(make(fields), born_here=local_grads_bad)


def forward_fields(catalog: Catalog, log: StepLog, values: list[float]) -> dict[str, Any] | None:
    """Event fields of the first non-finite forward probe, confirmed exactly where it can be."""
    for index, value in enumerate(values):
        record = log.records[index]
        if math.isfinite(value) and not record.lazy:
            continue
        tensor = record.tensor()
        if tensor is not None:
            stats = forensics.describe(tensor)
            if not stats["bad_count"]:
                continue  # lazy and finite, or a float32 sum that overflowed on finite values
        elif record.lazy:
            continue  # changed in place since it was kept: nothing to tell
        else:
            stats = {"has_nan": math.isnan(value), "has_inf": not math.isnan(value)}
            if record.shape is not None:
                stats |= {"shape": tuple(record.shape), "numel": math.prod(record.shape),
                          "dtype": str(record.dtype).removeprefix("torch.")}
        return _explain(catalog, log, index, stats, values)
    return None


def _explain(catalog: Catalog, log: StepLog, index: int, stats: dict[str, Any],
             values: list[float]) -> dict[str, Any]:
    record = log.records[index]
    fields: dict[str, Any] = {"micro_batch": log.micro_batch_of(index), **stats}
    if "bad_count" not in stats:
        fields["message"] = _UNEXACT
    if record.role == CHECK:
        name = catalog.check_name(record.slot)
        return fields | {"kind": "loss" if name == "loss" else "check", "layer": name,
                         "micro_batch": None}
    info = catalog.slots[record.slot]
    fields |= {"layer": info.name, "module_type": info.module_type}
    if record.role == OUT:
        return fields | _explain_output(record.compiled, info.module(), fields.get("message"))
    later_out = [i for i in range(index + 1, len(values)) if log.records[i].role == OUT]
    bad_out = next((i for i in later_out if not math.isfinite(values[i])), None)
    if record.role == IN:
        before = [catalog.slots[r.slot].name for r in log.records[:index] if r.role == OUT]
        parent = _common_parent(info.name, before[-1] if before else "")
        where = f"the forward code of {parent or 'the root module'}"
        same_call_bad = bad_out is not None and log.records[bad_out].slot == record.slot
        return fields | {"kind": "forward", "input_nonfinite": True, "output_nonfinite": same_call_bad,
                         "message": _join("its input was already non-finite: the value was born"
                                          f" outside any module, in {where} (before this module"
                                          " ran)", fields.get("message"))}
    assert record.role == BATCH
    # the root's own inputs; name the first module the bad batch reached
    if bad_out is not None:
        first = catalog.slots[log.records[bad_out].slot]
        fields |= {"layer": first.name, "module_type": first.module_type}
    return fields | {"kind": "forward", "input_nonfinite": True, "output_nonfinite": bad_out is not None,
                     "message": _join(f"the input batch of {info.name or 'the model'} was already"
                                      " non-finite", fields.get("message"))}


def _explain_output(compiled: bool, module: torch.nn.Module | None, message: str | None) -> dict[str, Any]:
    if compiled:
        return {"kind": "forward", "input_nonfinite": None, "output_nonfinite": True, "message": _join(
            "first non-finite module output seen in a compiled graph, where inputs and containers are"
            " not checked: it may have been born just before this module", message)}
    note = "inputs were finite: the value was born in this module"
    # all of its parameters: nn.MultiheadAttention uses out_proj's weight without calling it
    bad_params = [n for n, p in (module.named_parameters() if module else []) if not forensics.is_finite(p)]
    if bad_params:
        note = f"inputs were finite but its parameter(s) {', '.join(bad_params)} are not"
    return {"kind": "forward", "input_nonfinite": False, "output_nonfinite": True,
            "message": _join(note, message)}


def gradient_fields(catalog: Catalog, log: StepLog, owners: list[torch.Tensor],
                    grads: list[torch.Tensor]) -> dict[str, Any] | None:
    """Event fields of the first non-finite parameter gradient in backward order, or None."""
    bad = [(p, g) for p, g in zip(owners, grads) if not forensics.is_finite(g)]
    if not bad:
        return None  # a norm that overflowed on finite gradients
    order = {slot: i for i, slot in enumerate(log.backward_order())}
    owner_of = catalog.param_owner
    bad.sort(key=lambda pg: order.get(owner_of.get(id(pg[0]), -1), len(order)))
    param, grad = bad[0]
    slot = owner_of.get(id(param))
    names = [catalog.param_name(p) for p, _ in bad]
    fields = {"kind": "grad", "layer": names[0],
              "module_type": catalog.slots[slot].module_type if slot is not None else "",
              **forensics.describe(grad), "extra": {"bad_params": names[:16]}}
    counted = f"{len(bad)} of {len(grads)} parameter gradients are non-finite"
    last = next(iter(order), None)  # the last module to run: the first in backward order
    if last is not None and slot == last:
        # Even the first gradients of the backward pass are bad: what entered it was.
        return fields | {
            "kind": "loss", "layer": "loss", "module_type": "",
            "message": f"the forward was finite but {counted}, starting with {names[0]}, the first"
                       " in backward order: the gradient entering the model's backward was already"
                       " non-finite, so most likely the loss (or code between the model and the"
                       " loss) made it; guard.check(loss) shows the loss's value"}
    return fields | {"message": f"{counted}, this one first in backward order; the forward and the"
                                " gradients of the modules that ran after it were finite, so it was"
                                " born in the backward pass"}


def _join(*parts: str | None) -> str:
    return "; ".join(p for p in parts if p)


def _common_parent(name: str, previous: str) -> str:
    """The innermost module containing both names (whose forward code ran between them)."""
    own = name.split(".")[:-1]
    other = previous.split(".")[:-1] if previous else own
    common = []
    for a, b in zip(own, other):
        if a != b:
            break
        common.append(a)
    return ".".join(common)
