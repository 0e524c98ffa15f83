"""The rank table: the job the coordinator serves, its ranks, and which of them are alive.

A rank is registered by any message that names its job (``REGISTERING``), not only ``hello``:
after a coordinator restart, ranks do not say hello again. The first job named is taken, unless
one was pinned. A message of another job is refused while any rank of the current job is alive
and not finished; once every rank is dead or has said ``bye``, the new job replaces the old one
(never when the job is pinned).

A rank is dead after ``dead_after_s`` without a message, and stalled when it is alive but its
step has not moved for ``stall_after_s``. Both durations are measured on the monotonic clock:
setting the wall clock must not kill or stall a whole job. What people read (``last_seen`` in a
``status`` reply, ``nanguard_rank_last_seen_timestamp_seconds``) stays a wall-clock time.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from ..events import json_float
from .clock import Instant, require_positive
from .metrics import Metrics

log = logging.getLogger("nanguard.coordinator")

REGISTERING = frozenset(("hello", "heartbeat", "events", "captured", "stopped"))
"""message types (rank -> coordinator) that name a job and register their rank"""


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
    """wall clock of the rank's last message (shown and exported)"""
    heard_at: float = 0.0
    """monotonic clock of the rank's last message (decides dead)"""
    step_changed_at: float = 0.0
    """monotonic clock when the rank's step last moved (decides stalled)"""
    alive: bool = True
    stalled: bool = False
    finished: bool = False
    events: int = 0
    dropped: int = 0

    def status(self) -> dict[str, Any]:
        """This rank's row of a ``status`` reply (coordinator -> operator)."""
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "world_size": self.world_size,
                "step": self.step, "step_time_s": self.step_time_s,
                "grad_norm": json_float(self.grad_norm), "last_seen": self.last_seen,
                "alive": self.alive, "stalled": self.stalled, "finished": self.finished,
                "events": self.events, "dropped": self.dropped}


class Admission(enum.Enum):
    """What ``RankTable.admit`` made of the job a message names."""

    ACCEPTED = "accepted"
    NEW_JOB = "new_job"
    """the last job is over and this one replaced it: the table is empty, and whatever else
    belonged to the last job (its stop, the policy's memory) must be forgotten too"""
    REFUSED = "refused"


class RankTable:
    """The ranks of the job being served, keyed by rank number; owns the per-rank metrics.

    ``job``: pins the job id (else the first one named is taken). Times come in as ``Instant``s,
    so tests drive both clocks.
    """

    def __init__(self, metrics: Metrics, *, job: str | None = None, dead_after_s: float = 15.0,
                 stall_after_s: float = 300.0):
        require_positive(dead_after_s=dead_after_s, stall_after_s=stall_after_s)
        self.metrics = metrics
        self.dead_after_s = dead_after_s
        self.stall_after_s = stall_after_s
        self._job = job
        self._pinned = job is not None
        self._ranks: dict[int, RankState] = {}

    @property
    def job(self) -> str | None:
        """the job served, or None before the first registering message of an unpinned table"""
        return self._job

    def __len__(self) -> int:
        return len(self._ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self._ranks

    def admit(self, job: str) -> Admission:
        """Whether a registering message of ``job`` is served; may start a new job."""
        if self._job is None:
            self._job = job
            log.info("job %s", job)
            return Admission.ACCEPTED
        if job == self._job:
            return Admission.ACCEPTED
        if self._pinned or not all(r.finished or not r.alive for r in self._ranks.values()):
            return Admission.REFUSED
        log.info("job %s ended (every rank dead or finished); job %s starts", self._job, job)
        self.metrics.new_job(list(self._ranks))
        self._ranks.clear()
        self._job = job
        return Admission.NEW_JOB

    def seen(self, rank: int, routing_id: bytes, at: Instant) -> tuple[RankState, bool]:
        """The rank's state, marked alive and seen at ``at``; True when it was registered now."""
        state = self._ranks.get(rank)
        registered = state is None
        if registered:
            state = self._ranks[rank] = RankState(rank, routing_id, step_changed_at=at.mono)
            log.info("rank %d registered (%d known)", rank, len(self._ranks))
        elif not state.alive and not state.finished:
            log.info("rank %d is back after %.0f s of silence", rank, at.mono - state.heard_at)
        state.routing_id = routing_id
        state.last_seen, state.heard_at = at.wall, at.mono
        state.alive = True
        self.metrics.rank(rank, last_seen=at.wall)
        return state, registered

    def hello(self, state: RankState, body: dict[str, Any]) -> None:
        """A ``hello`` (or the identity part of a heartbeat): a process is (again) running."""
        state.host, state.pid, state.world_size = body["host"], body["pid"], body["world_size"]
        state.finished = False

    def heartbeat(self, state: RankState, body: dict[str, Any], at: Instant) -> None:
        self.hello(state, body)
        if body["step"] != state.step:
            state.step, state.step_changed_at = body["step"], at.mono
        state.step_time_s, state.grad_norm = body["step_time_s"], body["grad_norm"]
        state.dropped = body["dropped"]
        self.metrics.rank(state.rank, last_seen=at.wall, step=state.step,
                          step_time_s=state.step_time_s, grad_norm=state.grad_norm)
        self.metrics.dropped(state.rank, state.dropped)

    def bye(self, rank: int, routing_id: bytes, at: Instant) -> None:
        """The rank finished; a ``bye`` of a rank never heard before changes nothing."""
        if rank not in self._ranks:
            return
        state, _ = self.seen(rank, routing_id, at)
        state.finished, state.alive = True, False
        log.info("rank %d finished", rank)

    def unfinished(self) -> list[RankState]:
        """Registered ranks that have not said ``bye``: those a stop command goes to."""
        return [state for state in self._ranks.values() if not state.finished]

    def tick(self, at: Instant) -> None:
        """Recompute who is alive and stalled, and the rank-count gauges."""
        alive = stalled = finished = 0
        for state in self._ranks.values():
            was_alive = state.alive
            silent_s = at.mono - state.heard_at
            state.alive = not state.finished and silent_s <= self.dead_after_s
            state.stalled = state.alive and at.mono - state.step_changed_at > self.stall_after_s
            if was_alive and not state.alive and not state.finished:
                log.warning("rank %d is dead: nothing heard for %.0f s", state.rank, silent_s)
            alive += state.alive
            stalled += state.stalled
            finished += state.finished
        self.metrics.ranks(registered=len(self._ranks), alive=alive, stalled=stalled, finished=finished)

    def status(self) -> list[dict[str, Any]]:
        """The ``ranks`` of a ``status`` reply, by rank number."""
        return [self._ranks[rank].status() for rank in sorted(self._ranks)]
