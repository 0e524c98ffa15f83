"""Stop commands and their fan-out: one command per job, sent to every rank until it acks.

    coordinator -> rank   stop  {command_id, reason, origin}
    rank -> coordinator   ack   {rank, command_id}

Whoever asks first (the policy, an operator, a rank's ``stopped`` report) begins the job's stop;
it is counted once in ``nanguard_stops_total`` and later requests get the same command. It goes
at once to every registered rank that has not said ``bye``, again to those that have not acked
(a message can be lost while a rank reconnects) after ``resend_s``, then after twice as long each
time up to ``MAX_RESEND_S`` (16,384 ranks that ack slowly must not get 16,384 signed copies five
times a second), and to every rank session that registers later (a restarted rank must stop too). Each copy is addressed to the session of
its rank (``to``), so none can be played to another rank or a later run. The socket stays the
server's: sending is a function passed in.

A stop holds for the incarnation it stopped (``ranks.py``: the job id, its world size, its launch).
What a new incarnation gets (``admitted``): a torchrun restart of the stopped launch the stop again
(``on_restart="stop"``, the default: the restart would replay the steps that went non-finite) or a
run (``"run"``); a new launch, or another job, always runs. An operator lifts a standing stop with
``clear`` (``nanguard clear``).
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from .clock import Instant, require_positive
from .metrics import Metrics
from .ranks import Admission, RankState, RankTable

log = logging.getLogger("nanguard.coordinator")

FIRST_RANKS = 8
"""ranks a stop goes to before every other: those heard from last. Under torch.distributed each rank
all-reduces the stop flag at its next step, so the job stops as soon as one of them has it; eight
recent ones, not the first eight rank numbers, so that a dead or stalled rank cannot hold it up (the
rest follow in the same pass, and the resends reach any that missed it)"""
ON_RESTART = ("stop", "run")
"""what a torchrun restart of a stopped launch gets (``--on-restart``)"""
MAX_RESEND_S = 2.0
"""the longest wait between two copies of the stop to a rank that has not acked"""

Encode = Callable[[str, str, str], list[bytes]]
"""a message's frames from its type, its body already serialised and the session it is for
(``wire.Codec.encode_json`` signed with the ranks' key)"""
Send = Callable[[Iterable[tuple[bytes, list[bytes]]]], None]
"""sends each (routing id, frames) pair, in order, as it comes"""


@dataclass(slots=True)
class StopCommand:
    command_id: str
    origin: str
    """policy | operator"""
    reason: str
    time: float
    """wall clock of the decision (shown in ``status``)"""
    counted_as: str = "policy"
    """the reason ``nanguard_stops_total`` counts it under (``STOP_REASONS``)"""
    acked: set[int] = field(default_factory=set)
    job: str | None = None
    """the job it stopped (None: decided before any rank said hello)"""
    restart: int | None = None
    """the restart count of the launch it stopped (None: its ranks did not say it)"""

    def status(self) -> dict[str, Any]:
        """The ``stop`` of a ``status`` reply (coordinator -> operator)."""
        return {"command_id": self.command_id, "origin": self.origin, "reason": self.reason,
                "time": self.time, "acked": sorted(self.acked), "counted_as": self.counted_as,
                **({} if self.job is None else {"job": self.job, "restart": self.restart})}

    @property
    def incarnation(self) -> str:
        """The incarnation it stopped, in words."""
        return f"job {self.job}" + ("" if self.restart is None else f" restart {self.restart}")


class StopFanout:
    """The current job's stop command, if any, and who still has to ack it."""

    def __init__(self, ranks: RankTable, metrics: Metrics, encode: Encode, send: Send, *,
                 resend_s: float = 0.2, on_restart: str = "stop"):
        require_positive(resend_s=resend_s)
        if on_restart not in ON_RESTART:
            raise ValueError(f"on_restart={on_restart!r} must be one of {', '.join(ON_RESTART)}")
        self.resend_s = resend_s
        self.on_restart = on_restart
        self.command: StopCommand | None = None
        self.next_resend = math.inf
        """monotonic time when unacked ranks get the command again (inf: none pending)"""
        self._wait_s = resend_s
        """the wait before the next resend: doubles after each one, up to MAX_RESEND_S"""
        self._ranks = ranks
        self._metrics = metrics
        self._encode = encode
        self._send_messages = send

    def begin(self, origin: str, reason: str, label: str, at: Instant) -> tuple[StopCommand, bool]:
        """The job's stop command, and True when this call made it (counted under ``label``
        and sent to every unfinished rank); the existing command and False after that."""
        if self.command is not None:
            return self.command, False
        command = self.command = StopCommand(secrets.token_hex(8), origin, reason[:500], at.wall, label,
                                             job=self._ranks.job, restart=self._ranks.restart)
        self._wait_s = self.resend_s
        self._metrics.stop(label)
        targets = self._ranks.unfinished()
        started = time.perf_counter()
        self._send(targets, at)
        log.warning("stopping job %s (%s): %s; command %s sent to %d rank(s) in %.1f ms", self._ranks.job,
                    origin, reason, command.command_id, len(targets), (time.perf_counter() - started) * 1e3)
        return command, True

    def registered(self, state: RankState, at: Instant) -> None:
        """A rank session registered (a new rank, or a new process for one): it stops too if the
        job is stopping, and until it acks itself, an earlier process's ack does not count."""
        if self.command is not None:
            self.command.acked.discard(state.rank)
            self._send([state], at)

    def ack(self, rank: int, command_id: str) -> None:
        if self.command is not None and command_id == self.command.command_id:
            self.command.acked.add(rank)

    def resend_due(self, at: Instant) -> None:
        """Send the command again to unacked, unfinished ranks if ``resend_s`` has passed."""
        if at.mono < self.next_resend:
            return
        acked = self.command.acked
        pending = [state for state in self._ranks.unfinished() if state.rank not in acked]
        if pending:
            self._wait_s = min(max(self._wait_s * 2, self.resend_s), MAX_RESEND_S)
            self._send(pending, at)
        else:
            self.next_resend = math.inf

    def restore(self, command: StopCommand) -> None:
        """The job's stop as an earlier coordinator decided it: each rank that registers gets it
        (``registered``); it is not counted again."""
        self.command = command

    def admitted(self, admission: Admission) -> bool:
        """A hello made ``admission`` of the incarnation served: keep the standing stop for it or lift
        it, and say which at INFO; True when a stop was lifted (what else it held goes too)."""
        command = self.command
        if admission is Admission.ACCEPTED or command is None:
            return False
        now = f"job {self._ranks.job}" + ("" if self._ranks.restart is None else f" restart {self._ranks.restart}")
        if admission is Admission.RESTARTED and self.on_restart == "stop":
            log.info("the stop of %s (command %s: %s) holds for its torchrun restart, %s (--on-restart stop; "
                     "`nanguard clear` lifts it)", command.incarnation, command.command_id, command.reason, now)
            return False
        why = ("its torchrun restart, --on-restart run" if admission is Admission.RESTARTED
               else "a new launch" if self._ranks.job == command.job else "another job")
        log.info("the stop of %s (command %s) is lifted for %s (%s)", command.incarnation, command.command_id,
                 now, why)
        self.reset()
        return True

    def clear(self) -> StopCommand | None:
        """An operator lifts the standing stop: the command lifted, or None when none stood."""
        command = self.command
        self.reset()
        return command

    def reset(self) -> None:
        """A new job starts: it has not been stopped."""
        self.command = None
        self.next_resend = math.inf
        self._metrics.job_stopped.set(0)

    def status(self) -> dict[str, Any] | None:
        return None if self.command is None else self.command.status()

    def _send(self, targets: list[RankState], at: Instant) -> None:
        """The command to ``targets``, the FIRST_RANKS heard from last before the others, each
        encoded as it is sent (the first is on its way before the last is signed)."""
        if not targets:
            return
        command = self.command
        body = json.dumps({"command_id": command.command_id, "reason": command.reason,
                           "origin": command.origin}, separators=(",", ":"))
        encode = self._encode
        if len(targets) > FIRST_RANKS:
            first = heapq.nlargest(FIRST_RANKS, targets, key=attrgetter("heard_at"))
            chosen = {state.rank for state in first}
            targets = itertools.chain(first, (state for state in targets if state.rank not in chosen))
        self._send_messages((state.routing_id, encode("stop", body, state.sender)) for state in targets)
        self.next_resend = at.mono + self._wait_s
