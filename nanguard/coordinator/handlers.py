"""What each message does once it is decoded, authenticated, addressed to this instance and new.

    rank -> coordinator       handshake, hello, heartbeat, events, captured, stopped, ack, bye
    operator -> coordinator   handshake, status_request, stop_request, clear_request

A batch of events that says its ``first`` number is answered with ``received`` (how many of the
rank session's events this coordinator holds), and what it already holds is dropped, so a batch
sent again after a lost answer or a reset connection counts once (``wire.py``, delivery).

A handler refuses a message by raising ProtocolError with the reason it is counted under
(``protocol.BAD_MESSAGE_REASONS``); the server counts it and nothing else happens. Who may send
what: a ``handshake`` anyone with a valid credential; rank messages a rank (``Message.role`` is
``rank``, or None where ranks need no token), and only for the rank whose session said hello
(``RankTable.speaker``); ``status_request`` a rank or an operator; ``stop_request`` and
``clear_request`` only an operator, or anyone where the coordinator holds no secret at all (loopback
or --insecure).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from ..errors import ProtocolError
from ..protocol import OBSERVED
from ..wire import Message
from .clock import Instant
from .metrics import Metrics
from .policy import Policy
from .ranks import Admission, RankTable
from .stop import StopCommand, StopFanout

if TYPE_CHECKING:
    from ..relay import Route

log = logging.getLogger("nanguard.coordinator")

Reply = Callable[[bytes, Message, str, "dict[str, Any] | str"], None]
"""answers ``message`` (from the connection ``routing id``) with a message of a type and body (a str:
the body already serialised as JSON)"""

RANK_TYPES = frozenset(("hello", "heartbeat", "events", "captured", "stopped", "ack", "bye"))
_NOT_REPRODUCED_VERDICTS = frozenset(("device", "transient"))
"""the ``protocol.VERDICTS_IN_JOB`` that blame the rank's device (bad again there, clean on a peer's) or
chance (clean when re-run): with ``reproduced`` false, what ``nanguard_transient_events_total`` counts"""
_NO_OPERATOR_TOKEN = ("{} needs the operator credential: set NANGUARD_OPERATOR_TOKEN on the "
                      "coordinator and in the operator's environment (ranks never hold it)")


class Handlers:
    """The state the messages change: the rank table, the stop fan-out, the policy, the metrics.

    ``operator_gate``: True when this coordinator holds any secret, so that a ``stop_request``
    needs the operator's credential; ``sync_soon``: called when a stop is decided (the event log
    then reaches the disk at once).
    """

    def __init__(self, *, ranks: RankTable, stops: StopFanout, policy: Policy, metrics: Metrics,
                 reply: Reply, operator_gate: bool, sync_soon: Callable[[], None]):
        self.ranks, self.stops, self.policy, self.metrics = ranks, stops, policy, metrics
        self._reply = reply
        self._operator_gate = operator_gate
        self._sync_soon = sync_soon
        self._rank_handlers = {
            "captured": self._on_captured,
            "stopped": self._on_stopped, "ack": self._on_ack, "bye": self._on_bye,
        }
        self._held: dict[int, tuple[str, int]] = {}
        """rank -> (its session, how many of that session's numbered events are held): what
        ``received`` answers; one entry per rank, forgotten with its job"""

    def handle(self, message: Message, identity: Route, at: Instant) -> None:
        """Apply ``message``, which came over the connection ``identity``; ProtocolError refuses it."""
        type_ = message.type
        if type_ == "handshake":
            # no state changes: the peer learns which instance to address (its next messages bind to it)
            self._reply(identity, message, "welcome", {"handshake_seq": message.seq})
        elif type_ in RANK_TYPES:
            if message.role == "operator":
                raise ProtocolError(f"a {type_} message signed with the operator token: operators are not "
                                    "ranks", reason="forbidden")
            if type_ == "hello":
                self._on_hello(message, identity, at)
            else:
                state = self.ranks.speaker(message.body["rank"], message.sender)
                self.ranks.seen(state, identity, at)
                if type_ == "events":
                    self._on_batch(state, message, identity, at)
                elif type_ == "heartbeat":
                    self._on_heartbeat(state, message, identity, at)
                else:
                    self._rank_handlers[type_](state, message.body, at)
        elif type_ == "status_request":
            # the body as text, the ranks written a row at a time (``RankTable.status_json``)
            job, stop = (json.dumps(value, separators=(",", ":"), allow_nan=False)
                         for value in (self.ranks.job, self.stops.status()))
            body = self.ranks.status_json(f'{{"job":{job},"ranks":', f',"stop":{stop}}}')
            self._reply(identity, message, "status", body)
        elif type_ == "stop_request":
            self._on_stop_request(message, identity, at)
        elif type_ == "clear_request":
            self._on_clear_request(message, identity)
        else:
            raise ProtocolError(f"a {type_} message does not travel to the coordinator", reason="unexpected")

    def begin_stop(self, origin: str, reason: str, label: str, at: Instant) -> tuple[StopCommand, bool]:
        command, made = self.stops.begin(origin, reason, label, at)
        if made:
            self._sync_soon()
        return command, made

    def _on_hello(self, message: Message, identity: Route, at: Instant) -> None:
        hello = self.ranks.hello(message.sender, identity, message.body, at)
        if self.stops.admitted(hello.admission):  # a new incarnation, and a standing stop lifted for it
            self.policy.reset()
        if hello.admission is Admission.NEW_JOB:
            self.stops.reset()
            self.policy.reset()
            self._held.clear()
        if hello.new_session:
            self.stops.registered(hello.state, at)
        # the answer lets the rank know it is in (one refused asks again: client.py)
        self._reply(identity, message, "received", {"rank": hello.state.rank, "events": self._holding(hello.state)})

    def _on_heartbeat(self, state, message: Message, identity: Route, at: Instant) -> None:
        self.ranks.heartbeat(state, message.body, at)
        if message.body.get("answer"):
            # the rank has heard nothing from here for a while: an answer shows it the link carries
            # both ways (else it makes a new connection)
            self._reply(identity, message, "received", {"rank": state.rank, "events": self._holding(state)})

    def _holding(self, state) -> int:
        """How many of the numbered events of this rank's session this coordinator holds."""
        session, held = self._held.get(state.rank, (state.sender, 0))
        return held if session == state.sender else 0  # another session: a new process, numbered from 0

    def _on_batch(self, state, message: Message, identity: Route, at: Instant) -> None:
        """An ``events`` message: the events this coordinator does not hold yet, and, for a numbered
        batch, the answer that says how many it holds."""
        body = message.body
        first, events = body.get("first"), body["events"]
        if first is None:  # a rank of an earlier release: nothing to answer, nothing to tell apart
            self._on_events(state, events, body.get("action"), at)
            return
        held = self._holding(state)
        # below ``held``: sent again after an answer was lost; above it: numbers the rank gave up
        # on (its queue was full), which its heartbeat counts as dropped
        new = events[max(0, held - first):]
        if new:
            self._on_events(state, new, body.get("action"), at)
        else:
            log.debug("rank %d sent events %d to %d again; already held", state.rank, first, first + len(events) - 1)
        held = max(held, first + len(events))
        self._held[state.rank] = (state.sender, held)
        self._reply(identity, message, "received", {"rank": state.rank, "events": held})

    def _on_events(self, state, events: list[dict[str, Any]], action: str | None, at: Instant) -> None:
        state.events += len(events)
        kinds = Counter(map(itemgetter("kind"), events))
        # a rank speaks for itself: its events count under its own rank, whatever they say inside
        evaluation = action == OBSERVED  # an evaluation's: counted apart, never a reason to stop
        self.metrics.events({(kind, state.rank): count for kind, count in kinds.items()}, evaluation)
        transients = Counter(
            event.get("device") or state.device for event in events
            if event.get("reproduced") is False or event.get("verdict") in _NOT_REPRODUCED_VERDICTS)
        for device, count in transients.items():
            # the host the rank registered with, as its rank label: a rank speaks for itself
            self.metrics.transient(state.host, device, count, world_size=self.ranks.world_size)
        if not evaluation and self.stops.command is None and not self.policy.stop_kinds.isdisjoint(kinds):
            for event in events:
                decision = self.policy.observe(event["kind"], state.rank, event["step"], event["layer"],
                                               action, at.wall)
                if decision is not None:
                    self.begin_stop("policy", decision.reason, decision.label, at)
                    break

    def _on_captured(self, state, body: dict[str, Any], at: Instant) -> None:
        self.metrics.incident(body["incident"])
        log.info("rank %d captured step %d into %s", state.rank, body["step"], body["incident"])

    def _on_stopped(self, state, body: dict[str, Any], at: Instant) -> None:
        reason = body["reason"]
        log.info("rank %d stopped at step %d (%s)", state.rank, body["step"], reason)
        if self.stops.command is not None:
            return
        if reason == "nonfinite":
            # the ranks decided on a non-finite value they saw themselves: tell every other rank too
            self.begin_stop("policy", f"rank {state.rank} stopped at step {body['step']} (nonfinite)",
                            "nonfinite", at)
        else:
            # a command this instance never issued (an earlier instance's, which reached every rank
            # through their all-reduce): a rank's word alone never makes a policy or operator stop
            log.info("rank %d reports a %s stop that this coordinator instance did not issue; no new stop",
                     state.rank, reason)

    def _on_ack(self, state, body: dict[str, Any], at: Instant) -> None:
        self.stops.ack(state.rank, body["command_id"])

    def _on_bye(self, state, body: dict[str, Any], at: Instant) -> None:
        self.ranks.bye(state, body["clean"], at)

    def _operator_only(self, message: Message, identity: Route, what: str) -> None:
        """Refuse (``forbidden``, and a ``refused`` answer) a request without the operator credential."""
        if message.role != "operator" and (self._operator_gate or message.role is not None):
            self._reply(identity, message, "refused", {"reason": _NO_OPERATOR_TOKEN.format(what)})
            raise ProtocolError(f"a {message.type} from {message.sender} without the operator credential",
                                reason="forbidden")

    def _on_stop_request(self, message: Message, identity: Route, at: Instant) -> None:
        self._operator_only(message, identity, "stopping a job")
        command, made = self.begin_stop("operator", message.body["reason"], "operator", at)
        self._reply(identity, message, "stop_accepted", {"command_id": command.command_id, "existing": not made})

    def _on_clear_request(self, message: Message, identity: Route) -> None:
        self._operator_only(message, identity, "lifting a job's stop")
        command = self.stops.clear()
        if command is None:
            log.info("operator %s asked to lift the job's stop, but none stands (%s)", message.sender,
                     message.body["reason"])
        else:
            self.policy.reset()
            log.warning("operator %s lifted the stop of %s (command %s: %s): %s; ranks that register from now "
                        "on run", message.sender, command.incarnation, command.command_id, command.reason,
                        message.body["reason"])
        self._reply(identity, message, "cleared", {"command_id": None if command is None else command.command_id})
