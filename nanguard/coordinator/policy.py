"""When the coordinator stops a job: pure logic, no I/O, no clock (the time is passed in)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ConfigError
from ..protocol import KINDS, STOP_KINDS

_MAX_LAYER_IN_REASON = 200


@dataclass(frozen=True, slots=True)
class Decision:
    """Stop the job: the coordinator sends a stop command to every rank."""

    reason: str
    """one sentence for people: what was seen, where, when"""
    label: str
    """``nonfinite`` (stop at the first non-finite step, as the ranks themselves do) or ``policy``
    (a threshold of the coordinator's): the ``reason`` label of nanguard_stops_total"""
    kind: str
    rank: int
    step: int


class Policy:
    """Stops a job once ``stop_after`` distinct training steps have shown a stop-kind event
    within ``window_s`` seconds (default: at the first).

    ``stop_kinds``: event kinds that can stop a job; ``warn_kinds`` are taken out of them (and
    ``grad_norm``/``spike`` are never in them). ``ignore_skipped``: events of a batch whose rank
    skipped the step (action ``skip``) do not count, as the rank already dealt with them. At
    most one decision per job; ``reset()`` starts the next job.
    """

    def __init__(self, stop_kinds: Iterable[str] = STOP_KINDS, warn_kinds: Iterable[str] = (),
                 stop_after: int = 1, window_s: float = 60.0, ignore_skipped: bool = True):
        stop_kinds, warn_kinds = tuple(stop_kinds), tuple(warn_kinds)
        unknown = sorted(set(stop_kinds + warn_kinds) - set(KINDS))
        if unknown:
            raise ConfigError(f"unknown event kind(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
        if isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 1:
            raise ConfigError(f"stop_after={stop_after!r} must be a positive integer")
        if not (isinstance(window_s, (int, float)) and 0 < window_s < float("inf")):
            raise ConfigError(f"window_s={window_s!r} must be a positive number of seconds")
        self.stop_kinds = frozenset(stop_kinds) & frozenset(STOP_KINDS) - frozenset(warn_kinds)
        self.stop_after = stop_after
        self.window_s = float(window_s)
        self.ignore_skipped = ignore_skipped
        self._bad_steps: dict[int, float] = {}
        """step -> when it was first seen bad, within the window"""
        self.decision: Decision | None = None

    def reset(self) -> None:
        """Forget everything: a new job starts."""
        self._bad_steps.clear()
        self.decision = None

    def observe(self, kind: str, rank: int, step: int, layer: str, action: str | None,
                now: float) -> Decision | None:
        """One event of a rank; a Decision the first time the job must stop, else None."""
        if self.decision is not None or kind not in self.stop_kinds:
            return None
        if action == "skip" and self.ignore_skipped:
            return None
        horizon = now - self.window_s
        for old in [s for s, seen in self._bad_steps.items() if seen < horizon]:
            del self._bad_steps[old]
        self._bad_steps.setdefault(step, now)
        if len(self._bad_steps) < self.stop_after:
            return None
        if len(layer) > _MAX_LAYER_IN_REASON:
            layer = layer[:_MAX_LAYER_IN_REASON] + "..."
        where = f"{kind} event on rank {rank} at step {step}" + (f" (layer {layer})" if layer else "")
        if self.stop_after == 1:
            reason, label = f"non-finite {where}", "nonfinite"
        else:
            reason = (f"non-finite values in {len(self._bad_steps)} steps within "
                      f"{self.window_s:g} s; the last: {where}")
            label = "policy"
        self.decision = Decision(reason, label, kind, rank, step)
        self._bad_steps.clear()
        return self.decision
