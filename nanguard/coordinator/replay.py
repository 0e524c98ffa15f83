"""The coordinator's replay memory: the last ``seq`` of each sender, in tables that cannot flush each other.

A message is refused when it was sent more than ``window_s`` away from the coordinator's clock
(``stale``) or when its sender has already sent one with this ``seq`` or a later one (``replayed``).
Memory is bounded, so senders must be forgotten some time; a forgotten sender's captured
messages can be played again for as long as they are not stale. One table for everyone let
65,552 handshakes under new sender names (anyone who can sign a handshake can send them) push
the operator's session out, after which a captured ``stop_request`` of the operator stopped the
next job.

So a sender lives in one of three tables, each bounded and each forgetting its own least recently
heard first:

    operators  sessions that spoke with the operator credential, or whose stop request was
               accepted: only operators fill it
    ranks      sessions whose hello registered a rank: only admitted rank processes fill it
    guests     every other sender (handshakes, status requests, refused messages): whatever
               floods in pushes out only other guests

Every sender starts as a guest; ``trust`` moves it once a message of it was accepted.
"""

from __future__ import annotations

from collections import OrderedDict

from ..errors import ProtocolError
from ..wire import Message

OPERATOR = "operator"
RANK = "rank"
GUEST = "guest"
DEFAULT_SIZES = {OPERATOR: 4096, RANK: 65536, GUEST: 65536}
"""senders kept per table: a 16,384-rank job restarts each rank four times before its first
sessions are forgotten"""


class ReplayMemory:
    """Refuses replayed and stale messages; ``sizes`` bound the tables (see ``DEFAULT_SIZES``)."""

    def __init__(self, window_s: float = 300.0, sizes: dict[str, int] | None = None):
        sizes = {**DEFAULT_SIZES, **(sizes or {})}
        if not window_s > 0 or set(sizes) != set(DEFAULT_SIZES) or min(sizes.values()) < 1:
            raise ValueError(f"window_s={window_s!r} must be positive and sizes={sizes!r} one positive "
                             f"size for each of {', '.join(DEFAULT_SIZES)}")
        self.window_s = window_s
        self.sizes = sizes
        self._tables: dict[str, OrderedDict[str, int]] = {name: OrderedDict() for name in sizes}

    def check(self, message: Message, now: float) -> None:
        """Remember ``message``'s seq, or raise ProtocolError (``stale``, ``replayed``)."""
        sender, seq = message.sender, message.seq
        if abs(now - message.time) > self.window_s:
            raise ProtocolError(f"message from {sender} was sent {now - message.time:+.0f} s away from "
                                f"this clock (window {self.window_s:g} s)", reason="stale")
        table = self._table_of(sender)
        if table is None:
            self._keep(GUEST, sender, seq)
            return
        last = table[sender]
        if seq <= last:
            raise ProtocolError(f"message {seq} from {sender} repeats or precedes one already seen ({last})",
                                reason="replayed")
        table[sender] = seq
        table.move_to_end(sender)

    def trust(self, message: Message, kind: str) -> None:
        """``message`` was accepted: keep its sender in the ``kind`` table (OPERATOR or RANK) from now
        on, where guests cannot push it out."""
        if kind not in (OPERATOR, RANK):
            raise ValueError(f"kind {kind!r} is not {OPERATOR} or {RANK}")
        table = self._table_of(message.sender)
        if table is self._tables[kind] or table is self._tables[OPERATOR]:
            return  # an operator session stays one
        seq = message.seq if table is None else table.pop(message.sender)
        self._keep(kind, message.sender, seq)

    def kind_of(self, sender: str) -> str | None:
        """The table ``sender`` is in, or None (never heard, or forgotten)."""
        return next((name for name, table in self._tables.items() if sender in table), None)

    def __len__(self) -> int:
        return sum(map(len, self._tables.values()))

    def _table_of(self, sender: str) -> OrderedDict[str, int] | None:
        return next((table for table in self._tables.values() if sender in table), None)

    def _keep(self, kind: str, sender: str, seq: int) -> None:
        table = self._tables[kind]
        if len(table) >= self.sizes[kind]:
            table.popitem(last=False)
        table[sender] = seq
