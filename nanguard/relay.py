"""One connection to the coordinator per node: local rank 0 relays its node's ranks.

At 16,384 ranks a connection each costs the coordinator 16,384 sockets' buffers (tens of KiB each
in libzmq) and as many descriptors. Under torchrun, local rank 0 of each node runs a ``Relay``
(a thread): a ROUTER on an ``ipc://`` path that only its node's ranks can name (``local_address``),
and one DEALER to the coordinator. Every rank of the node, local rank 0's own client too, talks to
the relay; the relay forwards what they send, as it is, with its envelope::

    rank -> relay           [payload, mac]
    relay -> coordinator    [RELAYED, local route, payload, mac]
    coordinator -> relay    [RELAYED, local route, payload, mac]
    relay -> rank           [payload, mac]

The relay reads nothing of a message: the ranks' messages are signed end to end (``wire.Codec``),
so a relay can drop one but not forge one, and the coordinator's route to a rank stays inside the
connection its authenticated hello came over (``Route``: a relay's connection and the local route
in it, which no other connection can name). The link to the coordinator may use CurveZMQ; the ipc
link is on the node, in a folder only this user can enter.

A relay tells its ranks when its own link to the coordinator comes up (``UP``: they handshake
again, as after a reconnection of their own) and goes down (``DOWN``). A rank whose relay is not
there (local rank 0 died, or never called ``nanguard.init``) or stops carrying anything goes to
the coordinator directly for the rest of its life (``client.py``). No torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import curve
from ._throttle import Throttle
from .errors import ProtocolError
from .wire import MAX_FRAME_BYTES

log = logging.getLogger("nanguard.relay")

RELAYED = b"\x00nanguard-relayed"
"""the first frame of a relayed message, between a relay and the coordinator (no payload begins
with a zero byte: a payload is JSON)"""
UP = b"\x00nanguard-relay-up"
"""relay -> rank, one frame: the relay's link to the coordinator (re)connected"""
DOWN = b"\x00nanguard-relay-down"
"""relay -> rank, one frame: the relay's link to the coordinator is down"""

Route = bytes | tuple[bytes, bytes]
"""how the coordinator reaches a peer: its connection's routing id, or (a relay's connection, the
local route in that relay)"""

MAX_LOCAL_RANKS = 1024
"""the local routes a relay remembers (to say ``UP``/``DOWN`` to): far more ranks than a node has"""
_POLL_MS = 50
_HWM_PER_RANK = 64
"""messages a relay queues per rank of its node, each way, before it drops (a rank's own client
queues no more than this: its socket's high-water marks)"""


def local_address(*, uid: int, run_id: str | None, restart: int, node: str) -> str:
    """The ``ipc://`` address of this node's relay in this job and restart: the same for every rank
    of the node, another for another job, restart, node (two torchrun agents on one host) or user.
    ``node``: torchrun's GROUP_RANK, MASTER_ADDR and MASTER_PORT (``_dist.RankInfo.node``)."""
    key = "\0".join((str(uid), run_id or "", str(restart), node)).encode()
    name = hashlib.sha256(key).hexdigest()[:20]
    folder = os.path.join(tempfile.gettempdir(), f"nanguard-relay-{uid}")
    return f"ipc://{folder}/{name}"


def _path(address: str) -> str:
    """The socket file of an ``ipc://`` address."""
    return address[len("ipc://"):]


def ensure_folder(address: str) -> None:
    """The folder of an ``ipc://`` relay address, made if missing, and refused (OSError) unless
    this user owns it and nobody else can enter it."""
    folder = os.path.dirname(_path(address))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.stat(folder)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OSError(f"{folder} (the folder of nanguard's relay sockets) must belong to this user and be"
                      f" closed to others (mode 700); it is mode {info.st_mode & 0o777:o}, owner {info.st_uid}")


def unwrap(frames: Sequence[bytes], connection: bytes) -> tuple[Route, Sequence[bytes]]:
    """(route, the message's own frames) of what the coordinator read on ``connection``: a relayed
    message's route is (connection, its local route). ProtocolError for a relay envelope without a
    local route or a message."""
    if len(frames) < 3 or frames[0] != RELAYED:
        return connection, frames
    local = bytes(frames[1])
    if not 0 < len(local) <= 255:
        raise ProtocolError(f"a relayed message's local route is {len(local)} bytes (1 to 255)")
    return (connection, local), frames[2:]


def envelope(route: Route) -> tuple[bytes, tuple[bytes, ...]]:
    """(the connection to send on, the frames that go before the message's own) for ``route``."""
    if type(route) is tuple:
        return route[0], (RELAYED, route[1])
    return route, ()


def describe(route: Route) -> str:
    """A short name of ``route`` for the log."""
    if type(route) is tuple:
        return f"{route[0].hex()[:16]} (relayed {route[1].hex()[:12]})"
    return route.hex()[:16]


_RUNNING: dict[str, Relay] = {}
"""this process's relays by local address: two guards of one process share one (a second bind of the
address would take its file from the first)"""
_RUNNING_LOCK = threading.Lock()


def shared(upstream: str, local: str, **options) -> Relay:
    """This process's relay at ``local``, started at its first use (OSError when it cannot start);
    each use ends with ``release``, and the last one closes it."""
    with _RUNNING_LOCK:
        running = _RUNNING.get(local)
        if running is None or running.upstream != upstream or running.closed:
            running = Relay(upstream, local, **options)
            running.start()
            _RUNNING[local] = running
        running.users += 1
        return running


class Relay:
    """Local rank 0's relay for its node: ``local`` (an ``ipc://`` address, ``local_address``) to the
    coordinator at ``upstream``. ``curve_public_key``: the coordinator's, for an encrypted link."""

    def __init__(self, upstream: str, local: str, *, curve_public_key: str | None = None,
                 local_ranks: int = 8, context: zmq.Context | None = None):
        self.upstream, self.local = upstream, local
        self._curve_public_key = curve_public_key
        self._hwm = _HWM_PER_RANK * max(1, min(local_ranks, MAX_LOCAL_RANKS))
        self._context = context or zmq.Context.instance()
        self._peers: OrderedDict[bytes, None] = OrderedDict()
        """local routes that spoke, oldest first (bounded): whom ``UP`` and ``DOWN`` go to"""
        self._closing = threading.Event()
        self._closing_s = 0.0
        self._throttle = Throttle(60.0)
        self.users = 0
        """the uses ``shared`` handed out and not yet released"""
        self.links = 0
        """the node's ranks connected to this relay now"""
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None

    def start(self, timeout_s: float = 5.0) -> None:
        """Bind the local socket and connect upstream on the relay's thread; OSError when it
        cannot bind (another process holds the address?) or the folder is not safe."""
        ensure_folder(self.local)
        self._thread = threading.Thread(target=self._run, name="nanguard-relay", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise OSError(f"nanguard's relay did not start within {timeout_s:.0f} s")
        if self._failed is not None:
            raise OSError(f"nanguard's relay cannot bind {self.local}: {self._failed}") from self._failed

    @property
    def closed(self) -> bool:
        """Closed, or its thread ended (failed): ``shared`` starts another."""
        return self._closing.is_set() or (self._thread is not None and not self._thread.is_alive())

    def release(self, timeout_s: float = 5.0) -> None:
        """One use (``shared``) ends; the last closes the relay (``close``)."""
        with _RUNNING_LOCK:
            self.users -= 1
            last = self.users <= 0
            if last and _RUNNING.get(self.local) is self:
                del _RUNNING[self.local]
        if last:
            self.close(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop relaying once the node's other ranks are gone (their goodbyes go through it) or
        ``timeout_s`` has passed; those still there then go to the coordinator directly."""
        self._closing_s = timeout_s
        self._closing.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s + 2.0)

    def _sockets(self) -> tuple[zmq.Socket, zmq.Socket]:
        down = self._context.socket(zmq.ROUTER)
        up = self._context.socket(zmq.DEALER)
        for sock in (down, up):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._hwm)
            sock.setsockopt(zmq.RCVHWM, self._hwm)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        down.setsockopt(zmq.ROUTER_MANDATORY, 1)
        up.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a coordinator that is not there
        up.setsockopt(zmq.RECONNECT_IVL, 100)
        up.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self._curve_public_key is not None:
            curve.connect(up, self._curve_public_key)
        return down, up

    def _run(self) -> None:
        try:
            down, up = self._sockets()
        except zmq.ZMQError as exc:
            self._failed = exc
            self._ready.set()
            return
        monitor = local = None
        try:
            local = down.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            try:
                down.bind(self.local)
            except zmq.ZMQError as exc:
                self._failed = exc
                return
            monitor = up.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            up.connect(self.upstream)
            self._ready.set()
            self._loop(down, up, monitor, local)
        except Exception:  # noqa: BLE001 - the ranks then go to the coordinator directly
            log.exception("nanguard: the node's relay to the coordinator at %s failed; its ranks go to the"
                          " coordinator directly", self.upstream)
        finally:
            self._ready.set()
            for sock, watcher in ((up, monitor), (down, local)):
                if watcher is not None:
                    sock.disable_monitor()
                    watcher.close(linger=0)
            up.close(linger=1000 if self._closing.is_set() else 0)
            down.close(linger=0)
            if self._failed is None:  # (ZeroMQ leaves the socket's file behind)
                with contextlib.suppress(OSError):
                    os.unlink(_path(self.local))

    def _loop(self, down: zmq.Socket, up: zmq.Socket, monitor: zmq.Socket, local: zmq.Socket) -> None:
        poller = zmq.Poller()
        for sock in (down, up, monitor, local):
            poller.register(sock, zmq.POLLIN)
        deadline = None
        while deadline is None or (self.links > 0 and time.monotonic() < deadline):
            if deadline is None and self._closing.is_set():
                deadline = time.monotonic() + self._closing_s
            ready = dict(poller.poll(_POLL_MS))
            if monitor in ready:
                self._link_events(monitor, down)
            if local in ready:
                while local.poll(0):
                    accepted = recv_monitor_message(local)["event"] == zmq.EVENT_ACCEPTED
                    self.links = max(0, self.links + (1 if accepted else -1))
            if down in ready:
                self._forward(down, lambda frames: up.send_multipart([RELAYED, *frames], zmq.NOBLOCK), True)
            if up in ready:
                self._forward(up, lambda frames: down.send_multipart(frames[1:], zmq.NOBLOCK), False)

    def _forward(self, source: zmq.Socket, send, from_ranks: bool) -> None:
        for _ in range(1024):  # then the other side's turn
            try:
                frames = source.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if from_ranks:
                self._spoke(frames[0])
                if len(frames) < 2:
                    continue
            elif len(frames) < 3 or frames[0] != RELAYED:
                continue  # (the coordinator sends nothing else to a relay)
            try:
                send(frames)
            except zmq.ZMQError as exc:
                if exc.errno not in (zmq.EAGAIN, zmq.EHOSTUNREACH):
                    raise  # (a full queue or a rank gone: dropped; a rank sends again what was not received)

    def _spoke(self, route: bytes) -> None:
        self._peers[route] = None
        self._peers.move_to_end(route)
        if len(self._peers) > MAX_LOCAL_RANKS:
            self._peers.popitem(last=False)

    def _link_events(self, monitor: zmq.Socket, down: zmq.Socket) -> None:
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._tell(down, self._peers, UP)
            elif event == zmq.EVENT_DISCONNECTED:
                self._tell(down, self._peers, DOWN)
            elif self._throttle.allow("curve")[0]:
                log.warning("nanguard: this node's relay (local rank 0) failed its handshake with the coordinator at"
                            " %s: does NANGUARD_CURVE_PUBLIC_KEY match the coordinator's key (and does it use"
                            " CurveZMQ at all)? The node's ranks report nothing until it does", self.upstream)

    def _tell(self, down: zmq.Socket, routes: Iterable[bytes], notice: bytes) -> None:
        for route in list(routes):
            try:
                down.send_multipart([route, notice], zmq.NOBLOCK)
            except zmq.ZMQError:
                self._peers.pop(route, None)  # gone
