"""The flight recorder: the road to an incident, step by step ("the loss spiked, then NaN").

Per step it keeps scalars the guard already has on the host after its one read: the step, the
checked loss, the total gradient norm, the GradScaler's scale, the learning rate, the step time,
and every parameter's gradient norm (float32, so that the top parameters of any step can be named
later without sorting on every step). A ring of ``capacity`` steps: memory is fixed, whatever the
length of the run. An incident writes it as ``rank<k>/flight.json``.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from typing import Any

COLUMNS = ("step", "loss", "grad_norm", "scale", "lr", "step_time_s")
FORMAT_VERSION = 1
TOP = 5


def _number(value: float | None) -> float | None:
    """JSON has no NaN or Inf: those go as None (the events say which)."""
    return value if value is not None and math.isfinite(value) else None


def _rank_key(norm: float) -> float:
    return norm if norm == norm else math.inf  # a NaN norm ranks first


class FlightRecorder:
    def __init__(self, capacity: int):
        self._rows: deque[tuple] = deque(maxlen=capacity)
        self._norms: deque[tuple[array, tuple[str, ...]] | None] = deque(maxlen=capacity)
        self._names: tuple[str, ...] = ()
        self._key: tuple[int, int, int] | None = None

    def record(self, step: int, *, loss: float | None, grad_norm: float | None, scale: float | None,
               lr: float | None, step_time_s: float | None, norms: list[float] = (),
               params: list[Any] = (), name=str) -> None:
        """One step. ``norms`` belong to ``params``, named by ``name(param)`` (asked again only
        when the parameters change: a run's rows share one tuple of names)."""
        self._rows.append((step, loss, grad_norm, scale, lr, step_time_s))
        if not norms:
            self._norms.append(None)
            return
        key = (len(params), id(params[0]), id(params[-1]))
        if key != self._key:
            self._key, self._names = key, tuple(map(name, params))
        self._norms.append((array("f", norms), self._names))

    def to_dict(self) -> dict[str, Any]:
        """What flight.json holds: oldest first."""
        top = []
        for row, kept in zip(self._rows, self._norms):
            if kept is not None:
                norms, names = kept
                ranked = heapq.nlargest(TOP, range(len(norms)), key=lambda i: _rank_key(norms[i]))
                top.append({"step": row[0], "params": {names[i]: _number(float(norms[i])) for i in ranked}})
        return {"version": FORMAT_VERSION, "columns": list(COLUMNS),
                "rows": [[row[0], *map(_number, row[1:])] for row in self._rows], "top_params": top}

    def __len__(self) -> int:
        return len(self._rows)
