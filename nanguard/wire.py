"""The wire protocol between ranks, the coordinator and operator commands: one encode/decode pair.

The coordinator binds one ZeroMQ ROUTER socket; ranks and operator commands connect DEALER
sockets. A message is one or two frames: ``[payload]`` without a token, ``[payload, mac]`` with
one, where ``payload`` is compact JSON (one line) of the envelope

    {"v": 2, "type": str, "sender": str, "seq": int, "time": float, "to": str, "body": {...}}

and ``mac`` the raw HMAC-SHA256 of ``payload`` under the sender's credential: NANGUARD_TOKEN for
ranks, NANGUARD_OPERATOR_TOKEN for operators (``Message.role`` says which one verified it).
``sender`` names one session: it is unique per process and socket (the coordinator's is its
instance id), and ``seq`` grows by one per message of a sender, so ``ReplayFilter`` can refuse a
message seen before. ``to`` names the session the message is for, and a receiver refuses any
message not addressed to it (reason ``instance``): a captured message cannot be played to another
coordinator, to the same one after a restart, or to another rank. Only a ``handshake`` goes to
nobody (``to`` is empty); its ``welcome`` tells the sender the coordinator's instance id. Which
way each type travels:

    rank -> coordinator       handshake, hello, heartbeat, events, captured, stopped, ack, bye
    coordinator -> rank       welcome, stop, received
    operator -> coordinator   handshake, status_request, stop_request, clear_request
    coordinator -> operator   welcome, status, stop_accepted, cleared, refused

Version 1 had no ``to``, one token for everyone and a ``bye`` without ``clean``.

Delivery of events: a rank numbers the events of its session from 0 and says the number of a
batch's first one (``events.first``); the coordinator answers each such batch with ``received``
(how many of the session's events it holds: every number below ``events``), drops what it already
holds (a batch sent again after a lost answer), and never answers a batch without ``first`` (a rank
of an earlier release, which keeps no events for sending again). The rank keeps what is not yet
received, bounded, and sends it again on its next connection.

A live link: a rank that has heard nothing from the coordinator for a while says ``answer`` in its
heartbeat, which is answered with ``received`` too; one that still hears nothing makes a new
connection (``client.py``). ZeroMQ's own pings are not used: libzmq 4.3.5 aborts a process that
answers a ping on a connection it has already given up reading (zeromq/libzmq#4841), and a
coordinator whose input waits at its high-water mark while the peer resets is such a process.

Every body is checked against its schema on decode; anything else is a ``ProtocolError`` whose
``reason`` (one of ``protocol.WIRE_REASONS``) says which check failed. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ProtocolError
from .events import event_values, shown
from ._text import printable
from .protocol import ACTIONS, IDENTITY_FIELDS, MAX_JOB_LENGTH, ORIGINS, ROLES, STOP_REASONS

VERSION = 2
MAX_BYTES = 64 * 1024
"""the largest payload of any message but ``status``"""
MAX_FRAME_BYTES = 2 * MAX_BYTES
"""the largest frame a socket of nanguard's reads (ZeroMQ's MAXMSGSIZE); a larger one closes its
connection before nanguard sees it"""
MAX_STATUS_BYTES = 32 * 1024 * 1024
"""the largest ``status`` payload: the one message that grows with the number of ranks"""
MAX_EVENTS = 256
"""the most events one ``events`` message carries"""
MAX_RANK = 1 << 20
"""ranks are below this; world sizes at most this"""

_ENVELOPE = frozenset(("v", "type", "sender", "seq", "time", "to", "body"))
_MAX_SENDER = 256
_MAX_SEQ = (1 << 63) - 1
_FLOAT_MAX = int(sys.float_info.max)

Check = Callable[[Any], Any]


def _short(value: Any) -> str:
    text = shown(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a JSON number or not finite: an
    integer of 400 digits is a JSON number that no float holds (float() raises OverflowError)."""
    if value.__class__ is float:
        return value if math.isfinite(value) else None
    if value.__class__ is int:
        return float(value) if -_FLOAT_MAX <= value <= _FLOAT_MAX else None
    return None


# --- body schemas ---------------------------------------------------------------------------
# A check returns the (normalised) value or raises ValueError saying what was expected; an
# object or list check prefixes the path of the field that failed (".ranks[3].pid").


def _integer(lo: int, hi: int) -> Check:
    def check(value: Any) -> int:
        if value.__class__ is not int or not lo <= value <= hi:  # bool is not int here
            raise ValueError(f": expected an integer in [{lo}, {hi}], got {_short(value)}")
        return value
    return check


def _text(max_len: int, choices: Sequence[str] | None = None) -> Check:
    """A string of at most ``max_len`` printable characters (``str.isprintable``): free text is
    shown to operators and logged, so no terminal control sequence, line break or bidi control
    ever reaches them (``_text.printable`` escapes what a sender should not send)."""
    def check(value: Any) -> str:
        if not isinstance(value, str) or len(value) > max_len or not value.isprintable():
            raise ValueError(f": expected a string of at most {max_len} printable characters (no control "
                             f"characters), got {_short(value)}")
        if choices is not None and value not in choices:
            raise ValueError(f": expected one of {', '.join(choices)}, got {_short(value)}")
        return value
    return check


def _number(lo: float, hi: float, *, nonfinite: bool = False) -> Check:
    """A JSON number in [lo, hi]; with ``nonfinite`` also "nan", "inf", "-inf" (as floats)."""
    def check(value: Any) -> float:
        if nonfinite and value.__class__ is str and value in ("nan", "inf", "-inf"):
            return float(value)
        number = _finite(value)
        if number is None or not lo <= number <= hi:
            raise ValueError(f": expected a number in [{lo:g}, {hi:g}], got {_short(value)}")
        return number
    return check


def _boolean(value: Any) -> bool:
    if value.__class__ is not bool:
        raise ValueError(f": expected true or false, got {_short(value)}")
    return value


def _optional(check: Check) -> Check:
    return lambda value: None if value is None else check(value)


def _list(item: Check, min_len: int, max_len: int) -> Check:
    def check(value: Any) -> list:
        if not isinstance(value, list) or not min_len <= len(value) <= max_len:
            size = len(value) if isinstance(value, list) else _short(value)
            raise ValueError(f": expected a list of {min_len} to {max_len} items, got {size}")
        try:
            return [item(element) for element in value]
        except ValueError:
            for index, element in enumerate(value):  # again, slowly, to say which item
                try:
                    item(element)
                except ValueError as exc:
                    raise ValueError(f"[{index}]{exc}") from None
            raise
    return check


def _object(required: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    fields = {**required, **(optional or {})}
    names = frozenset(fields)

    def check(value: Any) -> dict:
        if not isinstance(value, dict):
            raise ValueError(f": expected an object, got {_short(value)}")
        missing = [name for name in required if name not in value]
        if missing:
            raise ValueError(f": missing field(s) {', '.join(missing)}")
        if not names.issuperset(value):
            unknown = sorted(str(name) for name in value if name not in names)
            raise ValueError(f": unknown field(s) {', '.join(unknown)[:200]}")
        out = {}
        for name, element in value.items():
            try:
                out[name] = fields[name](element)
            except ValueError as exc:
                raise ValueError(f".{name}{exc}") from None
        return out
    return check


_RANK = _integer(0, MAX_RANK - 1)
_WORLD = _integer(1, MAX_RANK)
_COUNT = _integer(0, _MAX_SEQ)
_PID = _integer(0, (1 << 32) - 1)
_JOB = _text(MAX_JOB_LENGTH)
_HOST = _text(255)
_COMMAND_ID = _text(64)
_REASON = _text(500)
_SECONDS = _number(0.0, 1e9)
_TIMESTAMP = _number(0.0, 1e11)
_GRAD_NORM = _optional(_number(0.0, math.inf, nonfinite=True))
_EVENT_TEXT_MAX = {"layer": 1024, "module_type": 256, "host": 255, "device": 256, "message": 2000,
                   "output_field": 256}
"""an event's text fields and their longest: printable text only (a stop's reason shows the layer)"""


def _event(value: Any) -> dict[str, Any]:
    """An ``Event.to_dict()``, checked by Event's own rules plus bounds; returned as Event's
    keyword arguments (``Event(**values)`` rebuilds it)."""
    try:
        values = event_values(value)
    except ProtocolError as exc:
        raise ValueError(f": {exc}") from None
    if values["rank"] < 0 or values["step"] < 0:
        raise ValueError(f": negative rank or step ({values['rank']}, {values['step']})")
    for name, max_len in _EVENT_TEXT_MAX.items():
        text = values.get(name) or ""
        if len(text) > max_len:
            raise ValueError(f".{name}: longer than {max_len} characters")
        if not text.isprintable():
            raise ValueError(f".{name}: control characters in {_short(text)}")
    # free-form, and written to the coordinator's event log as received: its text printable too
    # (as JSON, whose escapes make C0 controls printable; DEL, C1 and format controls stay raw)
    if values.get("extra") and not json.dumps(values["extra"], ensure_ascii=False).isprintable():
        raise ValueError(".extra: control characters in its keys or text")
    return values


def wire_event(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (an ``Event.to_dict()``, changed in place) as the schema takes it: its text
    escaped (``_text.printable``) where it holds a character the schema refuses, so that a module
    named with a control character (or a message with a line break) costs its look, not the event."""
    for name, max_len in _EVENT_TEXT_MAX.items():
        text = values.get(name)
        if text.__class__ is str and not text.isprintable():
            values[name] = printable(text)[:max_len]
    return values


_STATUS_RANK = _object({
    "rank": _RANK, "host": _HOST, "pid": _optional(_PID), "world_size": _optional(_WORLD),
    "step": _optional(_COUNT), "step_time_s": _optional(_SECONDS), "grad_norm": _GRAD_NORM,
    "last_seen": _TIMESTAMP, "alive": _boolean, "stalled": _boolean, "finished": _boolean,
    "failed": _boolean, "events": _COUNT, "dropped": _COUNT,
}, {"relayed": _boolean})  # (through its node's relay: relay.py)
_STOP_STATE = _object({
    "command_id": _COMMAND_ID, "origin": _text(16, ORIGINS), "reason": _REASON, "time": _TIMESTAMP,
    "acked": _list(_RANK, 0, MAX_RANK),
}, {"counted_as": _text(16, STOP_REASONS),  # (the reason nanguard_stops_total counts it under)
    "job": _JOB, "restart": _optional(_COUNT)})  # the incarnation it stopped

SCHEMAS: dict[str, Check] = {
    # rank or operator -> coordinator, and its answer
    "handshake": _object({}),
    "welcome": _object({"handshake_seq": _COUNT}),
    # rank -> coordinator
    "hello": _object(dict(zip(IDENTITY_FIELDS, (_RANK, _RANK, _WORLD, _HOST, _PID, _JOB, _text(64),
                                                 _text(64)))),
                     {"restart": _COUNT}),  # TORCHELASTIC_RESTART_COUNT; ranks of earlier releases omit it
    "heartbeat": _object({"rank": _RANK, "world_size": _WORLD, "job": _JOB, "host": _HOST, "pid": _PID,
                          "step": _COUNT, "step_time_s": _optional(_SECONDS), "dropped": _COUNT,
                          "grad_norm": _GRAD_NORM},
                         {"answer": _boolean}),  # asks for a ``received``: the rank heard nothing for a while
    "events": _object({"rank": _RANK, "job": _JOB, "events": _list(_event, 1, MAX_EVENTS)},
                      {"action": _text(8, ACTIONS), "first": _COUNT}),
    "captured": _object({"rank": _RANK, "job": _JOB, "step": _COUNT, "incident": _text(4096)}),
    "stopped": _object({"rank": _RANK, "job": _JOB, "step": _COUNT,
                        "reason": _text(16, STOP_REASONS)}),
    "ack": _object({"rank": _RANK, "command_id": _COMMAND_ID}),
    "bye": _object({"rank": _RANK, "job": _JOB, "clean": _boolean}),
    # coordinator -> rank
    "stop": _object({"command_id": _COMMAND_ID, "reason": _REASON, "origin": _text(16, ORIGINS)}),
    "received": _object({"rank": _RANK, "events": _COUNT}),
    # operator <-> coordinator
    "status_request": _object({}),
    "status": _object({"job": _optional(_JOB), "ranks": _list(_STATUS_RANK, 0, MAX_RANK),
                       "stop": _optional(_STOP_STATE)}),
    "stop_request": _object({"reason": _REASON}),
    "stop_accepted": _object({"command_id": _COMMAND_ID, "existing": _boolean}),
    "clear_request": _object({"reason": _REASON}),
    "cleared": _object({"command_id": _optional(_COMMAND_ID)}),  # the stop lifted; null: none stood
    "refused": _object({"reason": _REASON}),
}
TYPES = tuple(SCHEMAS)


def check_body(type_: str, body: Any) -> dict[str, Any]:
    """The body of a ``type_`` message, checked and normalised; ProtocolError("schema") if bad.

    Normalised: numbers of float fields are floats ("nan"/"inf" strings too), and the items of
    ``events`` are ``Event`` keyword arguments.
    """
    schema = SCHEMAS.get(type_)
    if schema is None:
        raise ProtocolError(f"unknown message type {_short(type_)}; known: {', '.join(TYPES)}",
                            reason="schema")
    try:
        return schema(body)
    except ValueError as exc:
        raise ProtocolError(f"bad {type_} message body{exc}", reason="schema") from None


# --- envelope -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Message:
    """One decoded, authenticated and schema-checked message."""

    type: str
    sender: str
    seq: int
    time: float
    """the sender's clock when it encoded the message (seconds since the epoch)"""
    to: str
    """the session it was sent to: the receiver's own ``sender`` name, or "" (a handshake)"""
    body: dict[str, Any]
    payload: bytes
    """the payload as received: compact JSON, one line (what the coordinator logs)"""
    role: str | None = None
    """whose credential verified the MAC (``protocol.ROLES``), or None: no MAC, as no
    NANGUARD_TOKEN is configured on this side"""


_json_string = json.encoder.encode_basestring_ascii
"""a str as a JSON string (what json.dumps does to one, in C, without its dispatch)"""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class Codec:
    """Encodes and decodes the messages of one session; one per thread (``seq`` is its own).

    ``sender``: this session's name, unique per process and socket (messages to it must name it
    in ``to``). ``token``: NANGUARD_TOKEN, the ranks' credential, or None: then messages without
    a MAC are accepted. ``operator_token``: NANGUARD_OPERATOR_TOKEN, or None. A message is signed
    with the key of ``role`` (by default the operator's when this side holds one, else the
    ranks'), and a MAC is verified against every key held; ``max_bytes``: the largest payload
    ``decode`` accepts and ``encode`` produces (``status`` may always reach MAX_STATUS_BYTES);
    operator commands raise it to read a ``status`` of many ranks.
    """

    def __init__(self, sender: str, token: str | None = None, *, operator_token: str | None = None,
                 max_bytes: int = MAX_BYTES):
        if not isinstance(sender, str) or not 0 < len(sender) <= _MAX_SENDER or not sender.isprintable():
            raise ValueError(f"sender must be a string of 1 to {_MAX_SENDER} printable characters, got "
                             f"{_short(sender)}")
        if token and token == operator_token:
            raise ValueError("NANGUARD_OPERATOR_TOKEN must differ from NANGUARD_TOKEN: ranks hold the one, "
                             "only operators the other")
        self.sender = sender
        self.max_bytes = max_bytes
        # keyed once: a copy per message skips the key schedule (a stop to 1,024 ranks signs 1,024)
        self._signers = {role: hmac.new(key.encode(), digestmod=hashlib.sha256)
                         for role, key in zip(ROLES, (token, operator_token)) if key}
        self.role = "operator" if operator_token else "rank"
        """whose key signs by default"""
        self._seq = itertools.count(1)
        self.last_seq = 0
        """the seq of the last message encoded"""
        self._sender_json = json.dumps(sender)

    def holds(self, role: str) -> bool:
        """Whether this side holds the credential of ``role``."""
        return role in self._signers

    def encode(self, type_: str, body: dict[str, Any], *, to: str, role: str | None = None) -> list[bytes]:
        """Frames of one message to the session ``to`` ("" for a handshake only), signed as
        ``role``; ``body`` must already hold only JSON values (``json_float``)."""
        return self.encode_json(type_, json.dumps(body, separators=(",", ":"), allow_nan=False), to=to,
                                role=role)

    def encode_json(self, type_: str, body_json: str, *, to: str, role: str | None = None) -> list[bytes]:
        """As ``encode``, with the body already serialised: a sender that sends the same body to
        many peers (the coordinator's stop) serialises it once."""
        if type_ not in SCHEMAS:
            raise ValueError(f"unknown message type {type_!r}; known: {', '.join(TYPES)}")
        self.last_seq = next(self._seq)
        payload = (f'{{"v":{VERSION},"type":"{type_}","sender":{self._sender_json},'
                   f'"seq":{self.last_seq},"time":{time.time()!r},"to":{_json_string(to)},'
                   f'"body":{body_json}}}').encode()
        limit = MAX_STATUS_BYTES if type_ == "status" else self.max_bytes
        if len(payload) > limit:
            raise ProtocolError(f"a {type_} message of {len(payload)} bytes is over the limit of "
                                f"{limit}; it was not sent", reason="oversized")
        signer = self._signers.get(role or self.role)
        if signer is None:
            return [payload]
        mac = signer.copy()
        mac.update(payload)
        return [payload, mac.digest()]

    def decode(self, frames: Sequence[bytes]) -> Message:
        """Check and decode the frames of one message; raises ProtocolError (see ``protocol.WIRE_REASONS``)."""
        if len(frames) not in (1, 2):
            raise ProtocolError(f"a message has 1 or 2 frames (payload[, mac]), got {len(frames)}")
        payload = bytes(frames[0])
        if len(payload) > self.max_bytes:
            raise ProtocolError(f"payload of {len(payload)} bytes is over the limit of {self.max_bytes}",
                                reason="oversized")
        if not payload:
            raise ProtocolError("empty payload")
        role = self._authenticate(payload, frames)
        try:
            data = json.loads(payload, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise ProtocolError(f"payload is not JSON: {str(exc)[:100]}") from None
        if not isinstance(data, dict):
            raise ProtocolError(f"payload is not a JSON object but {type(data).__name__}")
        version = data.get("v")
        if version.__class__ is not int or version != VERSION:
            raise ProtocolError(f"protocol version {_short(version)} is not supported (this side "
                                f"speaks {VERSION})", reason="version")
        if data.keys() != _ENVELOPE:
            raise ProtocolError(f"envelope fields are {sorted(data)[:8]}, expected {sorted(_ENVELOPE)}")
        message = self._envelope(data, payload, role)
        if message.to != self.sender and not (message.to == "" and message.type == "handshake"):
            raise ProtocolError(f"a {message.type} message from {message.sender} is addressed to "
                                f"{_short(message.to) if message.to else 'nobody'}, not to {self.sender} "
                                "(an earlier instance, another coordinator or another process)",
                                reason="instance")
        return message

    @staticmethod
    def _envelope(data: dict[str, Any], payload: bytes, role: str | None) -> Message:
        type_, sender, seq, sent, to = data["type"], data["sender"], data["seq"], data["time"], data["to"]
        if not isinstance(type_, str):
            raise ProtocolError(f"message type {_short(type_)} is not a string")
        if not isinstance(sender, str) or not 0 < len(sender) <= _MAX_SENDER or not sender.isprintable():
            raise ProtocolError(f"sender {_short(sender)} is not a string of 1 to {_MAX_SENDER} printable "
                                "characters")
        if seq.__class__ is not int or not 0 <= seq <= _MAX_SEQ:
            raise ProtocolError(f"seq {_short(seq)} is not a non-negative integer")
        when = _finite(sent)
        if when is None:
            raise ProtocolError(f"time {_short(sent)} is not a finite number")
        if not isinstance(to, str) or len(to) > _MAX_SENDER or not to.isprintable():
            raise ProtocolError(f"to {_short(to)} is not a string of at most {_MAX_SENDER} printable "
                                "characters")
        body = check_body(type_, data["body"])
        return Message(type_, sender, seq, when, to, body, payload, role)

    def _authenticate(self, payload: bytes, frames: Sequence[bytes]) -> str | None:
        """The role whose key made the MAC, or None for no MAC where ranks need no token."""
        if len(frames) == 1:
            if "rank" in self._signers:
                raise ProtocolError("message has no MAC but a token is configured here "
                                    "(set the same NANGUARD_TOKEN on both sides)", reason="unauthenticated")
            return None
        if not self._signers:
            raise ProtocolError("message carries a MAC but no token is configured here "
                                "(set the same NANGUARD_TOKEN on both sides)", reason="unauthenticated")
        mac = bytes(frames[1])
        for role, signer in self._signers.items():
            expected = signer.copy()
            expected.update(payload)
            if hmac.compare_digest(expected.digest(), mac):
                return role
        raise ProtocolError("message MAC does not match (a different NANGUARD_TOKEN or "
                            "NANGUARD_OPERATOR_TOKEN, or a tampered message)", reason="unauthenticated")


class ReplayFilter:
    """Refuses a message seen before (seq not above the sender's last) or sent more than
    ``window_s`` away from ``now`` (clocks must agree that closely).

    Remembers the last seq of at most ``max_senders`` senders, forgetting the least recently
    heard first; a forgotten sender's old messages are still refused once they are stale.
    """

    def __init__(self, window_s: float = 300.0, max_senders: int = 65536):
        if not window_s > 0 or max_senders < 1:
            raise ValueError(f"window_s={window_s!r} and max_senders={max_senders!r} must be positive")
        self.window_s = window_s
        self.max_senders = max_senders
        self._last: OrderedDict[str, int] = OrderedDict()

    def check(self, message: Message, now: float) -> None:
        if abs(now - message.time) > self.window_s:
            raise ProtocolError(f"message from {message.sender} was sent {now - message.time:+.0f} s "
                                f"away from this clock (window {self.window_s:g} s)", reason="stale")
        last = self._last.get(message.sender)
        if last is not None:
            if message.seq <= last:
                raise ProtocolError(f"message {message.seq} from {message.sender} repeats or precedes "
                                    f"one already seen ({last})", reason="replayed")
            self._last.move_to_end(message.sender)
        elif len(self._last) >= self.max_senders:
            self._last.popitem(last=False)
        self._last[message.sender] = message.seq

    def __len__(self) -> int:
        return len(self._last)
