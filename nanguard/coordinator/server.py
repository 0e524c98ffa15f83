"""Coordinator: one thread owns the ROUTER socket; ranks and operators talk to it over ZeroMQ.

Per-rank state is kept by rank number. A rank is registered by any message that names its job
(``hello``, but also ``heartbeat`` or ``events``: after a coordinator restart, ranks do not say
hello again). Every accepted message is appended, as received, to the event log
(``eventlog.py``).

A stop (from the policy, an operator, or a rank's ``stopped`` report) becomes one command per
job, sent to every registered rank that has not said ``bye``, again every ``resend_s`` until the
rank acks it; ranks registering later get it too. Bad messages are counted and dropped: nothing
a client sends can crash the loop or stop a job.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from .. import __version__
from ..errors import ProtocolError
from ..events import json_float
from ..wire import MAX_BYTES, Codec, ReplayFilter
from .eventlog import EventLog
from .metrics import Metrics
from .policy import Policy

log = logging.getLogger("nanguard.coordinator")

_DRAIN = 256
"""messages handled between two looks at the clock-driven work (timers, log flush)"""
_RCVHWM = 4
_TICK_S = 0.5
"""how often liveness is recomputed"""
_REGISTERING = frozenset(("hello", "heartbeat", "events", "captured", "stopped"))
"""message types that name a job and register their rank"""
_BAD_LOG_S = 10.0
"""at most one log line per bad-message reason this often (a flood must not flood the log)"""


@dataclass(slots=True)
class RankState:
    rank: int
    routing_id: bytes
    host: str = ""
    pid: int | None = None
    world_size: int | None = None
    step: int | None = None
    step_time_s: float | None = None
    grad_norm: float | None = None
    last_seen: float = 0.0
    step_changed_at: float = 0.0
    alive: bool = True
    stalled: bool = False
    finished: bool = False
    events: int = 0
    dropped: int = 0

    def status(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "world_size": self.world_size,
                "step": self.step, "step_time_s": self.step_time_s,
                "grad_norm": json_float(self.grad_norm), "last_seen": self.last_seen,
                "alive": self.alive, "stalled": self.stalled, "finished": self.finished,
                "events": self.events, "dropped": self.dropped}


@dataclass(slots=True)
class StopCommand:
    command_id: str
    origin: str
    """policy | operator"""
    reason: str
    time: float
    acked: set[int] = field(default_factory=set)

    def status(self) -> dict[str, Any]:
        return {"command_id": self.command_id, "origin": self.origin, "reason": self.reason,
                "time": self.time, "acked": sorted(self.acked)}


class Coordinator:
    """The daemon's state and its socket loop.

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
        for name, value in (("dead_after_s", dead_after_s), ("stall_after_s", stall_after_s),
                            ("resend_s", resend_s)):
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be a positive number of seconds")
        self.bind = bind
        self.metrics = Metrics(registry, __version__)
        self.policy = policy or Policy()
        self.log_path = log_path
        self.dead_after_s = dead_after_s
        self.stall_after_s = stall_after_s
        self.resend_s = resend_s
        self.address: str | None = None
        """the bound address, with the real port, once started"""
        self._context = context or zmq.Context.instance()
        self._codec = Codec(f"coordinator@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}",
                            token)
        self._replay = ReplayFilter()
        self._job = job
        self._job_pinned = job is not None
        self._ranks: dict[int, RankState] = {}
        self._stop: StopCommand | None = None
        self._next_resend = math.inf
        """when unacked stop commands are sent again (inf: none pending)"""
        self._next_tick = 0.0
        self._bad_logged_at: dict[str, float] = {}
        self._bad_unlogged: dict[str, int] = {}
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
        sock = self._context.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # a frame above this never reaches Python (ZeroMQ drops the connection); frames
            # between MAX_BYTES and this are read and counted as oversized
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_BYTES)
            # messages held per rank before TCP pushes back on it: bounds memory when many
            # ranks flood at once (the ranks' own queues then fill and count what they drop)
            sock.setsockopt(zmq.RCVHWM, _RCVHWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(self.bind)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._log.close()
            raise OSError(f"coordinator cannot bind {self.bind}: {exc}; nothing was started") from exc
        self._socket = sock
        self._thread = threading.Thread(target=self._run, name="nanguard-coordinator", daemon=True)
        self._thread.start()
        log.info("listening on %s, job %s, logging to %s", self.address, self._job or "(first seen)",
                 self.log_path)

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
            wait_s = min(self._next_tick, self._next_resend) - time.time()
            if poller.poll(max(0.0, min(_TICK_S, wait_s)) * 1000):
                for _ in range(_DRAIN):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames, time.time())
                self._log.end_batch()
            now = time.time()
            if now >= self._next_resend:
                self._resend(now)
            if now >= self._next_tick:
                self._tick(now)

    # --- messages -------------------------------------------------------------------------

    def _handle(self, frames: list[bytes], now: float) -> None:
        identity = frames[0]
        try:
            message = self._codec.decode(frames[1:])
            self._replay.check(message, now)
        except ProtocolError as exc:
            self._bad(exc.reason, identity, str(exc), now)
            return
        handler = self._handlers.get(message.type)
        if handler is None:
            self._bad("unexpected", identity, f"a {message.type} message does not travel to the coordinator",
                      now)
            return
        body = message.body
        try:
            if message.type in _REGISTERING:
                if not self._accept_job(body["job"], identity, now):
                    return
                handler(self._rank(body, identity, now), body, identity, now)
            elif handler(None, body, identity, now) is False:
                return
        except Exception:  # noqa: BLE001 - a bug here must cost one message, not the daemon
            log.exception("internal error handling a %s message from %s; message dropped, "
                          "coordinator goes on", message.type, message.sender)
            return
        self._log.append(now, message.payload)

    def _bad(self, reason: str, identity: bytes, text: str, now: float) -> None:
        self.metrics.bad_message(reason)
        if now - self._bad_logged_at.get(reason, 0.0) < _BAD_LOG_S:
            self._bad_unlogged[reason] = self._bad_unlogged.get(reason, 0) + 1
            return
        more = self._bad_unlogged.pop(reason, 0)
        log.warning("dropped a bad message (%s) from peer %s: %s%s", reason, identity.hex()[:16], text,
                    f" (and {more} more {reason} since the last such line)" if more else "")
        self._bad_logged_at[reason] = now

    def _accept_job(self, job: str, identity: bytes, now: float) -> bool:
        if self._job is None:
            self._job = job
            log.info("job %s", job)
            return True
        if job == self._job:
            return True
        if not self._job_pinned and all(r.finished or not r.alive for r in self._ranks.values()):
            self._new_job(job)
            return True
        self._bad("wrong_job", identity, f"message of job {job!r}, but this coordinator serves job "
                  f"{self._job!r} and it still has ranks alive", now)
        return False

    def _new_job(self, job: str) -> None:
        log.info("job %s ended (every rank dead or finished); job %s starts", self._job, job)
        self.metrics.new_job(list(self._ranks))
        self._ranks.clear()
        self._stop = None
        self._next_resend = math.inf
        self.policy.reset()
        self._job = job

    def _rank(self, body: dict[str, Any], identity: bytes, now: float) -> RankState:
        """The state of the message's rank, registered now if new; marks it seen."""
        number = body["rank"]
        state = self._ranks.get(number)
        if state is None:
            state = self._ranks[number] = RankState(number, identity, step_changed_at=now)
            log.info("rank %d registered (%d known)", number, len(self._ranks))
            if self._stop is not None:
                self._send_stop([state], now)
        elif not state.alive and not state.finished:
            log.info("rank %d is back after %.0f s of silence", number, now - state.last_seen)
        state.routing_id = identity
        state.last_seen = now
        state.alive = True
        self.metrics.rank(number, last_seen=now)
        return state

    # A handler gets the sender's RankState when its type is in _REGISTERING (the job is
    # checked and the rank registered before), else None; False refuses a message.

    def _on_hello(self, state: RankState, body: dict[str, Any], identity: bytes, now: float) -> None:
        state.host, state.pid, state.world_size = body["host"], body["pid"], body["world_size"]
        state.finished = False

    def _on_heartbeat(self, state: RankState, body: dict[str, Any], identity: bytes, now: float) -> None:
        self._on_hello(state, body, identity, now)
        if body["step"] != state.step:
            state.step, state.step_changed_at = body["step"], now
        state.step_time_s, state.grad_norm = body["step_time_s"], body["grad_norm"]
        state.dropped = body["dropped"]
        self.metrics.rank(state.rank, last_seen=now, step=state.step, step_time_s=state.step_time_s,
                          grad_norm=state.grad_norm)
        self.metrics.dropped(state.rank, state.dropped)

    def _on_events(self, state: RankState, body: dict[str, Any], identity: bytes, now: float) -> None:
        events = body["events"]
        state.events += len(events)
        kinds = Counter(map(itemgetter("kind"), events))
        self.metrics.events({(kind, state.rank): count for kind, count in kinds.items()})
        if self._stop is None and not self.policy.stop_kinds.isdisjoint(kinds):
            action = body.get("action")
            for event in events:
                decision = self.policy.observe(event["kind"], event["rank"], event["step"],
                                               event["layer"], action, now)
                if decision is not None:
                    self._begin_stop("policy", decision.reason, decision.label, now)
                    break

    def _on_captured(self, state: RankState, body: dict[str, Any], identity: bytes, now: float) -> None:
        self.metrics.incident(body["incident"])
        log.info("rank %d captured step %d into %s", state.rank, body["step"], body["incident"])

    def _on_stopped(self, state: RankState, body: dict[str, Any], identity: bytes, now: float) -> None:
        log.info("rank %d stopped at step %d (%s)", state.rank, body["step"], body["reason"])
        if self._stop is None:
            # the ranks decided (on a non-finite value, usually): tell every other rank too
            origin = "operator" if body["reason"] == "operator" else "policy"
            self._begin_stop(origin, f"rank {state.rank} stopped at step {body['step']} "
                             f"({body['reason']})", body["reason"], now)

    def _on_ack(self, state: None, body: dict[str, Any], identity: bytes, now: float) -> None:
        if body["rank"] in self._ranks:  # else an ack to a coordinator before a restart
            self._rank(body, identity, now)
            if self._stop is not None and body["command_id"] == self._stop.command_id:
                self._stop.acked.add(body["rank"])

    def _on_bye(self, state: None, body: dict[str, Any], identity: bytes, now: float) -> bool:
        if body["job"] != self._job:
            self._bad("wrong_job", identity, f"bye from rank {body['rank']} of job {body['job']!r}, "
                      f"but this coordinator serves job {self._job!r}", now)
            return False
        if body["rank"] in self._ranks:  # else a rank this coordinator never heard before
            state = self._rank(body, identity, now)
            state.finished, state.alive = True, False
            log.info("rank %d finished", state.rank)
        return True

    def _on_status_request(self, state: None, body: dict[str, Any], identity: bytes, now: float) -> None:
        self._reply(identity, "status", {
            "job": self._job, "ranks": [self._ranks[r].status() for r in sorted(self._ranks)],
            "stop": None if self._stop is None else self._stop.status()})

    def _on_stop_request(self, state: None, body: dict[str, Any], identity: bytes, now: float) -> None:
        existing = self._stop is not None
        command = self._begin_stop("operator", body["reason"], "operator", now)
        self._reply(identity, "stop_accepted", {"command_id": command.command_id, "existing": existing})

    def _reply(self, identity: bytes, type_: str, body: dict[str, Any]) -> None:
        try:
            frames = self._codec.encode(type_, body)
        except ProtocolError as exc:
            log.error("cannot answer a %s request: %s", type_, exc)
            return
        self._socket.send_multipart([identity, *frames])

    # --- stopping -------------------------------------------------------------------------

    def _begin_stop(self, origin: str, reason: str, label: str, now: float) -> StopCommand:
        """The job's stop command, made and sent to every rank the first time; counted once."""
        if self._stop is not None:
            return self._stop
        self._stop = StopCommand(secrets.token_hex(8), origin, reason[:500], now)
        self.metrics.stop(label)
        targets = [s for s in self._ranks.values() if not s.finished]
        started = time.perf_counter()
        self._send_stop(targets, now)
        log.warning("stopping job %s (%s): %s; command %s sent to %d rank(s) in %.1f ms", self._job,
                    origin, reason, self._stop.command_id, len(targets),
                    (time.perf_counter() - started) * 1e3)
        self._log.sync_soon()
        return self._stop

    def _send_stop(self, targets: list[RankState], now: float) -> None:
        if not targets:
            return
        stop = self._stop
        frames = self._codec.encode("stop", {"command_id": stop.command_id, "reason": stop.reason,
                                             "origin": stop.origin})
        # the fan-out's cost is this loop: plain sends, no list per rank (send_multipart's)
        send, more = self._socket.send, zmq.SNDMORE
        *head, last = frames
        for state in targets:
            send(state.routing_id, more)
            for frame in head:
                send(frame, more)
            send(last)
        self._next_resend = now + self.resend_s

    def _resend(self, now: float) -> None:
        acked = self._stop.acked
        pending = [s for s in self._ranks.values() if not s.finished and s.rank not in acked]
        if pending:
            self._send_stop(pending, now)
        else:
            self._next_resend = math.inf

    # --- time-driven ----------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        alive = stalled = finished = 0
        for state in self._ranks.values():
            was_alive = state.alive
            state.alive = not state.finished and now - state.last_seen <= self.dead_after_s
            state.stalled = state.alive and now - state.step_changed_at > self.stall_after_s
            if was_alive and not state.alive and not state.finished:
                log.warning("rank %d is dead: nothing heard for %.0f s", state.rank, now - state.last_seen)
            alive += state.alive
            stalled += state.stalled
            finished += state.finished
        self.metrics.ranks(registered=len(self._ranks), alive=alive, stalled=stalled, finished=finished)
        self._next_tick = now + _TICK_S

