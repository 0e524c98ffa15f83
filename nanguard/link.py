"""The state of one rank's link to the coordinator, apart from the socket: which coordinator
instance welcomed the connection (``Link``), whether one has for a while (``Silence``), whether it
let this rank in (``Admission``), how long the connection has carried nothing back (``Hearing``),
where it goes (the node's relay or the coordinator itself: ``Target``) and what closing it asks
(``Closing``), and whether a rank's identity is one (``check_identity``). The client thread asks;
nothing here touches a socket.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .errors import ProtocolError
from .protocol import IDENTITY_FIELDS, OPTIONAL_IDENTITY_FIELDS
from .wire import Codec, Message, ReplayFilter, check_body

if TYPE_CHECKING:
    from .outbox import Outbox


def check_identity(identity: dict[str, Any]) -> None:
    """ValueError unless ``identity`` is a valid ``hello`` body with exactly the identity fields."""
    missing = [name for name in IDENTITY_FIELDS if name not in identity]
    if missing or set(identity) - set(IDENTITY_FIELDS) - set(OPTIONAL_IDENTITY_FIELDS):
        raise ValueError(f"identity needs exactly the fields {', '.join(IDENTITY_FIELDS)} (and may have "
                         f"{', '.join(OPTIONAL_IDENTITY_FIELDS)}); got {', '.join(sorted(identity))}")
    try:
        check_body("hello", identity)
    except ProtocolError as exc:
        raise ValueError(f"invalid identity: {exc}") from None


class Link:
    """The protocol state of one rank's link to the coordinator, apart from the socket.

    ``sender`` names this session (every message to it must say so in ``to``). ``instance`` is the
    coordinator instance that welcomed this connection, or None before its ``welcome``: until then
    only handshakes go out.
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self.instance: str | None = None
        self._replay = ReplayFilter(max_senders=16)
        self._first_handshake: int | None = None
        """seq of the first handshake on this connection: a welcome must answer one of ours since"""

    @property
    def sender(self) -> str:
        return self.codec.sender

    def reset(self) -> None:
        """A new connection (or none): welcome again before anything else is sent."""
        self.instance, self._first_handshake = None, None

    def handshake(self) -> list[bytes]:
        frames = self.codec.encode("handshake", {}, to="")
        if self._first_handshake is None:
            self._first_handshake = self.codec.last_seq
        return frames

    def encode(self, type_: str, body: dict[str, Any]) -> list[bytes]:
        """A message to the welcoming instance (never called before the welcome)."""
        return self.codec.encode(type_, body, to=self.instance)

    def read(self, frames: list[bytes], now: float) -> Message:
        """A message from the coordinator: a ``welcome`` (then ``instance`` is set), or a ``stop`` or
        ``received`` of the welcoming instance; raises ProtocolError for anything else."""
        message = self.codec.decode(frames)
        self._replay.check(message, now)
        if message.type == "welcome":
            first = self._first_handshake
            if first is None or message.body["handshake_seq"] < first:
                raise ProtocolError(f"a welcome from {message.sender} that answers no handshake of this "
                                    "connection", reason="replayed")
            self.instance = message.sender
        elif message.type in ("stop", "received"):
            if message.sender != self.instance:
                raise ProtocolError(f"a {message.type} from {message.sender}, not from the coordinator instance "
                                    f"that welcomed this connection ({self.instance})", reason="instance")
        else:
            raise ProtocolError(f"a {message.type} message does not travel to a rank", reason="schema")
        return message


class Silence:
    """Says when the coordinator has not answered for a while, and when it answers again.

    The link is up from the coordinator's ``welcome`` until a disconnect. Down for ``after_s`` (the
    process starting counts as down), it is said once, with the likely causes; when the link comes
    back after that, once more. The client thread asks; nothing here touches a socket.
    """

    def __init__(self, address: str, after_s: float, now: float):
        self.address, self.after_s = address, after_s
        self._since: float | None = now
        """when the link went down, or None while it is up"""
        self._said = False

    def down(self, now: float) -> None:
        if self._since is None:
            self._since, self._said = now, False

    def check(self, now: float, connected: bool) -> str | None:
        """The warning, once per time the link is down past ``after_s``; ``connected``: a connection
        is open, but no welcome came over it."""
        if self._since is None or self._said or now - self._since < self.after_s:
            return None
        self._said = True
        waited = f"for {now - self._since:.0f} s"
        if connected:
            why = (f"the coordinator at {self.address} accepts the connection but has not welcomed this "
                   f"rank {waited}: does NANGUARD_TOKEN differ from the coordinator's, or does it serve "
                   "another job?")
        else:
            why = (f"no coordinator has answered at {self.address} {waited}: is nanguard coordinator "
                   "running there and reachable from this host, with the same CurveZMQ key "
                   "(NANGUARD_CURVE_PUBLIC_KEY) if it uses one?")
        return (f"nanguard: {why} Training goes on, guarded locally; events wait in a bounded queue "
                "(then count as dropped) and this is said again when the link is up")

    def up(self, now: float) -> str | None:
        """The coordinator welcomed this rank: the notice that the link is back, if it was said to be down."""
        since, said = self._since, self._said
        self._since, self._said = None, False
        if since is None or not said:
            return None
        return (f"nanguard: the coordinator at {self.address} answers again after {now - since:.0f} s; "
                "this rank reports to it")


class Hearing:
    """How long a welcomed connection has carried nothing back from the coordinator. Past a quarter
    of ``dead_s`` the heartbeats ask for an answer; past ``dead_s`` the connection is given up and
    made again (after a partition, TCP itself may wait minutes to resend)."""

    def __init__(self, dead_s: float):
        self.dead_s = dead_s
        self._at = 0.0
        """when (monotonic) the coordinator last said anything over this connection, or it was made"""

    def heard(self, now: float) -> None:
        self._at = now

    def quiet_s(self, now: float) -> float:
        return now - self._at

    def ask(self, now: float) -> bool:
        return self.quiet_s(now) > self.dead_s / 4

    def dead(self, now: float) -> bool:
        return self.quiet_s(now) > self.dead_s


class Admission:
    """Whether the coordinator let this rank in: it answers a ``hello`` it accepts with a
    ``received``. One it refuses (it serves another job, or a launch of this job whose ranks it still
    counts alive: a rank killed without a ``bye`` counts for the coordinator's ``--dead-after-s``) is
    sent again every ``again_s``; that it was refused is said once, and once more when it is let in."""

    def __init__(self, address: str, again_s: float):
        self.address, self.again_s = address, again_s
        self._asked: float | None = None
        """when the hello now unanswered was first sent on this connection, or None"""
        self._last = 0.0
        self._said = False

    def asked(self, now: float) -> None:
        """A hello goes out (after a welcome)."""
        self._asked, self._last = now, now

    def answered(self, now: float) -> str | None:
        """The coordinator answered: the notice that the rank is let in, if it was said to be refused."""
        asked, said = self._asked, self._said
        self._asked, self._said = None, False
        if asked is None or not said:
            return None
        return f"nanguard: the coordinator at {self.address} let this rank in after {now - asked:.0f} s"

    def again(self, now: float) -> tuple[bool, str | None]:
        """(send the hello again now, the warning to say once)."""
        if self._asked is None or now - self._last < self.again_s:
            return False, None
        self._last = now
        if self._said:
            return True, None
        self._said = True
        return True, (f"nanguard: the coordinator at {self.address} has not let this rank in ({now - self._asked:.0f} s "
                      "without an answer to its hello): it serves another job, or a launch of this job whose "
                      "ranks it still counts alive (a rank killed without saying bye counts until the "
                      "coordinator's --dead-after-s); this rank asks again every "
                      f"{self.again_s:g} s and is guarded locally meanwhile")


RELAY_WAIT_S = 30.0
"""how long a rank waits for its node's relay (local rank 0 may start later) before it goes to the
coordinator directly"""
RELAY_LOST_S = 5.0
"""how long a rank whose relay was there waits for it to come back before it goes directly"""


class Target:
    """Where a rank's connection goes: its node's relay (``relay.py``; None: none) until the relay is
    not there for a while or carries nothing back though asked, then the coordinator itself, for good."""

    def __init__(self, coordinator: str, relay: str | None, now: float):
        self.coordinator, self.relay = coordinator, relay
        self._seen, self._lost_at = False, now

    @property
    def address(self) -> str:
        return self.relay or self.coordinator

    def new_connection(self, now: float) -> None:
        self._seen, self._lost_at = False, now

    def connected(self) -> None:
        self._seen = True

    def disconnected(self, now: float) -> None:
        self._lost_at = now

    def relay_absent(self, now: float, connected: bool) -> bool:
        """Whether the relay has been away too long: the next connection goes directly."""
        return self.relay is not None and not connected and now - self._lost_at > (
            RELAY_LOST_S if self._seen else RELAY_WAIT_S)

    def go_directly(self) -> bool:
        """From now on to the coordinator itself; True when this gave up a relay."""
        gave_up, self.relay = self.relay is not None, None
        return gave_up


class Closing:
    """What ``close`` asks of the client thread: the events first, until the coordinator holds them
    all or half the time is gone; then what is left counts as dropped, and the last heartbeat (which
    says so) and the goodbye go; the thread ends once they are sent, or when the time is up."""

    def __init__(self, clean: bool, timeout_s: float):
        now = time.monotonic()
        self.clean = clean
        self.bye_at, self.deadline = now + 0.5 * timeout_s, now + 0.8 * timeout_s
        self._said = False

    def next(self, outbox: Outbox, done: bool, reachable: bool) -> str | None:
        """After a turn: "goodbye" (say it now), "end" (the thread ends), or None (not yet)."""
        now = time.monotonic()
        if not self._said:
            if outbox.settled() or not reachable or now >= self.bye_at:
                self._said = True
                return "goodbye"
            return None
        return "end" if done or not reachable or now >= self.deadline else None
