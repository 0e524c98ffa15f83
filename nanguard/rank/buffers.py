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
from operator import is_

import torch
from torch import nn

from . import forensics
from .records import changed_since, gradless, version_of

NORMS = (nn.modules.batchnorm._NormBase,)
"""BatchNorm, SyncBatchNorm, InstanceNorm: running statistics written inside their kernels"""


class Flat:
    """Copies of tensors side by side in flat places, written by one call per dtype and device: a
    ``torch.cat`` of the 1-d ones (N-d contiguous ones as 1-d views), a ``torch.stack`` of the 0-d
    ones (a BatchNorm's batch count). On a CPU a ``_foreach_`` op runs a kernel per tensor: the 45
    buffers of a small ResNet took 2.5x as long to copy by ``torch._foreach_copy_``, and 8x as long
    to check by ``torch._foreach_norm`` as by one ``aminmax`` of their join. Each tensor's copy is a view of its place, the same one every call
    while they are the same tensors, of the same shapes and dtypes; no new tensor after the first
    (one made at the start of a step costs several times its cost alone here)."""

    def __init__(self):
        self._tensors: list[torch.Tensor] = []
        self._layout: tuple[list[torch.Size], list[torch.dtype]] = ([], [])
        self._viewed: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(N-d tensor, its 1-d view): a view follows no ``.data =`` of its tensor"""
        self._groups: list[tuple[object, list[torch.Tensor], torch.Tensor]] = []
        """(torch.cat or torch.stack, what it joins, the flat place it writes)"""
        self.copies: list[torch.Tensor] = []
        """each tensor's copy, as the last ``write`` left it: a view of its group's flat place"""

    @property
    def flats(self) -> list[torch.Tensor]:
        return [flat for _, _, flat in self._groups]

    def write(self, tensors: list[torch.Tensor]) -> bool:
        """Copy ``tensors`` into their places; False when one is of a kind this cannot join (a
        tensor subclass, an N-d tensor that is not contiguous, tensors a join refuses)."""
        same = len(tensors) == len(self._tensors) and all(map(is_, tensors, self._tensors)) and (
            [t.shape for t in tensors], [t.dtype for t in tensors]) == self._layout and all(
            view.data_ptr() == t.data_ptr() for t, view in self._viewed)
        if not same and not self._plan(tensors):
            return False
        try:  # (into places made outside inference mode, which are written inside it too)
            for join, sources, flat in self._groups:
                gradless(join, sources, out=flat)
        except RuntimeError:
            self.forget()
            return False
        return True

    def forget(self) -> None:
        """Plan anew at the next write (a copy was handed out as a tensor's own data)."""
        self.__init__()

    def _plan(self, tensors: list[torch.Tensor]) -> bool:
        self.forget()
        groups: dict[tuple, list[int]] = {}
        sources: list[torch.Tensor] = []
        for i, tensor in enumerate(tensors):
            if type(tensor) is not torch.Tensor or (tensor.dim() > 1 and not tensor.is_contiguous()):
                return False
            source = tensor  # itself, not an alias: that would follow no ``.data =`` either
            if tensor.dim() > 1:
                source = tensor.detach().view(-1)
                self._viewed.append((tensor, source))
            sources.append(source)
            groups.setdefault((tensor.dtype, tensor.device, tensor.dim() == 0), []).append(i)
        copies: list[torch.Tensor | None] = [None] * len(tensors)
        with torch.no_grad(), torch.inference_mode(False):
            for (dtype, device, scalar), members in groups.items():
                size = len(members) if scalar else sum(sources[i].numel() for i in members)
                flat = torch.empty(size, dtype=dtype, device=device)
                self._groups.append((torch.stack if scalar else torch.cat, [sources[i] for i in members], flat))
                at = 0
                for i in members:
                    count = 1 if scalar else sources[i].numel()
                    copies[i] = flat[at] if scalar else flat[at:at + count].view(tensors[i].shape)
                    at += count
        self._tensors = list(tensors)
        self._layout = ([t.shape for t in tensors], [t.dtype for t in tensors])
        self.copies = copies
        return True


class Buffers:
    """The floating buffers of the guarded models, by qualified name."""

    def __init__(self):
        self._owners: list[tuple[str, weakref.ref, str]] = []
        """(qualified name, module, attribute) of every buffer"""
        self._written: set[str] = set()
        self._learned = False
        self.versions: dict[str, tuple[int, int]] = {}
        """the version (and identity) each buffer had when the step began"""
        self.kept: dict[str, torch.Tensor] = {}
        """copies of the buffers this step may write, as they were when it began, by qualified name"""
        self._copies = Flat()
        """where they are copied"""
        self._checked = Flat()
        """where the floating ones the step wrote are joined, to be checked by one reduction"""

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
        """Keep what this step may write (no host sync: device copies, one call per dtype)."""
        if not self._owners:
            return
        current = self._current()
        self.versions = {q: (version_of(b), id(b)) for q, _, _, b in current}
        keep = [(q, b) for q, _, _, b in current if not self._learned or q in self._written]
        buffers = [b for _, b in keep]
        if self._copies.write(buffers):
            copies = self._copies.copies
        else:  # a kind of tensor the flat copies do not take: a copy of each
            with torch.no_grad(), torch.inference_mode(False):
                copies = [b.detach().clone() for b in buffers]
        self.kept = dict(zip([q for q, _ in keep], copies))

    def written(self) -> list[tuple[str, torch.Tensor]]:
        """The floating buffers this step may have written; learns which buffers steps write."""
        if not self.versions:
            return []
        found = [(q, b) for q, _, _, b in self._current() if q in self.versions and (
            q in self._written or changed_since(self.versions, q, b))]
        self._written.update(q for q, _ in found)
        self._learned = bool(self.versions)
        return [(q, b) for q, b in found if b.is_floating_point()]

    def probes(self, written: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Minimum and maximum of the written buffers, joined by dtype (no host sync): non-finite
        exactly when one of them is."""
        if not written:
            return []
        tensors = [b for _, b in written]
        flats = self._checked.flats if self._checked.write(tensors) else [
            forensics.plain(t).reshape(-1) for t in tensors]  # (a DTensor's shard, say)
        return [value for flat in flats if flat.numel() for value in gradless(torch.aminmax, flat)]

    def restore(self) -> list[str]:
        """Put back what the step wrote; returns the names of buffers it wrote that could not be:
        first written in this step, so not kept (a buffer is kept from the step after)."""
        missed = []
        with torch.no_grad():
            for qualified, module, name, buffer in self._current():
                kept = self.kept.get(qualified)
                if kept is None:
                    if changed_since(self.versions, qualified, buffer):
                        missed.append(qualified)
                    continue
                if id(buffer) == self.versions[qualified][1]:
                    if buffer.shape == kept.shape and buffer.dtype == kept.dtype:
                        buffer.copy_(kept)
                    else:  # resized or retyped in place: the same tensor takes back the old data
                        buffer.data = kept
                        self._copies.forget()  # that copy is the buffer's own data now
                else:  # the forward replaced it: the old tensor goes back
                    module._buffers[name] = kept
                    self._copies.forget()  # that copy is the module's own now
        return missed

    def forget(self) -> None:
        """The step is decided: nothing more to keep for it."""
        self.kept = {}
