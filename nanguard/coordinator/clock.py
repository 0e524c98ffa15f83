"""The coordinator's two clocks, read together once per message or timer.

The wall clock is what people and other machines understand (a rank's ``last_seen``, a stop's
``time``, the log's ``received``, the replay window against the sender's clock); it jumps when
someone or NTP sets it. Every duration that decides something (is a rank dead or stalled, is a
stop due again) is measured on the monotonic clock, which never jumps.
"""

from __future__ import annotations

import time
from typing import NamedTuple


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
    """Raise ValueError naming the first argument that is not a positive number of seconds."""
    for name, value in seconds.items():
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be a positive number of seconds")
