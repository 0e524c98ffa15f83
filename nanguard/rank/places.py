"""Places made in advance that probes write into: one buffer per dtype and device, its 0-d views and
the slices a step reads (``Slots``), so that a probe creates no tensor and the decision reads one
vector; and the joins (``stack``, ``concat``) of tensors that may sit on several devices.
"""

from __future__ import annotations

from operator import attrgetter

import torch

_DTYPE = attrgetter("dtype")


class _Places:
    """One buffer of a dtype and device, its 0-d views (made once per size), and the slices of it
    a step reads (made once per length: a tensor made inside a step costs several times its cost alone)."""

    __slots__ = ("key", "buffer", "views", "used", "_spans")

    def __init__(self, like: torch.Tensor):
        self.key = (like.dtype, like.device)
        self.used = 0
        self.buffer = self.views = None
        self._spans: dict[tuple[int, int], torch.Tensor] = {}
        self.grow(64, like)

    def grow(self, size: int, like: torch.Tensor) -> None:
        """A new buffer of ``size`` places, holding what this step wrote so far."""
        with torch.inference_mode(False), torch.no_grad():  # writable by every later step
            buffer = torch.empty(size, dtype=like.dtype, device=like.device)
            if self.used:
                buffer[:self.used].copy_(self.buffer[:self.used])
            self.buffer, self.views = buffer, list(buffer.unbind())
        self._spans = {}

    def span(self, start: int, stop: int) -> torch.Tensor:
        """``buffer[start:stop]``, the same view every step that asks for it (a few lengths at most
        are kept: a run whose steps probe ever more values makes a new one each time)."""
        view = self._spans.get((start, stop))
        if view is None:
            if len(self._spans) >= 8:
                self._spans.clear()
            view = self._spans[(start, stop)] = self.buffer[start:stop]
        return view

    def room(self, size: int, like: torch.Tensor) -> None:
        """At least ``size`` places, what this step wrote kept."""
        if size > len(self.views):
            self.grow(max(size, 2 * len(self.views)), like)


def _written_after(places: _Places, used: int, tail: list[torch.Tensor]) -> torch.Tensor | None:
    """0-d ``tail`` written into ``places`` after its first ``used`` values, and all of them as one
    slice (no tensor made); None where they cannot be: another dtype, or another device (pipeline stages)."""
    if set(map(_DTYPE, tail)) != {places.key[0]}:  # (no Python call per tensor: this runs on every step)
        return None
    places.room(used + len(tail), tail[0])
    try:
        torch.stack(tail, out=places.span(used, used + len(tail)))
    except RuntimeError:
        return None
    return places.span(0, used + len(tail))


class Slots:
    """Places made in advance for one step's (minimum, maximum) pairs of one kind (outputs, or
    inputs as evidence): a probe writes into two 0-d views of a buffer made once, so it creates
    no tensor, and the decision reads slices of the buffers instead of stacking the pairs. Inside a
    training step each new tensor costs 5-9 us on this machine's CPU (four times its cost alone,
    measured in situ), so this is most of what a probe costs beside its reduction.

    One buffer per dtype and device (``torch.aminmax`` writes only into its input's dtype): a step
    under autocast (bf16 layers among float32 ones) or across pipeline stages reads one slice per
    buffer, joined in one ``cat``, and puts the pairs back in probe order on the host
    (``in_order``). A value written elsewhere (a compiled graph's probe) makes the step's values
    stacked as they are instead (``vector``)."""

    __slots__ = ("_places", "_last", "_order", "used")

    def __init__(self):
        self._places: dict[tuple[torch.dtype, torch.device], _Places] = {}
        self._last: _Places | None = None
        """the places the last probe wrote into (most probes share their dtype and device)"""
        self._order: list[_Places] = []
        """where each pair went, in probe order, when the step uses more than one buffer"""
        self.used = 0
        """pairs' values written into places this step (two per probe)"""

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two 0-d views to write ``like``'s extremes into (the next two places of its dtype and device)."""
        places = self._last
        if places is None or like.dtype is not places.key[0] or like.device != places.key[1]:
            places = self._switch(like)
        used = places.used
        if used + 2 > len(places.views):
            places.grow(2 * len(places.views), like)  # more probes than any step before
        places.used = used + 2
        self.used += 2
        if self._order:
            self._order.append(places)
        return places.views[used], places.views[used + 1]

    def _switch(self, like: torch.Tensor) -> _Places:
        key = (like.dtype, like.device)
        places = self._places.get(key)
        if places is None:
            places = self._places[key] = _Places(like)
        if self._last is not None and places is not self._last and not self._order:
            # a second buffer this step: from now on every pair's buffer is noted
            self._order = [self._last] * (self.used // 2)
        self._last = places
        return places

    def vector(self, values: list[torch.Tensor], tail: list[torch.Tensor] = ()) -> torch.Tensor | None:
        """``values`` (this step's) then the 0-d tensors ``tail`` (the gradients' norms) as one 1-d
        tensor, or None when there are none: in probe order, except that with several buffers each
        buffer's pairs come together (``in_order`` puts the read values back in order). Where the
        pairs sit in one buffer and ``tail`` is of its dtype, ``tail`` is written after them there:
        the step reads a slice of that buffer, and makes no tensor to do so."""
        if not values:  # (a sentinel's clean step: the gradients' norms alone, into places of their own)
            return self._into_places(list(tail)) if tail else None
        if self.used != len(values):
            self._order = []  # stacked as they are: in probe order already
            return stack([*values, *tail])
        if self._order:
            return concat([p.span(0, p.used) for p in self._places.values() if p.used] + (
                [stack(list(tail))] if tail else []))
        places, used = self._last, self.used
        joined = _written_after(places, used, tail) if tail else None
        if joined is not None:
            return joined
        return concat([places.span(0, used), stack(list(tail))]) if tail else places.span(0, used)

    def _into_places(self, tail: list[torch.Tensor]) -> torch.Tensor:
        """0-d ``tail`` as one vector, written into the places of their dtype and device where they
        share one (no tensor made), else stacked."""
        first = tail[0]
        key = (first.dtype, first.device)
        places = self._places.get(key)
        if places is None:
            places = self._places[key] = _Places(first)
        joined = None if places.used else _written_after(places, 0, tail)
        return joined if joined is not None else stack(tail)

    def read_if_free(self, values: list[torch.Tensor]) -> list[float] | None:
        """``values`` (this step's) read on the host, in any order, where that syncs nothing: every
        one was written into places in CPU memory. None otherwise (a device's places, or values a
        compiled graph wrote elsewhere). Read place by place: joining them (``vector``) would make
        a tensor on a step of several dtypes."""
        if self.used != len(values) or any(key[1].type != "cpu" for key in self._places):
            return None
        return [value for places in self._places.values() if places.used
                for value in places.buffer[:places.used].tolist()]

    def in_order(self, read: list[float]) -> list[float]:
        """Values read from ``vector()`` back in probe order."""
        if not self._order:
            return read
        start, at = 0, {}
        for places in self._places.values():
            if places.used:
                at[places] = start  # where its slice begins in what vector() joined
                start += places.used
        ordered = []
        for places in self._order:
            i = at[places]
            at[places] = i + 2
            ordered += read[i:i + 2]
        return ordered

    def clear(self) -> None:
        for places in self._places.values():
            places.used = 0
        self._order = []
        self.used = 0


def _on_one_device(join, tensors: list[torch.Tensor]) -> torch.Tensor:
    """``join(tensors)``, with the tensors moved to the first one's device when they sit on several
    (pipeline stages)."""
    try:
        return join(tensors)
    except RuntimeError:
        device = tensors[0].device
        return join([t.to(device, non_blocking=True) for t in tensors])


def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` of 0-d tensors that may sit on several devices."""
    return _on_one_device(torch.stack, tensors)


def concat(pieces: list[torch.Tensor]) -> torch.Tensor:
    """1-d ``pieces`` as one vector, on the first one's device."""
    return pieces[0] if len(pieces) == 1 else _on_one_device(torch.cat, pieces)
