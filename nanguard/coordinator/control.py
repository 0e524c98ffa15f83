"""One operator request to the coordinator and its reply: what ``nanguard status``, ``nanguard stop``
and ``nanguard clear`` send.

    operator -> coordinator   handshake        coordinator -> operator   welcome
    operator -> coordinator   status_request   coordinator -> operator   status
                              stop_request                               stop_accepted | refused
                              clear_request                              cleared | refused

The handshake learns the coordinator's instance id; the request is addressed to it, so a captured
request is refused by any other coordinator and by this one after a restart. Signed with
NANGUARD_OPERATOR_TOKEN when the operator holds it (a stop or a clear needs it), else with NANGUARD_TOKEN.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Any

import zmq

from .. import curve
from ..errors import CoordinatorUnreachable, ProtocolError, RequestRefused
from ..protocol import parse_address
from ..wire import MAX_STATUS_BYTES, Codec, Message

REPLIES = {"status_request": "status", "stop_request": "stop_accepted", "clear_request": "cleared"}
MAX_TIMEOUT_S = 86400.0
"""the longest an operator request waits for its answer: a day"""


def check_timeout(value: object, name: str) -> float:
    """``value`` when it is a positive finite number of seconds up to MAX_TIMEOUT_S; else
    ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be a positive finite number of seconds (at most {MAX_TIMEOUT_S:g}), "
                         f"got {value!r}; nothing was sent")
    return float(value)


def request(address: str, token: str | None, type_: str, body: dict[str, Any], *,
            operator_token: str | None = None, curve_public_key: str | None = None,
            timeout_s: float = 5.0, context: zmq.Context | None = None) -> Message:
    """Send one operator request (``REPLIES``) to ``address``; return the reply.

    Raises RequestRefused when the coordinator refuses it (a stop or a clear without the operator
    token), and
    CoordinatorUnreachable when nothing valid comes back within ``timeout_s`` (the coordinator
    drops a request whose MAC does not match, so a wrong token looks the same).
    """
    if type_ not in REPLIES:
        raise ValueError(f"{type_!r} is not an operator request; one of {', '.join(REPLIES)}")
    parse_address(address)  # ValueError: says what an address looks like
    timeout_s = check_timeout(timeout_s, "timeout_s")
    # the operator's key alone when it has one: what it signs is then an operator's request
    codec = Codec(f"operator@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(8)}",
                  None if operator_token else token, operator_token=operator_token, max_bytes=MAX_STATUS_BYTES)
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    deadline = time.monotonic() + timeout_s
    problem = ""
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_STATUS_BYTES + 1024)
        if curve_public_key is not None:
            curve.connect(sock, curve_public_key)
        sock.connect(address)
        # without IMMEDIATE the message waits in the socket until the connection is up
        handshake = codec.encode("handshake", {}, to="")
        sock.send_multipart(handshake, zmq.NOBLOCK)
        welcome, problem = _reply(sock, codec, "welcome", deadline)
        if welcome is not None:
            sock.send_multipart(codec.encode(type_, body, to=welcome.sender), zmq.NOBLOCK)
            reply, problem = _reply(sock, codec, REPLIES[type_], deadline)
            if reply is not None:
                return reply
    except zmq.ZMQError as exc:
        raise CoordinatorUnreachable(f"cannot reach the coordinator at {address}: {exc}") from None
    finally:
        sock.close(linger=0)
    raise CoordinatorUnreachable(
        f"no answer from the coordinator at {address} within {timeout_s:g} s{problem}: is it running "
        "there, and do NANGUARD_TOKEN / NANGUARD_OPERATOR_TOKEN (and NANGUARD_CURVE_PUBLIC_KEY) match its own?")


def _reply(sock: zmq.Socket, codec: Codec, expected: str, deadline: float) -> tuple[Message | None, str]:
    """The next valid ``expected`` message before ``deadline``, or None and what went wrong."""
    problem = ""
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(left * 1000):
            break
        try:
            reply = codec.decode(sock.recv_multipart())
        except ProtocolError as exc:
            problem = f"; a reply was refused: {exc}"
            continue
        if reply.type == "refused":
            raise RequestRefused(f"the coordinator refused the request: {reply.body['reason']}")
        if reply.type == expected:
            return reply, ""
        problem = f"; got an unexpected {reply.type} message"
    return None, problem
