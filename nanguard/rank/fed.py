"""What each forward of a step was fed, held for the capture until the step's decision.

The capture holds a micro-batch by reference, and its tensors may change in place before the
decision: a loop that refills one input buffer for every micro-batch (a pinned prefetch buffer,
the static inputs of a CUDA graph), a model that normalises its input in place. Once a step's
decision finds one of its batch tensors changed in place, every later forward's batch is copied
as the forward begins, so what each was fed outlives the change. Changes in that first step are
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
        self.copying = self.copying or any(moved(t, version) for *_, held in batches for t, version in held)


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
