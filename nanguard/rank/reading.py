"""What the decision, the diagnosis and the response hand each other about one step: the step's
read (``Reading``, made by ``decision.read_step``) and a rank's first non-finite value in it
(``Finding``, made by ``diagnose``). Plain data, here so that each of those modules can take it
without importing another."""

from __future__ import annotations

from dataclasses import dataclass

from ..events import Event


@dataclass(slots=True)
class Reading:
    """What one step's read said."""

    bad: bool
    """something was non-finite, on some rank"""
    stop: bool
    """a stop was requested, on some rank"""
    probes: list[float]
    """minimum and maximum of every OUT and CHECK probe, flattened"""
    norms: list[float]
    evidence: list[float]
    """minimum and maximum of every IN probe, flattened (never a reason to stop)"""
    local_grads_bad: bool | None
    """this rank's own gradients were bad before their sum across ranks (None: not watched)"""
    buffers: list[float] = ()
    """minimum and maximum of the buffers the step wrote, by dtype (``Buffers.probes``)"""
    extras: list[float] = ()
    """values read along for the flight recorder (the GradScaler's scale)"""
    buckets: list[float] = ()
    """minimum and maximum of every probe of the gradients before their sum across ranks"""
    applied: list[float] = ()
    """norms of the gradients as the optimizer is about to apply them, where they changed after the
    backward pass left them (summed across ranks, clipped, unscaled, divided: ``changed_gradients``)"""
    several: bool = False
    """there are several ranks, whose gradients are summed after the backward pass (by DDP, whether
    nanguard watches its buckets or not, or by the script)"""



@dataclass(frozen=True, slots=True)
class Finding:
    """A rank's first non-finite value of a step."""

    event: Event
    born_here: bool = True
    """False when the value came from another rank through DDP's all-reduce: that rank's event"""
    position: tuple[int, int] | None = None
    """(micro-batch, ``Probe.call``) of a forward finding's first bad output: where in the step's
    program it was seen, comparable between ranks that run the same model, so that a value a
    collective inside the model (a synchronised norm) spread is placed after where it was born
    (None inside a compiled graph, which counts no calls)"""
    own_state: bool = False
    """the module's own non-finite state on this rank explains it: with a sharded model (FSDP2)
    every rank computes with the gathered weights, and the rank holding the bad shard says so"""
    summed_pass: int = 0
    """which backward pass of the step (0: its first) first summed this rank's non-finite gradients
    across ranks: with several passes summed (accumulation without ``no_sync``), what one pass's
    all-reduce brought in is in every rank's buckets of the next, so the earliest pass is where it
    was born"""
