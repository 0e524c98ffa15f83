"""Who may say what to the coordinator: the message handlers with real codecs, a recording reply
function in place of the socket, and hand-made clock readings."""

import pytest
from prometheus_client import CollectorRegistry

from nanguard import ProtocolError
from nanguard.coordinator.clock import Instant
from nanguard.coordinator.handlers import Handlers
from nanguard.coordinator.metrics import Metrics
from nanguard.coordinator.policy import Policy
from nanguard.coordinator.ranks import RankTable
from nanguard.coordinator.stop import StopFanout
from nanguard.wire import Codec

INSTANCE = "coordinator@h:1:aa"
AT = Instant(1_700_000_000.0, 100.0)
HELLO = {"rank": 0, "local_rank": 0, "world_size": 2, "host": "h", "pid": 1, "job": "job1", "device": "cpu",
         "version": "t"}


class Coordinator:
    """The handlers of a coordinator holding ``token`` and ``operator_token``; ``replies`` and
    ``stops`` record what it sends back and to the ranks."""

    def __init__(self, token=None, operator_token=None):
        self.registry = CollectorRegistry()
        metrics = Metrics(self.registry)
        self.codec = Codec(INSTANCE, token, operator_token=operator_token)
        self.ranks = RankTable(metrics)
        self.stops_sent = []
        stops = StopFanout(self.ranks, metrics, lambda t, body, to: [body.encode()],
                           lambda messages: self.stops_sent.extend(messages))
        self.replies = []
        self.handlers = Handlers(ranks=self.ranks, stops=stops, policy=Policy(), metrics=metrics,
                                 reply=lambda identity, message, type_, body: self.replies.append((type_, body)),
                                 operator_gate=token is not None or operator_token is not None,
                                 sync_soon=lambda: None)

    def receive(self, sender: Codec, type_, body, to=INSTANCE, identity=b"\x00peer"):
        self.handlers.handle(self.codec.decode(sender.encode(type_, body, to=to)), identity, AT)

    def refused(self, reason, *args, **kwargs):
        with pytest.raises(ProtocolError) as info:
            self.receive(*args, **kwargs)
        assert info.value.reason == reason, info.value
        return info.value


def test_a_handshake_is_answered_and_changes_nothing():
    coordinator = Coordinator()
    rank = Codec("rank0@h:1:s1", None)
    coordinator.receive(rank, "handshake", {}, to="")
    assert coordinator.replies == [("welcome", {"handshake_seq": 1})]
    assert len(coordinator.ranks) == 0 and coordinator.ranks.job is None


def test_rank_messages_need_that_rank_sessions_hello():
    coordinator = Coordinator(token="ranks")
    rank, other = Codec("rank0@h:1:s1", "ranks"), Codec("rank1@h:2:s2", "ranks")
    beat = {"rank": 0, "world_size": 2, "job": "job1", "host": "h", "pid": 1, "step": 3, "step_time_s": None,
            "dropped": 0, "grad_norm": None}
    coordinator.refused("unregistered", rank, "heartbeat", beat)
    coordinator.receive(rank, "hello", HELLO)
    coordinator.receive(rank, "heartbeat", beat)
    coordinator.refused("unregistered", other, "heartbeat", beat)  # rank 1 speaking for rank 0
    coordinator.refused("unregistered", other, "bye", {"rank": 0, "job": "job1", "clean": True})
    assert coordinator.ranks.status()[0]["step"] == 3


def test_a_stop_needs_the_operator_credential():
    coordinator = Coordinator(token="ranks", operator_token="operators")
    rank, operator = Codec("rank0@h:1:s1", "ranks"), Codec("operator@h:3:s3", operator_token="operators")
    coordinator.receive(rank, "hello", HELLO)
    error = coordinator.refused("forbidden", rank, "stop_request", {"reason": "a rank says so"})
    assert "without the operator credential" in str(error)
    assert coordinator.replies[-1][0] == "refused" and "NANGUARD_OPERATOR_TOKEN" in coordinator.replies[-1][1]["reason"]
    assert coordinator.handlers.stops.command is None and coordinator.stops_sent == []
    # a rank may read the status; an operator may stop
    coordinator.receive(rank, "status_request", {})
    assert coordinator.replies[-1][0] == "status"
    coordinator.receive(operator, "stop_request", {"reason": "maintenance"})
    assert coordinator.replies[-1][0] == "stop_accepted"
    assert coordinator.handlers.stops.command.origin == "operator" and len(coordinator.stops_sent) == 1


def test_operators_are_not_ranks():
    coordinator = Coordinator(token="ranks", operator_token="operators")
    operator = Codec("operator@h:3:s3", operator_token="operators")
    coordinator.refused("forbidden", operator, "hello", HELLO)
    assert len(coordinator.ranks) == 0


@pytest.mark.parametrize("token, operator_token", [(None, "operators"), ("ranks", None)])
def test_without_the_operator_token_nobody_stops(token, operator_token):
    coordinator = Coordinator(token=token, operator_token=operator_token)
    coordinator.refused("forbidden", Codec("anyone", token), "stop_request", {"reason": "x"})


def test_with_no_secret_at_all_anyone_who_reaches_the_port_may_stop():
    coordinator = Coordinator()  # loopback or --insecure, and the README says so
    coordinator.receive(Codec("anyone", None), "stop_request", {"reason": "x"})
    assert coordinator.replies[-1][0] == "stop_accepted"


def test_a_rank_cannot_claim_an_operator_stop_but_its_nonfinite_stop_stops_the_job():
    coordinator = Coordinator(token="ranks", operator_token="operators")
    zero, one = Codec("rank0@h:1:s1", "ranks"), Codec("rank1@h:2:s2", "ranks")
    coordinator.receive(zero, "hello", HELLO)
    coordinator.receive(one, "hello", dict(HELLO, rank=1, pid=2))
    for reason in ("operator", "policy"):
        coordinator.receive(zero, "stopped", {"rank": 0, "job": "job1", "step": 5, "reason": reason})
    assert coordinator.handlers.stops.command is None
    coordinator.receive(one, "stopped", {"rank": 1, "job": "job1", "step": 5, "reason": "nonfinite"})
    command = coordinator.handlers.stops.command
    assert (command.origin, command.reason) == ("policy", "rank 1 stopped at step 5 (nonfinite)")
    assert coordinator.registry.get_sample_value("nanguard_stops_total", {"reason": "nonfinite"}) == 1
    assert coordinator.registry.get_sample_value("nanguard_stops_total", {"reason": "operator"}) == 0


def test_events_count_under_the_sending_rank_whatever_they_say():
    coordinator = Coordinator()
    rank = Codec("rank0@h:1:s1", None)
    coordinator.receive(rank, "hello", HELLO)
    event = {"kind": "spike", "rank": 1, "step": 3, "layer": ""}
    coordinator.receive(rank, "events", {"rank": 0, "job": "job1", "events": [event], "action": "warn"})
    assert coordinator.registry.get_sample_value("nanguard_warning_events_total", {"kind": "spike", "rank": "0"}) == 1
    assert coordinator.registry.get_sample_value("nanguard_warning_events_total", {"kind": "spike", "rank": "1"}) is None


def test_an_evaluations_events_are_counted_apart_and_never_stop_the_job():
    coordinator = Coordinator()  # default policy: the first stop-kind event of a training step stops
    rank = Codec("rank0@h:1:s1", None)
    coordinator.receive(rank, "hello", HELLO)
    forward = {"kind": "forward", "rank": 0, "step": 3, "layer": "head"}
    coordinator.receive(rank, "events", {"rank": 0, "job": "job1", "events": [forward, forward], "action": "observe"})
    sample = coordinator.registry.get_sample_value
    assert sample("nanguard_evaluation_events_total", {"kind": "forward", "rank": "0"}) == 2
    assert sample("nanguard_nonfinite_events_total", {"kind": "forward", "rank": "0"}) is None
    assert coordinator.handlers.stops.command is None
    coordinator.receive(rank, "events", {"rank": 0, "job": "job1", "events": [forward], "action": "raise"})
    assert sample("nanguard_nonfinite_events_total", {"kind": "forward", "rank": "0"}) == 1
    assert coordinator.handlers.stops.command is not None  # a training step's event still stops it


def test_types_that_do_not_travel_to_the_coordinator_are_unexpected():
    coordinator = Coordinator()
    coordinator.refused("unexpected", Codec("x", None), "stop", {"command_id": "c", "reason": "r", "origin": "operator"})
    coordinator.refused("unexpected", Codec("x", None), "welcome", {"handshake_seq": 1})


def test_events_a_re_run_did_not_reproduce_count_under_the_ranks_host_and_their_device():
    coordinator = Coordinator()
    rank = Codec("rank0@h:1:s1", None)
    coordinator.receive(rank, "hello", HELLO)

    def event(**fields):
        return {"kind": "grad", "rank": 0, "step": 3, "layer": "w", "has_nan": True, **fields}

    events = [event(reproduced=False, verdict="transient", device="cuda:0 GPU-1", host="somewhere-else"),
              event(reproduced=None, verdict="device", device="cuda:0 GPU-1"),
              event(reproduced=False),  # no device named: the one its hello named
              event(reproduced=True, verdict="reproducible", device="cuda:0 GPU-1"),
              event(reproduced=None, device="cuda:0 GPU-1"), event()]
    coordinator.receive(rank, "events", {"rank": 0, "job": "job1", "events": events, "action": "skip"})
    sample = coordinator.registry.get_sample_value
    assert sample("nanguard_transient_events_total", {"host": "h", "device": "cuda:0 GPU-1"}) == 2
    assert sample("nanguard_transient_events_total", {"host": "h", "device": "cpu"}) == 1
    assert sample("nanguard_transient_events_total", {"host": "somewhere-else", "device": "cuda:0 GPU-1"}) is None
    assert sample("nanguard_nonfinite_events_total", {"kind": "grad", "rank": "0"}) == 6


def test_numbered_events_are_answered_and_counted_once_whatever_is_sent_again():
    """A batch that says its ``first`` number is answered with ``received``; what the coordinator
    holds already (sent again after a lost answer or a reset connection) counts once; a gap (events
    the rank gave up on, which its heartbeat counts) is no reason to refuse the rest; a new process
    for the rank numbers from 0 again; a batch without ``first`` (an earlier release) gets no answer."""
    coordinator = Coordinator()
    rank = Codec("rank0@h:1:s1", None)
    coordinator.receive(rank, "hello", HELLO)
    assert coordinator.replies.pop() == ("received", {"rank": 0, "events": 0})  # let in
    sample = coordinator.registry.get_sample_value
    spike = {"kind": "spike", "rank": 0, "step": 1, "layer": ""}

    def batch(first, count, sender=rank):
        coordinator.receive(sender, "events", {"rank": 0, "job": "job1", "events": [spike] * count, "action": "warn",
                                               "first": first})
        return coordinator.replies.pop()

    assert batch(0, 3) == ("received", {"rank": 0, "events": 3})
    assert batch(0, 3) == ("received", {"rank": 0, "events": 3})  # the answer was lost: sent again
    assert batch(1, 4) == ("received", {"rank": 0, "events": 5})  # overlaps: two are new
    assert batch(9, 1) == ("received", {"rank": 0, "events": 10})  # 5 to 8 were dropped on the rank
    assert coordinator.ranks.status()[0]["events"] == 6
    assert sample("nanguard_warning_events_total", {"kind": "spike", "rank": "0"}) == 6
    restarted = Codec("rank0@h:7:s9", None)
    coordinator.receive(restarted, "hello", dict(HELLO, pid=7))
    assert coordinator.replies.pop() == ("received", {"rank": 0, "events": 0})  # a new process holds none
    assert batch(0, 2, restarted) == ("received", {"rank": 0, "events": 2})
    coordinator.receive(restarted, "events", {"rank": 0, "job": "job1", "events": [spike], "action": "warn"})
    assert coordinator.replies == [] and coordinator.ranks.status()[0]["events"] == 9


def test_a_heartbeat_that_asks_is_answered_with_what_its_session_holds():
    """A rank that heard nothing for a while asks in its heartbeat (no ZeroMQ pings: wire.py says
    why); the answer is the ``received`` of its own session, 0 for a new process."""
    coordinator = Coordinator()
    rank = Codec("rank0@h:1:s1", None)
    coordinator.receive(rank, "hello", HELLO)
    assert coordinator.replies.pop() == ("received", {"rank": 0, "events": 0})  # the hello's answer
    beat = {"rank": 0, "world_size": 2, "job": "job1", "host": "h", "pid": 1, "step": 3, "step_time_s": None,
            "dropped": 0, "grad_norm": None}
    coordinator.receive(rank, "heartbeat", beat)
    coordinator.receive(rank, "heartbeat", dict(beat, answer=False))
    assert coordinator.replies == []  # a heartbeat that does not ask gets nothing
    coordinator.receive(rank, "heartbeat", dict(beat, answer=True))
    assert coordinator.replies.pop() == ("received", {"rank": 0, "events": 0})
    coordinator.receive(rank, "events", {"rank": 0, "job": "job1", "first": 0, "action": "warn",
                                         "events": [{"kind": "spike", "rank": 0, "step": 1, "layer": ""}] * 2})
    coordinator.receive(rank, "heartbeat", dict(beat, answer=True))
    assert coordinator.replies[-1] == ("received", {"rank": 0, "events": 2})
    restarted = Codec("rank0@h:7:s9", None)
    coordinator.receive(restarted, "hello", dict(HELLO, pid=7))
    coordinator.receive(restarted, "heartbeat", dict(beat, pid=7, answer=True))
    assert coordinator.replies[-1] == ("received", {"rank": 0, "events": 0})
    coordinator.refused("schema", rank, "heartbeat", dict(beat, answer="yes"))
