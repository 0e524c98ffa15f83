"""At most one log line per key and interval: a storm of the same report must not flood a log."""

from __future__ import annotations

import time
from collections.abc import Hashable

MAX_KEYS = 4096


class Throttle:
    """``allow(key)``: whether to log now, and how many were held back since the last line."""

    def __init__(self, every_s: float, clock=time.monotonic):
        self.every_s = every_s
        self._clock = clock
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> tuple[bool, int]:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False, 0
        if last is None and len(self._last) >= MAX_KEYS:  # bounded: forget the oldest key
            oldest = next(iter(self._last))
            del self._last[oldest]
            self._held.pop(oldest, None)
        self._last[key] = now
        return True, self._held.pop(key, 0)
