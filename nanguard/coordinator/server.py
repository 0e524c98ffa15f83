"""Coordinator: one thread owns the ROUTER socket; ranks and operators talk to it over ZeroMQ.

    rank -> coordinator       handshake, hello, heartbeat, events, captured, stopped, ack, bye
    coordinator -> rank       welcome, stop
    operator -> coordinator   handshake, status_request, stop_request, clear_request
    coordinator -> operator   welcome, status, stop_accepted, cleared, refused

The loop decodes each message (``wire.Codec``: authenticated, addressed to this instance),
refuses replays, and hands it to ``handlers.py``; the rank table (``ranks.py``) keeps who is there,
the stop fan-out (``stop.py``) the job's stop command, the policy (``policy.py``) decides when to
stop. Every accepted message is appended, as received, to the event log (``eventlog.py``). Bad
messages are counted by reason and dropped; a message the loop fails on (a bug) is counted as
``internal`` and logged with its traceback: nothing a client sends can end the loop or stop a job.
If the loop thread ends all the same, ``serve_forever`` returns non-zero.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Iterable
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from .. import curve
from ..relay import Route, describe, envelope, unwrap
from .._version import __version__
from ..errors import ProtocolError
from ..protocol import check_curve_key, parse_address
from ..wire import MAX_FRAME_BYTES, Codec, Message
from .clock import Instant, LoopClock, require_positive
from .eventlog import EventLog, LogTrouble
from .handlers import RANK_TYPES, Handlers
from .metrics import Metrics
from .policy import Policy
from .ranks import DEFAULT_MAX_WORLD_SIZE, RankTable
from .replay import OPERATOR, RANK, ReplayMemory
from .state import SavedState, StateError, read_state, write_state
from .stop import StopCommand, StopFanout

log = logging.getLogger("nanguard.coordinator")

_DRAIN = 256
"""messages handled between two looks at the clock-driven work (timers, log flush)"""
_RCVHWM = 4
SNDHWM = 8
"""messages queued for one connection that does not read them (a status reply is up to 5 MiB at
16,384 ranks); past it what is sent to that peer is dropped and counted
(``nanguard_replies_dropped_total``). A rank gets only a welcome and the stop's copies."""
_TICK_S = 0.5
"""how often liveness is recomputed"""
_BAD_LOG_S = 10.0
"""at most one log line per bad-message reason this often (a flood must not flood the log)"""


class Coordinator:
    """The daemon: its socket loop and the parts the messages go to.

    ``bind``: a ZeroMQ address (``tcp://127.0.0.1:0`` picks a free port; see ``address``).
    ``token``: NANGUARD_TOKEN (the ranks' credential) or None; ``operator_token``:
    NANGUARD_OPERATOR_TOKEN or None; ``curve_secret_key``: a CurveZMQ secret key (``curve.py``), or
    None for a plain link. ``job``: pins the job id (else the first rank's job is taken, and a new
    job may start once every rank of the last one is dead, failed or finished);
    ``max_world_size``: the largest job served. ``dead_after_s``: silence after which a rank counts
    as dead; ``stall_after_s``: time without a new step after which an alive rank counts as
    stalled; ``resend_s``: how often an unacked stop command is sent again. ``state_path``: the
    state file that keeps the job's stop across restarts (``state.py``; None: none);
    ``log_max_bytes`` and ``log_keep``: when the event log rotates and how many old ones are kept.
    ``on_restart``: what a torchrun restart of a stopped launch gets, ``stop`` or ``run`` (``stop.py``).
    """

    def __init__(self, bind: str, *, token: str | None, registry: CollectorRegistry, log_path: str,
                 operator_token: str | None = None, curve_secret_key: str | None = None,
                 policy: Policy | None = None, job: str | None = None,
                 max_world_size: int = DEFAULT_MAX_WORLD_SIZE, dead_after_s: float = 15.0,
                 stall_after_s: float = 300.0, resend_s: float = 0.2, context: zmq.Context | None = None,
                 state_path: str | None = None, log_max_bytes: int | None = None, log_keep: int = 4,
                 on_restart: str = "stop"):
        # checked before the metrics exist: a refused coordinator leaves the registry empty
        require_positive(dead_after_s=dead_after_s, stall_after_s=stall_after_s, resend_s=resend_s)
        parse_address(bind, bind=True)  # ZeroMQ would take tcp://host:99999 as another port
        if curve_secret_key is not None:
            check_curve_key(curve_secret_key, "the CurveZMQ secret key")
        self._codec = Codec(f"coordinator@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(8)}",
                            token, operator_token=operator_token)
        self.instance = self._codec.sender
        """this run's id: every message to it names it in ``to``, so nothing captured from another
        coordinator or an earlier run of this one is accepted"""
        self.bind = bind
        self.metrics = Metrics(registry, __version__)
        self.policy = policy or Policy()
        self.log_path = log_path
        self._log_rotation = {"max_bytes": log_max_bytes, "keep": log_keep}
        self._state = _StateFile(state_path, self.metrics)
        self.address: str | None = None
        """the bound address, with the real port, once started"""
        self._context = context or zmq.Context.instance()
        self._curve_secret_key = curve_secret_key
        self._replay = ReplayMemory()
        self._clock = LoopClock()
        ranks = RankTable(self.metrics, job=job, max_world_size=max_world_size, dead_after_s=dead_after_s,
                          stall_after_s=stall_after_s)
        stops = StopFanout(ranks, self.metrics, self._encode_to_rank, self._send, resend_s=resend_s,
                           on_restart=on_restart)
        self._handlers = Handlers(ranks=ranks, stops=stops, policy=self.policy, metrics=self.metrics,
                                  reply=self._reply, sync_soon=self._sync_soon,
                                  operator_gate=self._codec.holds("rank") or self._codec.holds("operator"))
        self._ranks, self._stops = ranks, stops
        self._next_tick = 0.0
        """loop-clock time of the next liveness tick"""
        self._bad = _BadMessages(self.metrics)
        self._socket: zmq.Socket | None = None
        self._log: EventLog | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    # --- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Open the log, bind the socket (errors are raised here) and start the loop thread."""
        if self._thread is not None:
            raise RuntimeError("coordinator already started")
        self._log = EventLog(self.log_path, count_error=self.metrics.log_errors.inc, **self._log_rotation)
        self._state.restore(self._ranks, self._stops)
        try:
            self._socket, self.address = _router(self._context, self.bind, self._curve_secret_key)
        except OSError:
            self._log.close()
            raise
        self._thread = threading.Thread(target=self._run, name="nanguard-coordinator", daemon=True)
        self._thread.start()
        secret = self._curve_secret_key
        log.info("listening on %s (instance %s%s), job %s, logging to %s", self.address, self.instance,
                 f", CurveZMQ: clients need NANGUARD_CURVE_PUBLIC_KEY={curve.public_key(secret)}" if secret else "",
                 self._ranks.job or "(first seen)", self.log_path)

    def shutdown(self) -> None:
        """Ask the loop to end (safe from a signal handler); ``serve_forever`` then returns."""
        self._closing.set()

    def serve_forever(self) -> int:
        """Start (if needed) and run until ``shutdown()`` or ``close()``; then close. Returns 0,
        or 1 when the loop thread ended by itself (a supervisor should restart the daemon)."""
        if self._thread is None:
            self.start()
        died = False
        while not self._closing.wait(0.5):
            if not self._thread.is_alive():
                died = True
                log.critical("the coordinator's loop thread ended unexpectedly; exiting with an error")
                break
        self.close()
        return 1 if died else 0

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
        except Exception:  # noqa: BLE001 - said here with its traceback; serve_forever then fails
            log.critical("the coordinator's loop failed (its socket is unusable?)", exc_info=True)
        finally:
            sock.close(linger=0)
            self._log.close()
            log.info("stopped; log %s synced", self.log_path)

    def _loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._closing.is_set():
            wait_s = min(self._next_tick, self._stops.next_resend) - self._clock.now().mono
            if poller.poll(max(0.0, min(_TICK_S, wait_s)) * 1000):
                for _ in range(_DRAIN):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames, self._clock.now())
            at = self._clock.now()
            try:
                self._state.save_if_changed(self._ranks, self._stops)
                self._log.end_batch()
                self._stops.resend_due(at)
                if at.mono >= self._next_tick:
                    self._next_tick = at.mono + _TICK_S
                    self._ranks.tick(at)
            except Exception:  # noqa: BLE001 - a bug in a timer or the log must not end the loop either
                self._bad.failed("a timer or the log", at)

    # --- messages -------------------------------------------------------------------------

    def _handle(self, frames: list[bytes], at: Instant) -> None:
        identity = frames[0]
        try:
            identity, frames = unwrap(frames[1:], identity)  # (a node's relay: ``relay.py``)
            message = self._codec.decode(frames)
            self._replay.check(message, at.wall)
            self._handlers.handle(message, identity, at)
        except ProtocolError as exc:
            self._bad(exc.reason, identity, str(exc), at)
        except Exception:  # noqa: BLE001 - a bug must cost one message, not the daemon
            self._bad.internal(identity, at)
        else:
            if message.role == "operator" or message.type in ("stop_request", "clear_request"):
                self._replay.trust(message, OPERATOR)
            elif message.type in RANK_TYPES:
                self._replay.trust(message, RANK)
            self._log.append(at.wall, message.payload)

    def _sync_soon(self) -> None:
        self._log.sync_soon()

    # --- sending (coordinator -> rank, coordinator -> operator) -----------------------------

    def _encode_to_rank(self, type_: str, body_json: str, to: str) -> list[bytes]:
        return self._codec.encode_json(type_, body_json, to=to, role="rank")

    def _reply(self, identity: Route, message: Message, type_: str, body: dict[str, Any] | str) -> None:
        """Answer ``message`` on its connection, addressed to its session, signed with the key that
        verified it (no MAC where it had none). ``body``: a dict, or a str already serialised as JSON."""
        try:
            if isinstance(body, str):
                frames = self._codec.encode_json(type_, body, to=message.sender, role=message.role or "rank")
            else:
                frames = self._codec.encode(type_, body, to=message.sender, role=message.role or "rank")
        except ProtocolError as exc:
            log.error("cannot answer a %s message: %s", message.type, exc)
            return
        self._send([(identity, frames)])

    def _send(self, messages: Iterable[tuple[Route, list[bytes]]]) -> None:
        """Send each message without waiting: one for a peer whose queue is full (it does not read)
        or whose connection is gone is dropped and counted."""
        # the fan-out's cost is this loop: plain sends, no list per rank (send_multipart's)
        send, first, more = self._socket.send, zmq.SNDMORE | zmq.NOBLOCK, zmq.SNDMORE
        full = gone = 0
        for route, frames in messages:
            routing_id, before = envelope(route)
            try:
                # ROUTER_MANDATORY: the routing id is refused (queue at SNDHWM, or no such
                # connection) or the whole message is queued; the later frames never block
                send(routing_id, first)
            except zmq.Again:
                full += 1
                continue
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                gone += 1
                continue
            for frame in before:
                send(frame, more)
            for frame in frames[:-1]:
                send(frame, more)
            send(frames[-1])
        if full or gone:
            self.metrics.replies_dropped_now(full=full, gone=gone)


def _router(context: zmq.Context, bind: str, curve_secret_key: str | None) -> tuple[zmq.Socket, str]:
    """The coordinator's ROUTER socket bound to ``bind``, and the address it got."""
    sock = context.socket(zmq.ROUTER)
    try:
        # no ROUTER_HANDOVER, and peers never choose their routing ids (the ROUTER assigns one per
        # connection, which no peer can claim): a connection cannot take over another's route, so a
        # stop reaches the connection whose authenticated hello registered the rank
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # messages held per rank before TCP pushes back on it: bounds memory when many
        # ranks flood at once (the ranks' own queues then fill and count what they drop)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        # the kernel's probes (not ZeroMQ's pings: wire.py says why) close a connection whose rank
        # went away unheard, a partition's say, after about 90 s idle
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 60)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 10)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        if curve_secret_key is not None:
            curve.serve(sock, curve_secret_key)
        sock.bind(bind)
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise OSError(f"coordinator cannot bind {bind}: {exc}; nothing was started") from exc


class _StateFile:
    """The state file at ``path`` (None: no state is kept): read back at start, written when the
    job's stop changes; a failure is counted in ``nanguard_log_errors_total`` and said once."""

    def __init__(self, path: str | None, metrics: Metrics):
        self.path = path
        self._metrics = metrics
        self._trouble = LogTrouble(path or "", metrics.log_errors.inc)
        self._saved: tuple[StopCommand | None, int | None] = (None, None)
        """the stop and the restart count last written"""

    def restore(self, ranks: RankTable, stops: StopFanout) -> None:
        """The stop saved by an earlier run, back in ``stops`` (its job's ranks are stopped again
        as they reconnect); a file that is not a state is said in one line and left out."""
        if self.path is None:
            return
        try:
            saved = read_state(self.path)
        except StateError as exc:
            log.error("%s; starting without it: no stop is restored (the file is replaced at the next stop)", exc)
            return
        if saved is None or saved.stop is None:
            return
        if not ranks.restore(saved.job, saved.world_size, saved.restart):
            log.warning("the state file %s holds a stop of job %s, but this coordinator serves only job %s: "
                        "not restored", self.path, saved.job, ranks.job)
            return
        stops.restore(saved.stop)
        self._saved = saved.stop, saved.restart
        self._metrics.job_stopped.set(1)
        log.warning("%s (world size %d) was stopped before this coordinator started (%s: %s; state file %s): "
                    "its ranks are told to stop again as they reconnect", saved.stop.incarnation, saved.world_size,
                    saved.stop.origin, saved.stop.reason, self.path)

    def save_if_changed(self, ranks: RankTable, stops: StopFanout) -> None:
        now = stops.command, ranks.restart
        if self.path is None or now[0] is self._saved[0] and now[1] == self._saved[1]:
            return
        self._saved = now
        try:
            write_state(self.path, SavedState(ranks.job, ranks.world_size, now[0], now[1]))
        except OSError as exc:
            self._trouble.failed("write the state file", exc)
        else:
            self._trouble.worked()


class _BadMessages:
    """Counts every dropped message and logs why, at most once per reason each ``_BAD_LOG_S``
    (a flood of bad messages must not flood the log too); the same for the loop's own failures,
    logged with their traceback."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics
        self._logged_at: dict[str, float] = {}
        """reason -> loop-clock time of its last log line"""
        self._unlogged: dict[str, int] = {}

    def __call__(self, reason: str, identity: Route, text: str, at: Instant) -> None:
        self._metrics.bad_message(reason)
        more = self._due(reason, at)
        if more is not None:
            log.warning("dropped a bad message (%s) from peer %s: %s%s", reason, describe(identity), text,
                        f" (and {more} more {reason} since the last such line)" if more else "")

    def internal(self, identity: Route, at: Instant) -> None:
        """The loop failed on a message (call from an ``except`` block): counted, and logged."""
        self._metrics.bad_message("internal")
        self.failed(f"a message from peer {describe(identity)} (counted as internal)", at)

    def failed(self, what: str, at: Instant) -> None:
        """The loop failed on ``what`` (call from an ``except`` block): log the traceback."""
        more = self._due("internal traceback", at)
        if more is not None:
            log.error("internal error handling %s; the coordinator goes on%s", what,
                      f" ({more} more since the last such line)" if more else "", exc_info=True)

    def _due(self, key: str, at: Instant) -> int | None:
        """How many lines of ``key`` were held back when one may be logged now, else None."""
        if key in self._logged_at and at.mono - self._logged_at[key] < _BAD_LOG_S:
            self._unlogged[key] = self._unlogged.get(key, 0) + 1
            return None
        self._logged_at[key] = at.mono
        return self._unlogged.pop(key, 0)
