"""Coordinator: one thread owns the ROUTER socket; ranks and operators talk to it over ZeroMQ.

    rank -> coordinator       hello, heartbeat, events, captured, stopped, ack, bye
    coordinator -> rank       stop
    operator -> coordinator   status_request, stop_request
    coordinator -> operator   status, stop_accepted

The loop decodes each message (``wire.Codec``), refuses replays, and hands it to the handler of
its type; the rank table (``ranks.py``) keeps who is there, the stop fan-out (``stop.py``) the
job's stop command, the policy (``policy.py``) decides when to stop. Every accepted message is
appended, as received, to the event log (``eventlog.py``). Bad messages are counted and dropped:
nothing a client sends can crash the loop or stop a job.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from .. import __version__
from ..errors import ProtocolError
from ..wire import MAX_BYTES, Codec, Message, ReplayFilter
from .clock import Instant, require_positive
from .eventlog import EventLog
from .metrics import Metrics
from .policy import Policy
from .ranks import REGISTERING, Admission, RankState, RankTable
from .stop import StopCommand, StopFanout

log = logging.getLogger("nanguard.coordinator")

_DRAIN = 256
"""messages handled between two looks at the clock-driven work (timers, log flush)"""
_RCVHWM = 4
_TICK_S = 0.5
"""how often liveness is recomputed"""
_BAD_LOG_S = 10.0
"""at most one log line per bad-message reason this often (a flood must not flood the log)"""


class Coordinator:
    """The daemon: its socket loop and the parts the messages go to.

    ``bind``: a ZeroMQ address (``tcp://127.0.0.1:0`` picks a free port; see ``address``).
    ``token``: the shared secret, or None. ``job``: pins the job id (else the first rank's job
    is taken, and a new job may start once every rank of the last one is dead or finished).
    ``dead_after_s``: silence after which a rank counts as dead; ``stall_after_s``: time without
    a new step after which an alive rank counts as stalled; ``resend_s``: how often an unacked
    stop command is sent again.
    """

    def __init__(self, bind: str, *, token: str | None, registry: CollectorRegistry, log_path: str,
                 policy: Policy | None = None, job: str | None = None, dead_after_s: float = 15.0,
                 stall_after_s: float = 300.0, resend_s: float = 0.2,
                 context: zmq.Context | None = None):
        # checked before the metrics exist: a refused coordinator leaves the registry empty
        require_positive(dead_after_s=dead_after_s, stall_after_s=stall_after_s, resend_s=resend_s)
        self.bind = bind
        self.metrics = Metrics(registry, __version__)
        self.policy = policy or Policy()
        self.log_path = log_path
        self.address: str | None = None
        """the bound address, with the real port, once started"""
        self._context = context or zmq.Context.instance()
        self._codec = Codec(f"coordinator@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}",
                            token)
        self._replay = ReplayFilter()
        self._ranks = RankTable(self.metrics, job=job, dead_after_s=dead_after_s,
                                stall_after_s=stall_after_s)
        self._stops = StopFanout(self._ranks, self.metrics, self._codec.encode, self._send_to_each,
                                 resend_s=resend_s)
        self._next_tick = 0.0
        """monotonic time of the next liveness tick"""
        self._bad = _BadMessages(self.metrics)
        self._socket: zmq.Socket | None = None
        self._log: EventLog | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._handlers = {
            "hello": self._on_hello, "heartbeat": self._on_heartbeat, "events": self._on_events,
            "captured": self._on_captured, "stopped": self._on_stopped, "ack": self._on_ack,
            "bye": self._on_bye, "status_request": self._on_status_request,
            "stop_request": self._on_stop_request,
        }

    # --- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Open the log, bind the socket (errors are raised here) and start the loop thread."""
        if self._thread is not None:
            raise RuntimeError("coordinator already started")
        self._log = EventLog(self.log_path)
        try:
            self._socket, self.address = _router(self._context, self.bind)
        except OSError:
            self._log.close()
            raise
        self._thread = threading.Thread(target=self._run, name="nanguard-coordinator", daemon=True)
        self._thread.start()
        log.info("listening on %s, job %s, logging to %s", self.address,
                 self._ranks.job or "(first seen)", self.log_path)

    def shutdown(self) -> None:
        """Ask the loop to end (safe from a signal handler); ``serve_forever`` then returns."""
        self._closing.set()

    def serve_forever(self) -> None:
        """Start (if needed) and run until ``shutdown()`` or ``close()``; then close."""
        if self._thread is None:
            self.start()
        while not self._closing.wait(0.5):
            if not self._thread.is_alive():
                break
        self.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop, close the socket, flush and fsync the log. Idempotent."""
        self._closing.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.error("coordinator loop did not stop within %.1f s; its socket and log are "
                          "left to the process exit", timeout_s)

    def _run(self) -> None:
        sock = self._socket
        try:
            self._loop(sock)
        finally:
            sock.close(linger=0)
            self._log.close()
            log.info("stopped; log %s synced", self.log_path)

    def _loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._closing.is_set():
            wait_s = min(self._next_tick, self._stops.next_resend) - time.monotonic()
            if poller.poll(max(0.0, min(_TICK_S, wait_s)) * 1000):
                for _ in range(_DRAIN):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames, Instant.now())
                self._log.end_batch()
            at = Instant.now()
            self._stops.resend_due(at)
            if at.mono >= self._next_tick:
                self._ranks.tick(at)
                self._next_tick = at.mono + _TICK_S

    # --- messages -------------------------------------------------------------------------

    def _handle(self, frames: list[bytes], at: Instant) -> None:
        identity = frames[0]
        try:
            message = self._codec.decode(frames[1:])
            self._replay.check(message, at.wall)
        except ProtocolError as exc:
            self._bad(exc.reason, identity, str(exc), at)
            return
        try:
            if self._dispatch(message, identity, at) is False:
                return
        except Exception:  # noqa: BLE001 - a bug here must cost one message, not the daemon
            log.exception("internal error handling a %s message from %s; message dropped, "
                          "coordinator goes on", message.type, message.sender)
            return
        self._log.append(at.wall, message.payload)

    def _dispatch(self, message: Message, identity: bytes, at: Instant) -> bool | None:
        """Run the message's handler; False: the message was refused (and counted)."""
        handler = self._handlers.get(message.type)
        if handler is None:
            self._bad("unexpected", identity, f"a {message.type} message does not travel to the coordinator",
                      at)
            return False
        body = message.body
        if message.type not in REGISTERING:
            return handler(None, body, identity, at)
        admission = self._ranks.admit(body["job"])
        if admission is Admission.REFUSED:
            self._bad("wrong_job", identity, f"message of job {body['job']!r}, but this coordinator serves "
                      f"job {self._ranks.job!r} and it still has ranks alive", at)
            return False
        if admission is Admission.NEW_JOB:
            self._stops.reset()
            self.policy.reset()
        state, registered = self._ranks.seen(body["rank"], identity, at)
        if registered:
            self._stops.registered(state, at)
        return handler(state, body, identity, at)

    # A handler gets the sender's RankState when its type is in REGISTERING (the job is
    # admitted and the rank registered before), else None; False refuses a message.

    def _on_hello(self, state: RankState, body: dict[str, Any], identity: bytes, at: Instant) -> None:
        self._ranks.hello(state, body)

    def _on_heartbeat(self, state: RankState, body: dict[str, Any], identity: bytes, at: Instant) -> None:
        self._ranks.heartbeat(state, body, at)

    def _on_events(self, state: RankState, body: dict[str, Any], identity: bytes, at: Instant) -> None:
        events = body["events"]
        state.events += len(events)
        kinds = Counter(map(itemgetter("kind"), events))
        self.metrics.events({(kind, state.rank): count for kind, count in kinds.items()})
        if self._stops.command is None and not self.policy.stop_kinds.isdisjoint(kinds):
            action = body.get("action")
            for event in events:
                decision = self.policy.observe(event["kind"], event["rank"], event["step"],
                                               event["layer"], action, at.wall)
                if decision is not None:
                    self._begin_stop("policy", decision.reason, decision.label, at)
                    break

    def _on_captured(self, state: RankState, body: dict[str, Any], identity: bytes, at: Instant) -> None:
        self.metrics.incident(body["incident"])
        log.info("rank %d captured step %d into %s", state.rank, body["step"], body["incident"])

    def _on_stopped(self, state: RankState, body: dict[str, Any], identity: bytes, at: Instant) -> None:
        log.info("rank %d stopped at step %d (%s)", state.rank, body["step"], body["reason"])
        if self._stops.command is None:
            # the ranks decided (on a non-finite value, usually): tell every other rank too
            origin = "operator" if body["reason"] == "operator" else "policy"
            self._begin_stop(origin, f"rank {state.rank} stopped at step {body['step']} "
                             f"({body['reason']})", body["reason"], at)

    def _on_ack(self, state: None, body: dict[str, Any], identity: bytes, at: Instant) -> None:
        if body["rank"] in self._ranks:  # else an ack to a coordinator before a restart
            self._ranks.seen(body["rank"], identity, at)
            self._stops.ack(body["rank"], body["command_id"])

    def _on_bye(self, state: None, body: dict[str, Any], identity: bytes, at: Instant) -> bool:
        if body["job"] != self._ranks.job:
            self._bad("wrong_job", identity, f"bye from rank {body['rank']} of job {body['job']!r}, "
                      f"but this coordinator serves job {self._ranks.job!r}", at)
            return False
        self._ranks.bye(body["rank"], identity, at)
        return True

    def _on_status_request(self, state: None, body: dict[str, Any], identity: bytes, at: Instant) -> None:
        self._reply(identity, "status", {"job": self._ranks.job, "ranks": self._ranks.status(),
                                         "stop": self._stops.status()})

    def _on_stop_request(self, state: None, body: dict[str, Any], identity: bytes, at: Instant) -> None:
        command, made = self._begin_stop("operator", body["reason"], "operator", at)
        self._reply(identity, "stop_accepted", {"command_id": command.command_id, "existing": not made})

    def _begin_stop(self, origin: str, reason: str, label: str, at: Instant) -> tuple[StopCommand, bool]:
        command, made = self._stops.begin(origin, reason, label, at)
        if made:
            self._log.sync_soon()
        return command, made

    # --- sending (coordinator -> rank, coordinator -> operator) -----------------------------

    def _reply(self, identity: bytes, type_: str, body: dict[str, Any]) -> None:
        try:
            frames = self._codec.encode(type_, body)
        except ProtocolError as exc:
            log.error("cannot answer a %s request: %s", type_, exc)
            return
        self._send_to_each([identity], frames)

    def _send_to_each(self, routing_ids: Sequence[bytes], frames: list[bytes]) -> None:
        # the fan-out's cost is this loop: plain sends, no list per rank (send_multipart's)
        send, more = self._socket.send, zmq.SNDMORE
        *head, last = frames
        for routing_id in routing_ids:
            send(routing_id, more)
            for frame in head:
                send(frame, more)
            send(last)


def _router(context: zmq.Context, bind: str) -> tuple[zmq.Socket, str]:
    """The coordinator's ROUTER socket bound to ``bind``, and the address it got."""
    sock = context.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # a frame above this never reaches Python (ZeroMQ drops the connection); frames
        # between MAX_BYTES and this are read and counted as oversized
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_BYTES)
        # messages held per rank before TCP pushes back on it: bounds memory when many
        # ranks flood at once (the ranks' own queues then fill and count what they drop)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(bind)
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise OSError(f"coordinator cannot bind {bind}: {exc}; nothing was started") from exc


class _BadMessages:
    """Counts every dropped message and logs why, at most once per reason each ``_BAD_LOG_S``
    (a flood of bad messages must not flood the log too)."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics
        self._logged_at: dict[str, float] = {}
        """reason -> monotonic time of its last log line"""
        self._unlogged: dict[str, int] = {}

    def __call__(self, reason: str, identity: bytes, text: str, at: Instant) -> None:
        self._metrics.bad_message(reason)
        if reason in self._logged_at and at.mono - self._logged_at[reason] < _BAD_LOG_S:
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            return
        more = self._unlogged.pop(reason, 0)
        log.warning("dropped a bad message (%s) from peer %s: %s%s", reason, identity.hex()[:16], text,
                    f" (and {more} more {reason} since the last such line)" if more else "")
        self._logged_at[reason] = at.mono
