"""What each forward of a step was fed, held for the capture until the step's decision.

The capture holds a micro-batch by reference, and its tensors may change in place before the
decision: a loop that refills one input buffer for every micro-batch (a pinned prefetch buffer,
the static inputs of a CUDA graph), a model that normalises its input in place. Once a step's
decision finds one of its batch tensors changed in place, or two of its micro-batches fed from
one place in memory (a buffer refilled through ``.data`` or a numpy view changes no version, so
one fed twice cannot be told from one refilled), every later forward's batch is copied as the
forward begins, so what each was fed outlives the change. Changes in that first step are
seen by the tensors' versions: ``as_fed`` marks such a tensor ``Changed``, never writes it as the
data that was fed.
"""

from __future__ import annotations

from typing import Any

import torch

from .._tree import map_tensors, tensors
from ..incident.batches import Changed
from .records import version_of


class Feeds:
    """Whether the batches are copied as their forward begins: from the first step one of the
    batches it held was found changed in place by its decision."""

    def __init__(self) -> None:
        self.copying = False

    def hold(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[tuple[torch.Tensor, int]]]:
        """(args, kwargs) as the capture holds them (copies, once copying), with every held tensor
        and its in-place version."""
        if self.copying:
            with torch.no_grad():
                args, kwargs = map_tensors((args, kwargs), lambda t: t.detach().clone())
        if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call, without a walk
            return args, kwargs, [(t, version_of(t)) for t in args]
        return args, kwargs, [(t, version_of(t)) for t in tensors((args, kwargs))]

    def step_decided(self, batches: list[tuple[int, tuple, dict, list[tuple[torch.Tensor, int]]]]) -> None:
        """The step's held batches (``StepLog.batches``) before they are let go."""
        self.copying = self.copying or any(moved(t, version) for *_, held in batches for t, version in held) or (
            len(batches) > 1 and bool(refilled(batches)))


def refilled(batches: list[tuple[int, tuple, dict, list[tuple[torch.Tensor, int]]]]) -> list[int]:
    """The forwards (``StepLog.batches``) whose held inputs begin in memory where a later forward's do:
    one buffer fed to both, refilled between them or not (no version tells which)."""
    last: dict[int, int] = {}
    memory = [[_memory(tensor) for tensor, _ in held] for *_, held in batches]
    for forward, pointers in enumerate(memory):
        last.update((pointer, forward) for pointer in pointers if pointer)
    return [forward for forward, pointers in enumerate(memory) if any(last.get(p, forward) > forward for p in pointers)]


def _memory(tensor: torch.Tensor) -> int:
    """Where a tensor's first element is (0: not known, a tensor subclass's or an empty one's): the micro-batches
    of one batch cut in chunks share its storage but begin apart; a refilled buffer begins where it did."""
    try:
        return tensor.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def moved(tensor: torch.Tensor, version: int) -> bool:
    """Changed in place since its version was ``version`` (an inference tensor keeps none: never)."""
    return version >= 0 and version_of(tensor) != version


def as_fed(args: tuple, kwargs: dict, versions: list[tuple[torch.Tensor, int]]) -> dict[str, Any]:
    """A micro-batch as its forward was fed: a tensor changed in place since is marked ``Changed``
    (its contents now are another micro-batch's), never written as if it were the one fed. An
    inference tensor keeps no version (``version_of`` gave it a negative number): written as it is."""
    changed = {id(t) for t, version in versions if moved(t, version)}
    if changed:
        args, kwargs = map_tensors((args, kwargs), lambda t: Changed(t) if id(t) in changed else t)
    return {"args": args, "kwargs": kwargs}
