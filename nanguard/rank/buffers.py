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

NORMS = (nn.modules.batchnorm._NormBase,)
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
        self.kept: dict[str, torch.Tensor] = {}
        """copies of the buffers this step may write, as they were when it began, by qualified name"""
        self._spares: list[tuple[weakref.ref, torch.Tensor]] = []
        """(buffer, the place its copy is written to) of the buffers kept last step"""
        self._layout: tuple[list[torch.Size], list[torch.dtype]] = ([], [])
        """their shapes and dtypes"""

    def attach(self, module: nn.Module, qualified: str) -> None:
        tracks = isinstance(module, NORMS) and getattr(module, "track_running_stats", False)
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
        """Keep what this step may write (no host sync: device copies, in one call)."""
        if not self._owners:
            return
        current = self._current()
        self._versions = {q: (version_of(b), id(b)) for q, _, _, b in current}
        keep = [(q, b) for q, _, _, b in current if not self._learned or q in self._written]
        self.kept = dict(zip([q for q, _ in keep], self._copies([b for _, b in keep])))

    def _copies(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``buffers``, written into the same places as last step's when they are the
        same buffers (one fused copy, no new tensor: a tensor made at the start of a step costs
        several times its cost alone here, and 45 of them took 3 % of a small ResNet's step)."""
        spares = self._spares
        # (copies made outside inference mode: a step in inference mode first must not leave
        # places that a training step cannot write)
        with torch.no_grad(), torch.inference_mode(False):
            # the same buffers, as they were: one resized or retyped in place (.data =, resize_)
            # would be broadcast or cast into its old place, and could not be put back as it was
            if len(spares) == len(buffers) and all(ref() is b for (ref, _), b in zip(spares, buffers)) \
                    and [b.shape for b in buffers] == self._layout[0] and [b.dtype for b in buffers] == self._layout[1]:
                copies = [copy for _, copy in spares]
                try:
                    if copies:
                        torch._foreach_copy_(copies, buffers)
                    return copies
                except RuntimeError:
                    pass  # a kind of tensor foreach does not take
            self._spares = [(weakref.ref(b), b.detach().clone()) for b in buffers]
            self._layout = ([b.shape for b in buffers], [b.dtype for b in buffers])
        return [copy for _, copy in self._spares]

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
                kept = self.kept.get(qualified)
                if kept is None:
                    continue
                if id(buffer) == self._versions[qualified][1]:
                    if buffer.shape == kept.shape and buffer.dtype == kept.dtype:
                        buffer.copy_(kept)
                    else:  # resized or retyped in place: the same tensor takes back the old data
                        buffer.data = kept
                        self._spares = []
                else:  # the forward replaced it: the old tensor goes back
                    module._buffers[name] = kept
                    self._spares = []  # that copy is the module's own now
                restored.append(qualified)
        return restored

    def forget(self) -> None:
        """The step is decided: nothing more to keep for it."""
        self.kept = {}
