"""What a guard tells the coordinator, and the stop requests it hears back.

``Reporter`` does nothing: a guard without a coordinator (or replaying) talks to it all the
same. ``CoordinatorReporter`` hands everything to the ``nanguard-client`` thread (a bounded
queue, never blocking the training thread) and keeps the stop requests that thread receives
until the next step's decision reads them.
"""

from __future__ import annotations

import atexit
import logging
import os

import torch

from .._dist import Collectives, RankInfo
from .._version import __version__
from ..config import Settings
from ..events import Event
from . import outcome

log = logging.getLogger("nanguard")


class Reporter:
    """No coordinator: every call does nothing, and no stop is ever requested."""

    def note(self, event: Event, action: str) -> None:
        """This rank saw ``event`` and did ``action`` about it: raise, skip, warn, or observe (an
        evaluation's event, about which nothing is done)."""

    def heartbeat(self, step: int, step_time_s: float | None, grad_norm: float | None) -> None:
        """A step ended: its index, how long it took and its gradient norm."""

    def captured(self, step: int, incident: str) -> None:
        """The job's incident of ``step`` is complete in ``incident`` (said by rank 0)."""

    def stopped(self, step: int, reason: str) -> None:
        """This rank stopped at ``step`` (nonfinite, policy, operator)."""

    @property
    def stop_requested(self) -> bool:
        """A stop command arrived and was not taken yet."""
        return False

    def take_stop(self) -> tuple[str, str] | None:
        """(reason, origin) of the stop command that arrived, or None; forgets it."""
        return None

    def close(self, clean: bool = True) -> None:
        """Send what is queued (bounded time) and stop; ``clean=False``: the process ends by an error."""


def _relay(settings: Settings, identity: RankInfo):
    """(the relay this process runs for its node, or None; the relay address its client uses, or
    None): under torchrun with more than one rank on the node, local rank 0 relays (``relay.py``);
    a relay that cannot start is said, and the node's ranks go to the coordinator directly."""
    from .. import relay

    if not settings.relay or identity.local_world_size < 2:
        return None, None
    address = relay.local_address(uid=os.getuid(), run_id=identity.run_id, restart=identity.restart,
                                  node=identity.node)
    if identity.local_rank != 0:
        return None, address
    try:
        node = relay.shared(settings.coordinator, address, curve_public_key=settings.curve_public_key,
                            local_ranks=identity.local_world_size)
    except OSError as exc:
        log.warning("nanguard: %s; this node's ranks go to the coordinator directly", exc)
        return None, None
    return node, address


def connect(settings: Settings, identity: RankInfo, group: Collectives) -> Reporter:
    """A reporter to ``settings.coordinator``; a coordinator link that cannot be made is logged and
    training goes on guarded locally (nanguard.init never fails because of the coordinator)."""
    try:
        return CoordinatorReporter(settings, identity, group)
    except ValueError as exc:
        log.error("nanguard: no link to the coordinator at %s (%s); this rank is guarded locally and "
                  "reports nothing", settings.coordinator, exc)
        return Reporter()


class CoordinatorReporter(Reporter):
    """Reports to ``settings.coordinator`` from a background thread; never fails init."""

    def __init__(self, settings: Settings, identity: RankInfo, group: Collectives):
        from ..client import Client  # pyzmq only where a coordinator is configured

        self._stop: tuple[str, str] | None = None
        hello = {"rank": group.rank, "local_rank": identity.local_rank, "world_size": group.world_size,
                 "host": identity.host, "pid": identity.pid, "job": identity.job,
                 "device": f"cuda:{identity.local_rank}" if torch.cuda.is_available() else "cpu",
                 "version": __version__, "restart": identity.restart}
        self._relay, relay_address = _relay(settings, identity)
        try:
            self._client = Client(settings.coordinator, token=settings.token, identity=hello,
                                  queue_size=settings.event_queue, heartbeat_s=settings.heartbeat_s,
                                  on_stop=self._on_stop, curve_public_key=settings.curve_public_key,
                                  relay=relay_address)
        except ValueError:
            if self._relay is not None:
                self._relay.release(timeout_s=0.0)
            raise
        self._client.start()
        # a script that ends with an exception still sends what is queued (its stop, its events)
        atexit.register(self._close_at_exit)
        self._release_exit = outcome.hold()  # (notes a sys.exit code for the goodbye at exit)

    def _on_stop(self, command_id: str, reason: str, origin: str) -> None:
        # on the client's thread: one assignment, read at the next decision
        self._stop = (reason, origin)

    def note(self, event: Event, action: str) -> None:
        self._client.send_event(event, action)

    def heartbeat(self, step: int, step_time_s: float | None, grad_norm: float | None) -> None:
        self._client.update(step, step_time_s, grad_norm)

    def captured(self, step: int, incident: str) -> None:
        self._client.captured(step, incident)

    def stopped(self, step: int, reason: str) -> None:
        self._client.stopped(step, reason)

    @property
    def stop_requested(self) -> bool:
        return self._stop is not None

    def take_stop(self) -> tuple[str, str] | None:
        stop, self._stop = self._stop, None
        return stop

    def close(self, clean: bool = True) -> None:
        atexit.unregister(self._close_at_exit)
        self._release_exit()
        self._client.close(timeout_s=2.0, clean=clean)
        node, self._relay = self._relay, None
        if node is not None:  # once the node's other ranks said goodbye through it (bounded)
            node.release()

    def _close_at_exit(self) -> None:
        # an uncaught exception, or a non-zero code asked of sys.exit: failed, not finished (outcome.py)
        self.close(clean=outcome.exiting_cleanly())
