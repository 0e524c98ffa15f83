"""What a rank has to tell the coordinator, until the coordinator holds it: a bounded queue.

The training thread only puts (``put_event``, ``update``, ``put_control``): O(1), never blocking;
a full queue drops the event and counts it. The client thread takes: control messages first, then
events in numbered batches. What the coordinator has not said it ``received`` is kept (at most
``queue_size`` events: past that, new events wait in the queue) and sent again on the next
connection, or after ``_RESEND_AFTER_S`` without an answer. Nothing here touches a socket.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import deque
from typing import Any

from .events import Event, json_float
from .wire import MAX_EVENTS

_MAX_CONTROL = 1024
"""control messages (hello, captured, stopped, acks) that may wait; more are dropped"""
_RESEND_AFTER_S = 5.0
"""events sent and not received for this long (no ``received`` came) are sent again"""

Numbered = tuple[int, Event, str]
"""(the event's number in this session, the event, the action)"""


class Outbox:
    """What waits to be sent: control messages first, then queued events; shared by the training
    thread (which only puts, never blocking) and the client thread (which takes).

    ``identity``: the rank's ``hello`` body; every control message names its rank and job.
    """

    def __init__(self, identity: dict[str, Any], queue_size: int):
        self.identity = identity
        self.control: deque[tuple[str, dict[str, Any]]] = deque()
        """(type, body) of messages other than events, sent in order before any event"""
        self._queue: queue.Queue[tuple[Event, str]] = queue.Queue(queue_size)
        self._latest: tuple[int, float | None, float | None] = (0, None, None)
        self._carry: tuple[Event, str] | None = None
        self._window = queue_size
        """the most events sent and not received (past it, new events wait in the queue)"""
        self._next = 0
        """the number of the next event taken from the queue"""
        self.unreceived: deque[Numbered] = deque()
        """sent, and not yet received by the coordinator: oldest first"""
        self._again: deque[Numbered] = deque()
        """to send again, before any new event"""
        self._answered_at = 0.0
        """when the coordinator last said it received more (or the first unreceived event was sent)"""
        self._dropped_queued = 0
        """dropped by the training thread (queue full); under _drop_lock"""
        self.dropped_sent = 0
        """dropped by the client thread (could not send)"""
        self._drop_lock = threading.Lock()

    # --- training thread ------------------------------------------------------------------
    def put_event(self, event: Event, action: str) -> bool:
        try:
            self._queue.put_nowait((event, action))
            return True
        except queue.Full:
            with self._drop_lock:
                self._dropped_queued += 1
            return False

    def update(self, step: int, step_time_s: float | None, grad_norm: float | None) -> None:
        self._latest = (step, step_time_s, grad_norm)

    def put_control(self, type_: str, fields: dict[str, Any]) -> bool:
        """A message naming this rank and its job; False (dropped) when too many wait."""
        if len(self.control) >= _MAX_CONTROL:
            return False
        self.control.append((type_, {"rank": self.identity["rank"], "job": self.identity["job"], **fields}))
        return True

    @property
    def dropped(self) -> int:
        """Events dropped so far: queue full, or not sendable."""
        return self._dropped_queued + self.dropped_sent

    # --- client thread --------------------------------------------------------------------
    def heartbeat(self) -> dict[str, Any]:
        step, step_time_s, grad_norm = self._latest
        if step_time_s is not None and not (math.isfinite(step_time_s) and step_time_s >= 0):
            step_time_s = None
        identity = self.identity
        return {"rank": identity["rank"], "world_size": identity["world_size"], "job": identity["job"],
                "host": identity["host"], "pid": identity["pid"], "step": step,
                "step_time_s": step_time_s, "dropped": self.dropped, "grad_norm": json_float(grad_norm)}

    def empty(self) -> bool:
        """Nothing waits to be sent (events sent and not received may still come back)."""
        return not self.control and self._carry is None and not self._again and self._queue.empty()

    def settled(self) -> bool:
        """Everything was sent, and every event received."""
        return self.empty() and not self.unreceived

    def take_batch(self) -> list[Numbered]:
        """Up to MAX_EVENTS events with consecutive numbers that share one action: those to send
        again first, else queued ones while fewer than the window are unreceived."""
        if self._again:
            return self._take_again()
        room = min(MAX_EVENTS, self._window - len(self.unreceived))
        batch: list[Numbered] = []
        while len(batch) < room:
            if self._carry is not None:
                item, self._carry = self._carry, None
            else:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch and item[1] != batch[0][2]:
                self._carry = item
                break
            batch.append((self._next, *item))
            self._next += 1
        return batch

    def _take_again(self) -> list[Numbered]:
        batch = [self._again.popleft()]
        while self._again and len(batch) < MAX_EVENTS:
            number, _, action = self._again[0]
            if number != batch[-1][0] + 1 or action != batch[0][2]:
                break
            batch.append(self._again.popleft())
        return batch

    def sent(self, batch: list[Numbered], now: float) -> None:
        """``batch`` is on its way: kept until the coordinator says it received it."""
        if not self.unreceived:
            self._answered_at = now
        self.unreceived.extend(batch)

    def unsent(self, batch: list[Numbered]) -> None:
        """``batch`` could not be sent now: first in line next time."""
        self._again.extendleft(reversed(batch))

    def received(self, count: int, now: float) -> None:
        """The coordinator holds every event numbered below ``count``."""
        if self.unreceived and self.unreceived[0][0] < count:
            self._answered_at = now
        while self.unreceived and self.unreceived[0][0] < count:
            self.unreceived.popleft()
        while self._again and self._again[0][0] < count:
            self._again.popleft()

    def send_again(self, now: float | None = None) -> None:
        """Send every unreceived event again: always (a new connection: what ZeroMQ held for the
        last one is gone), or at ``now`` when none was received for ``_RESEND_AFTER_S``."""
        if now is not None and (not self.unreceived or now - self._answered_at < _RESEND_AFTER_S):
            return
        if now is not None:
            self._answered_at = now
        self._again = deque(sorted([*self.unreceived, *self._again], key=lambda item: item[0]))
        self.unreceived.clear()

    def goodbye(self, clean: bool) -> None:
        """The last heartbeat (the last step, and every event dropped) and the ``bye``, after the rest."""
        self.control.append(("heartbeat", self.heartbeat()))
        self.control.append(("bye", {"rank": self.identity["rank"], "job": self.identity["job"], "clean": clean}))

    def drop_unsent(self) -> tuple[int, int]:
        """Forget the events left, unsent or unreceived, counted as dropped (closing): (events,
        other messages but the goodbye's)."""
        events = len(self.unreceived) + len(self._again) + (self._carry is not None) + self._queue.qsize()
        self.unreceived.clear()
        self._again.clear()
        self._carry = None
        while not self._queue.empty():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self.dropped_sent += events
        return events, sum(type_ not in ("bye", "heartbeat") for type_, _ in self.control)
