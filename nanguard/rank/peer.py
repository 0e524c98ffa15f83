"""On another device, in the job: the bad micro-batch re-run on a peer rank's device.

Under DDP every rank holds the same weights, so once the microscope reproduced a rank's own fault on
its own device, the rank to its right re-runs that micro-batch on its device: the arguments, the RNG
states and the gradient that reached the output go over torch.distributed (two ``all_gather_object``
calls, on a bad step only, made by every rank alike), bounded by ``detail_mb``. Bad there too: the
code or the data (``reproducible``); clean there: that rank's host and device (``device``).
"""

from __future__ import annotations

from typing import Any

import torch

from .._dist import Collectives
from .._tree import floating_tensors, map_tensors, tensors
from ..incident.rng import cuda_in_use, torch_state
from . import microscope
from .detector import Detector
from .modules import ddp_inner

DEVICE = ("bad again when re-run on rank {peer}'s device ({peer_device}) with the same weights, batch and"
          " random state, so the code or the data made it, not this rank's device")
CLEAN_ELSEWHERE = ("clean when re-run on rank {peer}'s device ({peer_device}) with the same weights, batch and"
                   " random state, and bad again on this rank's own: suspect this rank's device ({device},"
                   " host {host})")
UNCOMPARED = "not re-run on another rank's device: {why}"


def request(detector: Detector, look: microscope.Look, budget: int) -> dict[str, Any] | None:
    """What the peer needs to re-run this rank's first bad micro-batch, on the CPU, or a reason it
    cannot be sent; None when there is nothing to ask (no micro-batch went bad again here)."""
    if not look.bad:
        return None
    forward = look.bad[0]
    log = detector.log
    slot, args, kwargs, _ = log.batches[forward]
    context = log.contexts[forward]
    grad = look.output_grads.get(forward)
    if grad is not None and not microscope.all_finite([grad[1]]):
        grad = None  # (the forward made it bad already: the peer's forward tells)
    held = tensors((args, kwargs)) + ([grad[1]] if grad is not None else [])
    if sum(t.numel() * t.element_size() for t in held) > budget:
        return {"why": "the micro-batch is larger than detail_mb"}
    cpu = (lambda t: t.detach().cpu())
    rng = context.rng
    cuda = rng["cuda"][torch.cuda.current_device()] if rng["cuda"] else None
    return {"slot": slot, "args": map_tensors(args, cpu), "kwargs": map_tensors(kwargs, cpu),
            "weights": _weights(detector, slot),
            "rng": torch_state(rng["torch"]), "cuda": cuda, "autocast": context.autocast, "grad": context.grad,
            "output_grad": None if grad is None else (grad[0], cpu(grad[1])), "device": microscope.device_name()}


def replica(detector: Detector, asked: dict[str, Any], params: list[torch.Tensor]) -> bool | str:
    """Re-run a peer's micro-batch here: True when it went bad again, False when clean, or why it
    could not be run. The RNG and floating buffers are put back as they were."""
    module, forward = _root(detector, asked["slot"])
    if module is None:
        return "the peer holds no model of that micro-batch"
    if _weights(detector, asked["slot"]) != asked["weights"]:
        return ("the ranks' weights differ (DDP's replicas are no longer the same: the script changed one"
                " rank's, or a device corrupted them)")
    module = ddp_inner(module) or module
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    moved = (lambda t: t.to(device))
    args, kwargs = map_tensors(asked["args"], moved), map_tensors(asked["kwargs"], moved)
    look = microscope.Look()
    try:
        with microscope.untouched(detector):
            torch.set_rng_state(asked["rng"])
            if asked["cuda"] is not None and cuda_in_use():
                torch.cuda.set_rng_state(asked["cuda"])
            output = microscope.called(module, args, kwargs, asked["grad"], asked["autocast"], forward)
            if not microscope.all_finite(floating_tensors(output)):
                return True
            grad = asked["output_grad"]
            if grad is None or not asked["grad"]:
                return False
            bad = microscope.backward_bad(look, output, (grad[0], grad[1].to(device)), params)
            return bad if not look.missed else look.missed[0]
    except Exception as exc:  # noqa: BLE001 - the peer's model failed on the batch: not comparable
        return f"the re-run on the peer raised {type(exc).__name__}: {exc}"


def _root(detector: Detector, slot: int) -> tuple[torch.nn.Module | None, Any]:
    """The model of a root's micro-batches: the one this rank's own forwards of it called (a DDP made
    again during training: the new wrapper's), else the one it was attached as, if still there; and
    the forward it held as its own attribute then (``Context.forward``)."""
    log = detector.log
    called = [(c.module(), c.forward) for (s, *_), c in zip(log.batches, log.contexts)
              if s == slot and c.module is not None]
    module, forward = next(((m, f) for m, f in called if m is not None), (None, None))
    if module is None and slot < len(detector.catalog.slots):
        module = detector.catalog.slots[slot].module()
    return module, forward


def _weights(detector: Detector, slot: int) -> list[float] | None:
    """A fingerprint of a root's weights, alike on ranks whose replicas are the same (each parameter's
    sum in float64, read on the bad step only; NaN as the string "nan", which compares equal)."""
    module, _ = _root(detector, slot)
    if module is None:
        return None
    with torch.no_grad():
        sums = [p.detach().double().sum() for p in module.parameters()]
    return [repr(v) for v in torch.stack(sums).tolist()] if sums else []


def compare(collectives: Collectives, detector: Detector, look: microscope.Look | None, event: Any,
            budget: int, params: list[torch.Tensor]) -> None:
    """Every rank calls this on a bad step of a DDP sentinel: each rank re-runs its left neighbour's
    bad micro-batch, and ``event`` (this rank's own finding, reproduced here) gets the verdict."""
    mine = request(detector, look, budget) if look is not None and event is not None and (
        event.reproduced is True) else None
    rank, world = collectives.rank, collectives.world_size
    asked = collectives.all_gather_object(mine)[(rank - 1) % world]
    answer = None
    if asked is not None:
        answer = replica(detector, asked, params) if "why" not in asked else None
        answer = (answer, microscope.device_name())
    peer = (rank + 1) % world
    theirs = collectives.all_gather_object(answer)[peer]
    if mine is None:
        return
    if "why" in mine or theirs is None or isinstance(theirs[0], str):
        why = mine.get("why") or (theirs[0] if theirs is not None else "the peer sent nothing back")
        event.message = "; ".join(filter(None, (event.message, UNCOMPARED.format(why=why))))
        return
    bad, peer_device = theirs
    if bad:
        event.message = "; ".join(filter(None, (event.message, DEVICE.format(peer=peer, peer_device=peer_device))))
        return
    event.verdict = "device"
    event.message = "; ".join(filter(None, (event.message, CLEAN_ELSEWHERE.format(
        peer=peer, peer_device=peer_device, device=event.device, host=event.host))))

