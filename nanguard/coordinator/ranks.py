"""The rank table: the job incarnation the coordinator serves, its ranks, and which are alive.

A rank is registered by its ``hello`` only, which the rank's client sends on every new connection
(after the coordinator's ``welcome`` told it the instance to address): the hello binds the rank
number to the session that sent it (``Message.sender``), and every later message naming that rank
must come from that session (else it is refused as ``unregistered``). A restarted rank process is
a new session: its hello takes the rank over.

The first hello names the job incarnation: its job id, world size (at most ``max_world_size``) and
launch; ranks outside the world size are refused (``out_of_range``). A hello of another job, or of
the same job with another world size, is refused (``wrong_job``) while any rank of the current
incarnation is alive and not finished; once every rank is dead, failed or finished, it starts the
next incarnation (the job id never changes when it was pinned). Within one job id, a hello's
``restart`` (TORCHELASTIC_RESTART_COUNT) tells a launch's restarts apart from a new launch:

    higher than the incarnation's           torchrun restarted the launch's workers (RESTARTED)
    lower or the same, from a new process,  a new launch (NEW_JOB): torchrun's run id is the same
      once every rank has ended             ("none") for every launch that does not set one; lower
                                            while ranks are alive: refused (``wrong_job``)
    not said (a rank of an earlier release) as before this field: the same incarnation

A rank is dead after ``dead_after_s`` without a message, failed at once when it says an unclean
``bye`` (its process ended by an error), finished after a clean ``bye``, and stalled when it is
alive but its step has not moved for ``stall_after_s``. Durations are measured on the loop's
monotonic clock (``clock.LoopClock``: setting the wall clock or pausing the coordinator must not
kill or stall a whole job); what people read (``last_seen``,
``nanguard_rank_last_seen_timestamp_seconds``) stays a wall-clock time.
"""

from __future__ import annotations

import enum
import json
import logging
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import ProtocolError
from ..events import json_float
from .clock import Instant, require_positive
from .metrics import Metrics

if TYPE_CHECKING:
    from ..relay import Route

log = logging.getLogger("nanguard.coordinator")

DEFAULT_MAX_WORLD_SIZE = 16384
"""the most ranks one job may have unless the coordinator is told otherwise: a scrape and a
status reply grow with the ranks (at this size about 3.4 MB of /metrics, 0.3 MB gzipped, and a 3.8 MB
status reply)"""


_STATUS_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)

QUIET_ABOVE_RANKS = 64
"""in a job of more ranks, each rank's registration and clean goodbye is logged at DEBUG, and INFO has
the counts (registered: at powers of two and the last; finished: as it changes): 16,384 lines per
job start and end cost the loop time and bury the lines that matter"""


@dataclass(slots=True)
class RankState:
    rank: int
    routing_id: Route
    """the ZeroMQ route of the rank's current connection (assigned by the ROUTER, never chosen by
    the peer), or of its node's relay and the rank's route inside it (``relay.Route``)"""
    sender: str
    """the session (``Message.sender``) whose hello registered this rank: the only one that speaks
    for it"""
    host: str = ""
    device: str = ""
    """the device its hello named ("cuda:1", "cpu"): where its events say none"""
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
    """said a clean ``bye``"""
    failed: bool = False
    """said an unclean ``bye``: its process ended by an error (or was torn down after a peer's)"""
    events: int = 0
    dropped: int = 0

    def status(self) -> dict[str, Any]:
        """This rank's row of a ``status`` reply (coordinator -> operator)."""
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "world_size": self.world_size,
                "relayed": type(self.routing_id) is tuple,
                "step": self.step, "step_time_s": self.step_time_s,
                "grad_norm": json_float(self.grad_norm), "last_seen": self.last_seen,
                "alive": self.alive, "stalled": self.stalled, "finished": self.finished,
                "failed": self.failed, "events": self.events, "dropped": self.dropped}


class Admission(enum.Enum):
    """What a ``hello`` made of the job incarnation it names."""

    ACCEPTED = "accepted"
    NEW_JOB = "new_job"
    """the last incarnation is over and this one replaced it (another job, or a new launch of the same
    one): the table is empty, and whatever else belonged to the last one (its stop, the policy's
    memory) must be forgotten too"""
    RESTARTED = "restarted"
    """torchrun restarted the workers of the incarnation served (same job, a higher restart count):
    the ranks stay in the table, and what the restart gets of a standing stop is ``--on-restart``'s"""


class Hello(NamedTuple):
    """What a registering ``hello`` did."""

    state: RankState
    new_session: bool
    """a rank number never seen in this incarnation, or a new process for it"""
    admission: Admission


class RankTable:
    """The ranks of the job incarnation being served, keyed by rank number; ``/metrics`` reads the
    per-rank gauges from it (``rows``).

    ``job``: pins the job id (else the first one named is taken). ``max_world_size``: the largest
    world size a hello may declare. Times come in as ``Instant``s, so tests drive both clocks.
    """

    def __init__(self, metrics: Metrics, *, job: str | None = None,
                 max_world_size: int = DEFAULT_MAX_WORLD_SIZE, dead_after_s: float = 15.0,
                 stall_after_s: float = 300.0):
        require_positive(dead_after_s=dead_after_s, stall_after_s=stall_after_s)
        if isinstance(max_world_size, bool) or not isinstance(max_world_size, int) or max_world_size < 1:
            raise ValueError(f"max_world_size={max_world_size!r} must be a positive integer")
        self.metrics = metrics
        self.dead_after_s = dead_after_s
        self.stall_after_s = stall_after_s
        self.max_world_size = max_world_size
        self._job = job
        self._pinned = job is not None
        self._world_size: int | None = None
        self._restart: int | None = None
        self._ranks: dict[int, RankState] = {}
        self._lock = threading.Lock()
        """held while a rank is added or the table emptied (the loop) and while ``/metrics`` copies it"""
        metrics.rank_gauges.follow(self.rows)
        self._finished_said = 0
        """the finished count last logged (jobs of more than QUIET_ABOVE_RANKS ranks)"""

    @property
    def job(self) -> str | None:
        """the job served, or None before the first hello of an unpinned table"""
        return self._job

    @property
    def world_size(self) -> int | None:
        """the world size of the incarnation served, or None before its first hello"""
        return self._world_size

    @property
    def restart(self) -> int | None:
        """the restart count (TORCHELASTIC_RESTART_COUNT) of the incarnation served, or None when its
        ranks did not say it"""
        return self._restart

    def __len__(self) -> int:
        return len(self._ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self._ranks

    def hello(self, sender: str, routing_id: Route, body: dict[str, Any], at: Instant) -> Hello:
        """A rank's hello: admit its job incarnation, bind the rank to ``sender``. Raises
        ProtocolError (``wrong_job``, ``out_of_range``) when it is refused; nothing changes then."""
        rank, world_size = body["rank"], body["world_size"]
        if world_size > self.max_world_size:
            raise ProtocolError(f"hello of rank {rank} declares a world size of {world_size}, over this "
                                f"coordinator's --max-world-size {self.max_world_size}", reason="out_of_range")
        if rank >= world_size:
            raise ProtocolError(f"hello of rank {rank} in a world of {world_size}", reason="out_of_range")
        state = self._ranks.get(rank)
        admission = self._admit(body["job"], world_size, body.get("restart"),
                                new_session=state is None or state.sender != sender)
        state = self._ranks.get(rank)  # None again when a new incarnation emptied the table
        new_session = state is None or state.sender != sender
        if state is None:
            state = RankState(rank, routing_id, sender, step_changed_at=at.mono)
            with self._lock:
                self._ranks[rank] = state
            known = len(self._ranks)
            shown = world_size <= QUIET_ABOVE_RANKS or known == world_size or known & (known - 1) == 0
            log.log(logging.INFO if shown else logging.DEBUG, "rank %d registered (%d of %d known)", rank,
                    known, world_size)
        elif new_session:
            log.info("rank %d is a new process (pid %s on %s, was pid %s)", rank, body["pid"], body["host"],
                     state.pid)
            state.sender = sender
            state.dropped = 0  # (its own count of dropped events starts from zero)
        # one string object for each host and device name, not one a rank and message (8 ranks a host)
        state.host, state.pid, state.world_size = sys.intern(body["host"]), body["pid"], world_size
        state.device = sys.intern(body["device"])
        state.finished = state.failed = False
        self.seen(state, routing_id, at)
        return Hello(state, new_session, admission)

    def _admit(self, job: str, world_size: int, restart: int | None, *, new_session: bool) -> Admission:
        if self._world_size is None and (self._job is None or job == self._job):
            self._job, self._world_size, self._restart = job, world_size, restart
            log.info("job %s, world size %d%s", job, world_size, "" if restart is None else f", restart {restart}")
            return Admission.ACCEPTED
        if job == self._job and world_size == self._world_size:
            return self._launch(restart, new_session)
        if self._pinned and job != self._job:
            raise ProtocolError(f"hello of job {job!r}, but this coordinator serves only job {self._job!r}",
                                reason="wrong_job")
        if not self._ended():
            raise ProtocolError(f"hello of job {job!r} with world size {world_size}, but this coordinator "
                                f"serves job {self._job!r} of world size {self._world_size} and it still has "
                                "ranks alive", reason="wrong_job")
        log.info("job %s (world size %s) ended: every rank dead, failed or finished; job %s of world size "
                 "%d starts", self._job, self._world_size, job, world_size)
        return self._replace(job, world_size, restart)

    def _launch(self, restart: int | None, new_session: bool) -> Admission:
        """What a hello of the job and world size served, with ``restart``, makes of the incarnation."""
        served = self._restart
        if restart is None or not new_session:  # not said, or a process already registered reconnects
            return Admission.ACCEPTED
        if served is None:  # ranks that did not say it before: nothing to compare with
            self._restart = restart
            return Admission.ACCEPTED
        if restart > served:  # (torchrun ends every worker first, though some may not have said bye)
            log.info("job %s: torchrun restarted its workers (restart %d, was %d)", self._job, restart, served)
            self._restart = restart
            return Admission.RESTARTED
        # an empty table is one restored from the state file: its ranks reconnect, not a new launch
        if restart == served and (not self._ranks or not self._ended()):
            return Admission.ACCEPTED
        if not self._ended():  # as for another job: a rank's word must not end a launch that lives
            raise ProtocolError(f"hello of a new launch of job {self._job!r} (restart {restart}), but the launch "
                                f"served (restart {served}) still has ranks alive", reason="wrong_job")
        log.info("job %s: a new launch (restart %d) replaces the one served (restart %d), every rank of which "
                 "ended", self._job, restart, served)
        return self._replace(self._job, self._world_size, restart)

    def _ended(self) -> bool:
        return all(r.finished or r.failed or not r.alive for r in self._ranks.values())

    def _replace(self, job: str, world_size: int, restart: int | None) -> Admission:
        self.metrics.new_job()
        with self._lock:
            self._ranks.clear()
        self._job, self._world_size, self._restart = job, world_size, restart
        return Admission.NEW_JOB

    def restore(self, job: str, world_size: int, restart: int | None = None) -> bool:
        """Serve the incarnation ``job`` of ``world_size`` ranks (launch ``restart``) that an earlier
        coordinator served (its state file); False, with nothing changed, when this table is pinned to
        another job."""
        if self._pinned and job != self._job:
            return False
        self._job, self._world_size, self._restart = job, world_size, restart
        return True

    def speaker(self, rank: int, sender: str) -> RankState:
        """The state of ``rank`` when ``sender`` is the session registered for it; else raises
        ProtocolError(``unregistered``): a message for a rank must follow that process's hello."""
        state = self._ranks.get(rank)
        if state is None or state.sender != sender:
            raise ProtocolError(f"a message for rank {rank} from {sender}, which did not say hello as "
                                f"rank {rank} to this coordinator instance", reason="unregistered")
        return state

    def seen(self, state: RankState, routing_id: Route, at: Instant) -> None:
        """The rank is heard from at ``at``, over the connection ``routing_id``."""
        if not state.alive and not state.finished and not state.failed:
            log.info("rank %d is back after %.0f s of silence", state.rank, at.mono - state.heard_at)
        state.routing_id = routing_id
        state.last_seen, state.heard_at = at.wall, at.mono
        state.alive = not state.failed and not state.finished

    def heartbeat(self, state: RankState, body: dict[str, Any], at: Instant) -> None:
        state.host, state.pid = sys.intern(body["host"]), body["pid"]
        if body["step"] != state.step:
            state.step, state.step_changed_at = body["step"], at.mono
        state.step_time_s, state.grad_norm = body["step_time_s"], body["grad_norm"]
        # the rank's own running count: the counter grows by the increase (a count below the last
        # one is a process that counts from zero again)
        last, state.dropped = state.dropped, body["dropped"]
        increase = state.dropped - last if state.dropped >= last else state.dropped
        if increase:
            self.metrics.dropped(state.rank, increase)

    def bye(self, state: RankState, clean: bool, at: Instant) -> None:
        """The rank's process ends: cleanly (finished), or by an error (failed: not alive from now
        on, without waiting ``dead_after_s``)."""
        state.finished, state.failed, state.alive, state.stalled = clean, not clean, False, False
        if clean:
            log.log(logging.INFO if (self._world_size or 0) <= QUIET_ABOVE_RANKS else logging.DEBUG,
                    "rank %d finished", state.rank)
        else:
            log.warning("rank %d ended without a clean exit (an error ended its process, or it was torn "
                        "down after another rank's failure): it is not alive from now on", state.rank)

    def unfinished(self) -> list[RankState]:
        """Registered ranks that have not said ``bye``: those a stop command goes to."""
        return [state for state in self._ranks.values() if not state.finished and not state.failed]

    def tick(self, at: Instant) -> None:
        """Recompute who is alive and stalled, and the rank-count gauges."""
        alive = stalled = finished = failed = 0
        for state in self._ranks.values():
            was_alive = state.alive
            silent_s = at.mono - state.heard_at
            state.alive = not state.finished and not state.failed and silent_s <= self.dead_after_s
            state.stalled = state.alive and at.mono - state.step_changed_at > self.stall_after_s
            if was_alive and not state.alive:
                log.warning("rank %d is dead: nothing heard for %.0f s", state.rank, silent_s)
            alive += state.alive
            stalled += state.stalled
            finished += state.finished
            failed += state.failed
        self.metrics.ranks(registered=len(self._ranks), alive=alive, stalled=stalled, finished=finished,
                           failed=failed)
        if finished != self._finished_said and (self._world_size or 0) > QUIET_ABOVE_RANKS:
            log.info("%d of %d ranks finished", finished, self._world_size)
        self._finished_said = finished

    def rows(self) -> list[RankState]:
        """The ranks of the incarnation served, as one snapshot (any thread: ``/metrics`` reads it)."""
        with self._lock:
            return list(self._ranks.values())

    def status(self) -> list[dict[str, Any]]:
        """The ``ranks`` of a ``status`` reply, by rank number."""
        return [self._ranks[rank].status() for rank in sorted(self._ranks)]

    def status_json(self, before: str = "", after: str = "") -> str:
        """``status()`` as JSON, between ``before`` and ``after`` (the reply's other fields) in one
        string, written a row at a time: at 16,384 ranks the list of dicts would be ~15 MB made and
        dropped for each request, and each copy of the text is 4 MB more."""
        encode = _STATUS_ENCODER.encode
        rows = [encode(self._ranks[rank].status()) for rank in sorted(self._ranks)]
        if not rows:
            return f"{before}[]{after}"
        rows[0] = f"{before}[{rows[0]}"
        rows[-1] = f"{rows[-1]}]{after}"  # (the same row when there is one)
        return ",".join(rows)
