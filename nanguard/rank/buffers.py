"""The buffers a forward writes (BatchNorm's running statistics and its batch count): kept as they
were when the step began, so that a stopped or skipped step leaves them untouched, and the
floating ones checked.

Which buffers a step writes: those of normalisation layers that track running statistics (their
kernels write them without counting an in-place version), and those whose in-place version
counters moved during a step. The first step keeps a copy of every buffer, later steps only of
those (a few small tensors for a BatchNorm model; nothing for most transformers). A buffer that
starts being written later is kept from the step after.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from . import forensics
from .records import version_of

_NORMS = (nn.modules.batchnorm._NormBase,)
"""BatchNorm, SyncBatchNorm, InstanceNorm: running statistics written inside their kernels"""


class Buffers:
    """The floating buffers of the guarded models, by qualified name."""

    def __init__(self):
        self._owners: list[tuple[str, weakref.ref, str]] = []
        """(qualified name, module, attribute) of every buffer"""
        self._written: set[str] = set()
        self._learned = False
        self._versions: dict[str, tuple[int, int]] = {}
        """the version (and identity) each buffer had when the step began"""
        self._kept: dict[str, torch.Tensor] = {}

    def attach(self, module: nn.Module, qualified: str) -> None:
        tracks = isinstance(module, _NORMS) and getattr(module, "track_running_stats", False)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None:
                full = f"{qualified}.{name}".lstrip(".")
                self._owners.append((full, weakref.ref(module), name))
                if tracks:
                    self._written.add(full)

    def _current(self) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
        """(qualified name, module, attribute, buffer) of every buffer still there."""
        current = []
        for qualified, ref, name in self._owners:
            module = ref()
            buffer = module._buffers.get(name) if module is not None else None
            if buffer is not None:
                current.append((qualified, module, name, buffer))
        return current

    def step_started(self) -> None:
        """Keep what this step may write (no host sync: device copies, made in one call)."""
        if not self._owners:
            return
        current = self._current()
        self._versions = {q: (version_of(b), id(b)) for q, _, _, b in current}
        keep = [(q, b) for q, _, _, b in current if not self._learned or q in self._written]
        with torch.no_grad():
            # x * 1 is x exactly for numbers (-0.0, NaN and Inf included; denormals too unless
            # torch.set_flush_denormal is on): a copy of every buffer from one fused call, where a
            # clone() per buffer costs a Python call each (45 a step for a small ResNet); a bool
            # buffer would become int64, so it is cloned
            fused = [(q, b) for q, b in keep if b.dtype is not torch.bool]
            copies = torch._foreach_mul([b for _, b in fused], 1) if fused else []
            self._kept = {q: copy for (q, _), copy in zip(fused, copies)}
            self._kept.update((q, b.detach().clone()) for q, b in keep if b.dtype is torch.bool)

    def written(self) -> list[tuple[str, torch.Tensor]]:
        """The floating buffers this step may have written; learns which buffers steps write."""
        if not self._versions:
            return []
        found = [(q, b) for q, _, _, b in self._current() if q in self._versions and (
            q in self._written or self._versions[q] != (version_of(b), id(b)))]
        self._written.update(q for q, _ in found)
        self._learned = bool(self._versions)
        return [(q, b) for q, b in found if b.is_floating_point()]

    def norms(self, written: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Norms of the written buffers from one fused pass: non-finite when a buffer is (or a norm
        overflows on huge finite values, which ``bad`` tells apart)."""
        return list(torch._foreach_norm([forensics.plain(b) for _, b in written])) if written else []

    def restore(self) -> list[str]:
        """Put back what the step wrote; returns the names restored."""
        restored = []
        with torch.no_grad():
            for qualified, module, name, buffer in self._current():
                kept = self._kept.get(qualified)
                if kept is None:
                    continue
                if id(buffer) == self._versions[qualified][1]:
                    buffer.copy_(kept)
                else:  # the forward replaced it: the old tensor goes back
                    module._buffers[name] = kept
                restored.append(qualified)
        return restored

    def forget(self) -> None:
        """The step is decided: nothing more to keep for it."""
        self._kept = {}
