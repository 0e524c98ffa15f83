"""One operator request to the coordinator and its reply: what ``nanguard status`` and
``nanguard stop`` send."""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Any

import zmq

from ..errors import CoordinatorUnreachable, ProtocolError
from ..protocol import parse_address
from ..wire import MAX_STATUS_BYTES, Codec, Message

REPLIES = {"status_request": "status", "stop_request": "stop_accepted"}


def request(address: str, token: str | None, type_: str, body: dict[str, Any], *,
            timeout_s: float = 5.0, context: zmq.Context | None = None) -> Message:
    """Send one ``status_request`` or ``stop_request`` to ``address``; return the reply.

    Raises CoordinatorUnreachable when nothing valid comes back within ``timeout_s`` (the
    coordinator drops a request whose MAC does not match, so a wrong token looks the same).
    """
    if type_ not in REPLIES:
        raise ValueError(f"{type_!r} is not an operator request; one of {', '.join(REPLIES)}")
    parse_address(address)  # ValueError: says what an address looks like
    codec = Codec(f"operator@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}", token,
                  max_bytes=MAX_STATUS_BYTES)
    frames = codec.encode(type_, body)
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_STATUS_BYTES + 1024)
        sock.connect(address)
        # without IMMEDIATE the message waits in the socket until the connection is up
        sock.send_multipart(frames, zmq.NOBLOCK)
        deadline = time.monotonic() + timeout_s
        problem = ""
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(left * 1000):
                break
            try:
                reply = codec.decode(sock.recv_multipart())
            except ProtocolError as exc:
                problem = f"; a reply was refused: {exc}"
                continue
            if reply.type == REPLIES[type_]:
                return reply
            problem = f"; got an unexpected {reply.type} message"
    except zmq.ZMQError as exc:
        raise CoordinatorUnreachable(f"cannot reach the coordinator at {address}: {exc}") from None
    finally:
        sock.close(linger=0)
    raise CoordinatorUnreachable(
        f"no answer from the coordinator at {address} within {timeout_s:g} s{problem}: is it running "
        "there, and does NANGUARD_TOKEN match its token?")
