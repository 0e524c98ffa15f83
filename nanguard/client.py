"""The rank side of the coordinator link: one thread that owns the socket.

The training thread only puts into the ``Outbox`` (``send_event``) or stores values (``update``):
O(1), never blocking, never failing when the coordinator is down, late, gone or hostile. The
``nanguard-client`` thread connects a DEALER socket (ZeroMQ connects lazily and reconnects by
itself). On every new connection it sends a ``handshake``; the coordinator's ``welcome`` names
its instance, which every later message is addressed to, starting with this rank's ``hello``.
Then it sends the queued events in batches, a ``heartbeat`` every ``heartbeat_s``, and acks the
coordinator's ``stop`` commands, handing each new one to ``on_stop``. What the coordinator has not
said it ``received`` is sent again (outbox.py): a reset connection loses no event. A coordinator
that has not welcomed this rank for a few heartbeats (not running, another token or CurveZMQ key)
is said once, on the log, with the likely causes, and its return once more (``Silence``). A
welcomed connection that brings nothing back for a while is asked for an answer in the heartbeats,
and made again when none comes (``Hearing``, ``_LINK_DEAD_S``). Events that cannot be queued or
sent are dropped and counted; the count travels in heartbeats. Nothing a peer sends ends the
thread: a bad message is dropped (and logged, at most once a minute per kind), and an unexpected
error is logged with its traceback and the thread goes on. No torch, no prometheus_client.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import curve, relay as node_relay
from .errors import ProtocolError
from .events import Event
from .link import Admission, Closing, Hearing, Link, Silence, Target, check_identity
from .outbox import Numbered, Outbox
from .protocol import ACTIONS, STOP_REASONS, check_curve_key, parse_address
from ._throttle import Throttle
from .wire import MAX_FRAME_BYTES, Codec, wire_event

log = logging.getLogger("nanguard.client")

_POLL_S = 0.02
"""how long the thread sleeps between looks at the queue (the latency of an event, at most)"""
_BATCHES_PER_TURN = 8
"""event batches sent before the thread looks for stop commands again"""
_MAX_REMEMBERED_COMMANDS = 64
_WARN_EVERY_S = 60.0
_HANDSHAKE_EVERY_S = 1.0
"""how often an unanswered handshake is sent again (the welcome can be lost while reconnecting)"""
_SILENT_TURNS = 3
"""the link is said to be down after this many heartbeats (or handshakes, if longer) unanswered"""
_HELLO_AGAIN_S = 5.0
"""how often a hello the coordinator did not answer is sent again"""
_RETRY_SOCKET_S = 5.0
"""how long the thread waits before making a new socket after ZeroMQ failed on the last one"""
_LINK_DEAD_S = 15.0
"""a connection over which nothing came for this long (at least four heartbeats), though the
heartbeats asked for an answer, is closed and made again: after a partition TCP itself may wait
minutes to resend. (Not ZeroMQ's own pings: wire.py says why.)"""

OnStop = Callable[[str, str, str], None]


class _Sender:
    """What the client thread puts on the socket: handshakes until the coordinator welcomes this
    connection, then control messages first, a due heartbeat, and batches of queued events."""

    def __init__(self, outbox: Outbox, link: Link, identity: dict[str, Any], heartbeat_s: float,
                 warn: Callable[..., None]):
        self._outbox, self._link, self._identity = outbox, link, identity
        self.heartbeat_s = heartbeat_s
        self._warn = warn
        self.next_heartbeat = 0.0
        self.next_handshake = 0.0
        self.ask = False
        """the next heartbeats ask for an answer (nothing came from the coordinator for a while)"""

    def send(self, sock: zmq.Socket, now: float, connected: bool) -> bool:
        """Send what is due; True when nothing is left."""
        if not sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
            return self._outbox.empty()
        if self._link.instance is None:
            if connected and now >= self.next_handshake:
                self._frames(sock, self._link.handshake())
                self.next_handshake = now + _HANDSHAKE_EVERY_S
            return self._outbox.empty()
        control = self._outbox.control
        while control:
            type_, body = control[0]
            if not self._one(sock, type_, body):
                return False
            control.popleft()
        if now >= self.next_heartbeat:
            heartbeat = self._outbox.heartbeat()
            self._one(sock, "heartbeat", {**heartbeat, "answer": True} if self.ask else heartbeat)
            self.next_heartbeat = now + self.heartbeat_s
        self._outbox.send_again(now)
        for _ in range(_BATCHES_PER_TURN):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                return False  # ZeroMQ's buffer is full: the events wait in the queue
            batch = self._outbox.take_batch()
            if not batch:
                return self._outbox.empty()
            if not self._events(sock, batch, now):
                return False
        return False

    def _events(self, sock: zmq.Socket, batch: list[Numbered], now: float) -> bool:
        body = {"rank": self._identity["rank"], "job": self._identity["job"], "first": batch[0][0],
                "events": [wire_event(event.to_dict(compact=True)) for _, event, _ in batch], "action": batch[0][2]}
        try:
            frames = self._link.encode("events", body)
        except (TypeError, ValueError) as exc:  # over MAX_BYTES, or a value JSON cannot hold
            if len(batch) == 1:
                self._outbox.dropped_sent += 1  # (its number is a gap the coordinator passes over)
                self._warn("unsendable", f"nanguard: an event that cannot be sent to the coordinator "
                           f"was dropped ({exc}): {batch[0][1]}")
                return True
            half = len(batch) // 2  # halves until the culprit is alone
            return self._events(sock, batch[:half], now) and self._events(sock, batch[half:], now)
        if not self._frames(sock, frames):
            self._outbox.unsent(batch)
            return False
        self._outbox.sent(batch, now)
        return True

    def _one(self, sock: zmq.Socket, type_: str, body: dict[str, Any]) -> bool:
        """False when it could not be sent now; a message that cannot be encoded is dropped."""
        try:
            frames = self._link.encode(type_, body)
        except (TypeError, ValueError) as exc:
            self._warn(type_, f"nanguard: a {type_} message for the coordinator cannot be encoded "
                       f"({exc}); it is dropped")
            return True
        return self._frames(sock, frames)

    @staticmethod
    def _frames(sock: zmq.Socket, frames: list[bytes]) -> bool:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True


class _StopCommands:
    """The coordinator's stop commands: each is acked, first in line, every time it comes; a new one
    is handed to ``on_stop`` once (one sent again because the ack was late is not)."""

    def __init__(self, outbox: Outbox, rank: int, on_stop: OnStop | None):
        self._outbox, self._rank, self.on_stop = outbox, rank, on_stop
        self._delivered: deque[str] = deque(maxlen=_MAX_REMEMBERED_COMMANDS)

    def command(self, body: dict[str, Any]) -> None:
        command_id = body["command_id"]
        self._outbox.control.appendleft(("ack", {"rank": self._rank, "command_id": command_id}))
        if command_id in self._delivered:
            return
        self._delivered.append(command_id)
        if self.on_stop is not None:
            try:
                self.on_stop(command_id, body["reason"], body["origin"])
            except Exception:  # noqa: BLE001 - the user's callback must not end this thread
                log.exception("nanguard: on_stop raised for stop command %s; the client goes on", command_id)


class _Connection:
    """Whether this rank's socket reaches the coordinator (``connected``), and what follows when it
    comes up (first contact, a coordinator restarted, the network back: learn which instance is there
    before saying anything else) or goes down. Through a relay, its own link to the coordinator
    says so too (``relay.UP``, ``relay.DOWN``: handshakes go on, dropped by the relay while it is down)."""

    def __init__(self, route: Target, link: Link, sender: _Sender, hearing: Hearing, silence: Silence):
        self._route, self._link, self._sender, self._hearing, self._silence = route, link, sender, hearing, silence
        self.connected = False

    def new(self, now: float) -> None:
        """A new socket: nothing reached yet."""
        self.connected = False
        self._route.new_connection(now)
        self._down()

    def event(self, event: int) -> bool:
        """A socket monitor's ``event``; False for a failed handshake (CurveZMQ's)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
            self._route.connected()
            self._up()
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self._route.disconnected(time.monotonic())
            self._down()
        else:
            return False
        return True

    def relay_notice(self, frames: list[bytes]) -> bool:
        """Whether ``frames`` are the relay's notice of its own link (then taken into account)."""
        if len(frames) != 1 or frames[0] not in (node_relay.UP, node_relay.DOWN) or self._route.relay is None:
            return False
        self._up() if frames[0] == node_relay.UP else self._down()
        return True

    def _up(self) -> None:
        self._hearing.heard(time.monotonic())
        self._link.reset()
        self._sender.next_handshake = self._sender.next_heartbeat = 0.0

    def _down(self) -> None:
        self._link.reset()
        self._silence.down(time.monotonic())


class _Stalled(Exception):
    """The connection carried nothing back though asked, or the node's relay is not there: the
    client thread makes a new one (to the coordinator directly, after a relay)."""


def _dealer_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a coordinator that is not there
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.RCVHWM, 64)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)


class Client:
    """One rank's link to the coordinator at ``address``.

    ``identity``: this rank's ``hello`` body (``IDENTITY_FIELDS``). ``token``: NANGUARD_TOKEN, or
    None. ``curve_public_key``: the coordinator's CurveZMQ public key, or None for a plain link.
    ``queue_size``: events held while the thread catches up (or the coordinator is away); more are
    dropped and counted. ``on_stop(command_id, reason, origin)``: called on the client thread, once
    per stop command; keep it short (set a flag). ``relay``: the ``ipc://`` address of this node's
    relay (``relay.py``), tried first; None: the coordinator directly.
    """

    def __init__(self, address: str, *, token: str | None, identity: dict[str, Any],
                 queue_size: int = 1024, heartbeat_s: float = 2.0, on_stop: OnStop | None = None,
                 curve_public_key: str | None = None, context: zmq.Context | None = None,
                 relay: str | None = None):
        parse_address(address)  # ValueError: says what an address looks like
        check_identity(identity)
        if not (isinstance(queue_size, int) and queue_size > 0 and heartbeat_s > 0):
            raise ValueError(f"queue_size={queue_size!r} and heartbeat_s={heartbeat_s!r} must be positive")
        if curve_public_key is not None:
            check_curve_key(curve_public_key, "curve_public_key")
        if relay is not None and not relay.startswith("ipc://"):
            raise ValueError(f"relay={relay!r} must be an ipc:// address")
        self.address = address
        self.identity = dict(identity)
        self._context = context or zmq.Context.instance()
        self._curve_public_key = curve_public_key
        # the session name is unguessable and new for every process: a coordinator binds the rank
        # to it at hello, and nobody else can speak for this process
        self._link = Link(Codec(f"rank{identity['rank']}@{identity['host']}:{identity['pid']}:"
                                f"{secrets.token_hex(8)}", token))
        self._outbox = Outbox(self.identity, queue_size)
        self._sender = _Sender(self._outbox, self._link, self.identity, heartbeat_s, self._warn)
        self._stops = _StopCommands(self._outbox, self.identity["rank"], on_stop)
        self._welcomed = False
        """a coordinator welcomed this rank once (closing then waits for it to come back)"""
        self._silence = Silence(address, _SILENT_TURNS * max(heartbeat_s, _HANDSHAKE_EVERY_S), time.monotonic())
        self._hearing = Hearing(max(_LINK_DEAD_S, 4 * heartbeat_s))
        self._admission = Admission(address, _HELLO_AGAIN_S)
        self.route = Target(address, relay, time.monotonic())
        self._connection = _Connection(self.route, self._link, self._sender, self._hearing, self._silence)
        self._throttle = Throttle(_WARN_EVERY_S)
        self._stopping = threading.Event()
        self._closing: Closing | None = None
        self._thread: threading.Thread | None = None

    # --- training thread ------------------------------------------------------------------

    def start(self) -> None:
        """Start the client thread; returns at once, whether or not a coordinator is there."""
        if self._thread is not None:
            raise RuntimeError("client already started")
        self._thread = threading.Thread(target=self._run, name="nanguard-client", daemon=True)
        self._thread.start()

    def send_event(self, event: Event, action: str) -> bool:
        """Queue an event with what this rank does about it (raise, skip, warn; observe: nothing,
        an evaluation's). False when the queue is full: the event is dropped and counted."""
        if action not in ACTIONS:
            raise ValueError(f"action {action!r} is not one of {', '.join(ACTIONS)}")
        return self._outbox.put_event(event, action)

    def update(self, step: int, step_time_s: float | None, grad_norm: float | None) -> None:
        """The values the next heartbeat carries."""
        self._outbox.update(step, step_time_s, grad_norm)

    def captured(self, step: int, incident: str) -> None:
        """Tell the coordinator this rank wrote its state of ``step`` into ``incident``."""
        self._control_message("captured", {"step": step, "incident": incident})

    def stopped(self, step: int, reason: str) -> None:
        """Tell the coordinator this rank stopped at ``step`` (nonfinite, policy, operator)."""
        if reason not in STOP_REASONS:
            raise ValueError(f"stop reason {reason!r} is not one of {', '.join(STOP_REASONS)}")
        self._control_message("stopped", {"step": step, "reason": reason})

    @property
    def dropped(self) -> int:
        """Events dropped so far: queue full, or not sendable."""
        return self._outbox.dropped

    def close(self, timeout_s: float = 2.0, *, clean: bool = True) -> None:
        """Say ``bye``, send what can be sent within ``timeout_s``, stop the thread, close the
        socket. Returns within ``timeout_s`` (plus a little) whatever the coordinator does.

        ``clean=False``: the process ends by an error (an uncaught exception, or torn down after
        another rank failed); the coordinator then counts this rank as failed at once, never as
        finished.
        """
        thread = self._thread
        if thread is None or self._stopping.is_set():
            return
        self._closing = Closing(bool(clean), timeout_s)
        self._stopping.set()
        if thread is threading.current_thread():
            return  # from on_stop: the thread ends when the callback returns
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("nanguard client thread did not stop within %.1f s; it is a daemon thread "
                        "and ends with the process", timeout_s)

    def __enter__(self) -> Client:
        self.start()
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> None:
        self.close(clean=exc_type is None)

    def _control_message(self, type_: str, fields: dict[str, Any]) -> None:
        if not self._outbox.put_control(type_, fields):
            log.warning("nanguard: %d messages to the coordinator at %s wait unsent; this %s message "
                        "is dropped", len(self._outbox.control), self.address, type_)

    # --- client thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._session()
                return
            except _Stalled:
                if self.route.go_directly():
                    log.info("nanguard: this rank goes to the coordinator at %s directly: the node's relay"
                             " (local rank 0's) is not there or carries nothing", self.address)
                continue  # a new connection at once
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM or self._stopping.is_set():
                    return
                log.error("nanguard client for %s: ZeroMQ failed (%s); a new socket in %.0f s (training "
                          "goes on, guarded locally)", self.address, exc, _RETRY_SOCKET_S)
                if self._stopping.wait(_RETRY_SOCKET_S):
                    return

    def _session(self) -> None:
        """One socket, from connect until the client closes (or ZeroMQ fails: ZMQError)."""
        sock = self._context.socket(zmq.DEALER)
        monitor = None
        self._connection.new(time.monotonic())
        try:
            _dealer_options(sock)
            if self.route.relay is not None:  # (a relay on this node that is not up yet: no back-off)
                sock.setsockopt(zmq.RECONNECT_IVL, 20)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
            if self._curve_public_key is not None and self.route.relay is None:  # (the relay's own link is)
                curve.connect(sock, self._curve_public_key)
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            sock.connect(self.route.address)
            self._loop(sock, monitor)
        finally:
            linger_s = max(0.0, self._closing.deadline - time.monotonic()) if self._stopping.is_set() else 0
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=int(min(linger_s, 1.0) * 1000))

    def _loop(self, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(_POLL_S * 1000))
            try:
                done = self._turn(sock, monitor, ready)
            except (zmq.ZMQError, _Stalled):
                raise
            except Exception:  # noqa: BLE001 - a bug (or a peer finding one) must not end the link
                self._warn("internal", "nanguard: the coordinator link failed on a turn; it goes on",
                           exc_info=True)
                done = False
            if not self._stopping.is_set():
                continue
            # a coordinator never reached is not waited for; one that was may be back in a moment, and
            # so may the node's relay (local rank 0 binds it as the others connect: a short job ends first)
            step = self._closing.next(self._outbox, done, reachable=self._connection.connected or self._welcomed
                                      or self.route.relay is not None)
            if step is not None:
                self._drop_unsent()
                if step == "end":
                    return
                self._outbox.goodbye(self._closing.clean)

    def _turn(self, sock: zmq.Socket, monitor: zmq.Socket, ready: dict) -> bool:
        """Read what arrived, send what is due; True when nothing is left to send."""
        now = time.time()
        if monitor in ready:
            while monitor.poll(0):
                if not self._connection.event(recv_monitor_message(monitor)["event"]):
                    self._warn("curve", f"nanguard: the connection to the coordinator at {self.address} failed "
                               "its handshake: does NANGUARD_CURVE_PUBLIC_KEY match the coordinator's key (and "
                               "does it use CurveZMQ at all)?")
        if sock in ready:
            self._receive(sock, now)
        if not self._stopping.is_set():
            self._check_link(time.monotonic())
        return self._sender.send(sock, now, self._connection.connected)

    def _check_link(self, now: float) -> None:
        """Warn of a coordinator that does not answer; ask a welcomed connection that has carried
        nothing back for a while for an answer, and give it up (_Stalled) when none comes."""
        connected = self._connection.connected
        if self.route.relay_absent(now, connected):
            raise _Stalled
        if said := self._silence.check(now, connected):
            log.warning("%s", said)
        live = connected and self._link.instance is not None
        self._sender.ask = live and self._hearing.ask(now)
        again, said = self._admission.again(now) if live else (False, None)
        if again:
            self._outbox.control.appendleft(("hello", self.identity))
        if said:
            log.warning("%s", said)
        if live and self._hearing.dead(now):
            log.info("nanguard: nothing came from the coordinator at %s for %.0f s though this rank asked; "
                     "the connection is made again", self.address, self._hearing.quiet_s(now))
            raise _Stalled

    def _receive(self, sock: zmq.Socket, now: float) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if self._connection.relay_notice(frames):
                continue
            try:
                message = self._link.read(frames, now)
            except ProtocolError as exc:
                self._warn(exc.reason, f"nanguard: dropped a bad message from the coordinator at "
                           f"{self.address}: {exc}")
                continue
            self._hearing.heard(time.monotonic())
            if message.type == "welcome":
                self._welcomed = True
                if said := self._silence.up(time.monotonic()):
                    log.warning("%s", said)
                # introduce this rank to the instance, first in line; then what this rank sent and
                # was not received (ZeroMQ dropped what it held for the last connection)
                self._outbox.control.appendleft(("hello", self.identity))
                self._admission.asked(time.monotonic())
                self._outbox.send_again()
                self._sender.next_heartbeat = 0.0
            elif message.type == "received":
                if said := self._admission.answered(time.monotonic()):
                    log.warning("%s", said)
                self._outbox.received(message.body["events"], now)
            else:
                self._stops.command(message.body)

    def _drop_unsent(self) -> None:
        events, others = self._outbox.drop_unsent()
        if events or others:
            log.warning("nanguard: closing with %d event(s) and %d other message(s) not sent to (or not "
                        "received by) the coordinator at %s; the events are counted as dropped",
                        events, others, self.address)

    def _warn(self, key: str, text: str, *, exc_info: bool = False) -> None:
        if self._throttle.allow(key)[0]:
            log.warning("%s", text, exc_info=exc_info)
