"""The coordinator's two clocks, read together once per message or timer.

The wall clock is what people and other machines understand (a rank's ``last_seen``, a stop's
``time``, the log's ``received``, the replay window against the sender's clock); it jumps when
someone or NTP sets it. Every duration that decides something (is a rank dead or stalled, is a
stop due again) is measured on the monotonic clock, which never jumps; the loop's ``LoopClock``
also leaves out of it the time the process did not run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import NamedTuple

log = logging.getLogger("nanguard.coordinator")


class Instant(NamedTuple):
    """One reading of both clocks; tests build their own to drive the coordinator's parts."""

    wall: float
    """seconds since the epoch (``time.time()``): shown, exported and logged"""
    mono: float
    """``time.monotonic()``: what durations are measured on"""

    @classmethod
    def now(cls) -> Instant:
        return cls(time.time(), time.monotonic())


def require_positive(**seconds: float) -> None:
    """Raise ValueError naming the first argument that is not a positive number of seconds (finite:
    a rank silent for ever must still count as dead)."""
    for name, value in seconds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name}={value!r} must be a positive number of seconds (finite)")


class LoopClock:
    """The loop's reading of both clocks, with the time the loop did not run taken out of the
    monotonic one.

    The loop reads the clock at least every half second. Two readings further apart than
    ``pause_after_s`` mean the process was not running (SIGSTOP, a frozen VM, a machine starved of
    CPU): nothing could be heard then, so that gap is not counted as anyone's silence. Without this,
    every rank would read as dead for one tick after a 30 s pause, before the heartbeats they had
    queued meanwhile are read. ``mono`` and ``wall`` are the clocks read (tests pass their own).
    """

    def __init__(self, pause_after_s: float = 2.0, *, mono: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        require_positive(pause_after_s=pause_after_s)
        self.pause_after_s = pause_after_s
        self.paused_s = 0.0
        """time taken out so far"""
        self._mono, self._wall = mono, wall
        self._last: float | None = None

    def now(self) -> Instant:
        mono = self._mono()
        if self._last is not None and mono - self._last > self.pause_after_s:
            gap = mono - self._last
            self.paused_s += gap
            log.warning("the coordinator did not run for %.1f s (stopped, or starved of CPU); that time "
                        "does not count as any rank's silence", gap)
        self._last = mono
        return Instant(self._wall(), mono - self.paused_s)
