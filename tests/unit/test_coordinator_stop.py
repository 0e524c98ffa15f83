"""The stop fan-out, with a recording send function in place of the ROUTER socket.

Sent frames are encoded by a real ``Codec`` and decoded back, so what is checked is what
would travel.
"""

import json
import logging

import pytest
from prometheus_client import CollectorRegistry

from nanguard.coordinator.clock import Instant
from nanguard.coordinator.metrics import Metrics
from nanguard.coordinator.ranks import RankTable
from nanguard.coordinator.stop import MAX_RESEND_S, StopFanout
from nanguard.protocol import STOP_REASONS
from nanguard.wire import Codec

RESEND_S = 0.2


def at(seconds: float) -> Instant:
    return Instant(1_700_000_000.0 + seconds, 100.0 + seconds)


class Sent:
    """The send function: records (routing id, decoded message) per message, each decoded by the
    session it is addressed to (as that rank would)."""

    def __init__(self):
        self.messages = []

    def __call__(self, messages):
        for routing_id, frames in messages:
            session = json.loads(frames[0])["to"]
            self.messages.append((routing_id, Codec(session, None).decode(frames)))

    def take(self) -> list[bytes]:
        """The routing ids sent to since the last take."""
        routing_ids = [routing_id for routing_id, _ in self.messages]
        self.messages.clear()
        return routing_ids


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def setup(registry):
    metrics = Metrics(registry)
    ranks = RankTable(metrics)
    sent = Sent()
    fanout = StopFanout(ranks, metrics, encoder(), sent, resend_s=RESEND_S)
    return ranks, fanout, sent


def encoder():
    codec = Codec("coordinator", None)
    return lambda type_, body_json, to: codec.encode_json(type_, body_json, to=to)


def register(ranks, *numbers, seconds=0.0):
    return [ranks.hello("session%d" % number, b"id%d" % number,
                        {"rank": number, "local_rank": 0, "world_size": 16, "host": "h", "pid": 1, "job": "job1",
                         "device": "cpu", "version": "t"}, at(seconds)).state for number in numbers]


def stops_counted(registry) -> float:
    return sum(registry.get_sample_value("nanguard_stops_total", {"reason": r}) for r in STOP_REASONS)


def test_the_stop_goes_to_every_registered_unfinished_rank(setup, registry):
    ranks, fanout, sent = setup
    states = register(ranks, 0, 1, 2, 3)
    ranks.bye(states[2], True, at(0.5))
    command, made = fanout.begin("policy", "non-finite forward event", "nonfinite", at(1))
    assert made and command.time == at(1).wall
    assert sorted(routing_id for routing_id, _ in sent.messages) == [b"id0", b"id1", b"id3"]
    for _, message in sent.messages:
        assert message.type == "stop"
        assert message.body == {"command_id": command.command_id, "reason": "non-finite forward event",
                                "origin": "policy"}
    assert registry.get_sample_value("nanguard_stops_total", {"reason": "nonfinite"}) == 1
    assert registry.get_sample_value("nanguard_job_stopped") == 1
    assert fanout.status() == {"command_id": command.command_id, "origin": "policy",
                               "reason": "non-finite forward event", "time": at(1).wall, "acked": [],
                               "counted_as": "nonfinite",  # (what nanguard_stops_total counted it under)
                               "job": "job1", "restart": None}  # the incarnation it stopped


def test_resends_go_only_to_ranks_that_have_not_acked(setup):
    ranks, fanout, sent = setup
    register(ranks, 0, 1, 2)
    command, _ = fanout.begin("operator", "maintenance", "operator", at(1))
    sent.take()
    fanout.ack(0, command.command_id)
    fanout.ack(1, "an-older-command")  # not this command's ack
    fanout.resend_due(at(1 + RESEND_S / 2))
    assert sent.take() == []  # not due yet
    fanout.resend_due(at(1 + RESEND_S))
    assert sorted(sent.take()) == [b"id1", b"id2"]
    fanout.ack(1, command.command_id)
    fanout.ack(2, command.command_id)
    fanout.resend_due(at(1 + 4 * RESEND_S))  # (the second resend waits twice as long)
    assert sent.take() == [] and fanout.next_resend == float("inf")
    assert fanout.status()["acked"] == [0, 1, 2]


def test_resends_wait_twice_as_long_each_time_up_to_a_limit(setup):
    ranks, fanout, sent = setup
    register(ranks, 0)
    fanout.begin("operator", "maintenance", "operator", at(1))
    sent.take()
    waits, now = [], at(1).mono
    for _ in range(12):  # rank 0 never acks
        waits.append(round(fanout.next_resend - now, 6))
        now = fanout.next_resend
        fanout.resend_due(Instant(now, now))
        assert sent.take() == [b"id0"]
    assert waits[:3] == [RESEND_S, 2 * RESEND_S, 4 * RESEND_S]
    assert max(waits) == waits[-1] == MAX_RESEND_S


def test_a_rank_that_finishes_gets_no_more_resends(setup):
    ranks, fanout, sent = setup
    _, one = register(ranks, 0, 1)
    fanout.begin("operator", "maintenance", "operator", at(1))
    sent.take()
    ranks.bye(one, False, at(1.1))
    fanout.resend_due(at(1 + RESEND_S))
    assert sent.take() == [b"id0"]


def test_a_rank_registering_after_the_stop_gets_it(setup):
    ranks, fanout, sent = setup
    register(ranks, 0)
    command, _ = fanout.begin("policy", "why", "policy", at(1))
    sent.take()
    (late,) = register(ranks, 7, seconds=5)
    fanout.registered(late, at(5))
    assert [(routing_id, message.body["command_id"]) for routing_id, message in sent.messages] == [
        (b"id7", command.command_id)]


def test_each_copy_is_addressed_to_its_rank_session_and_a_new_process_must_ack_again(setup):
    ranks, fanout, sent = setup
    register(ranks, 0, 1)
    command, _ = fanout.begin("operator", "maintenance", "operator", at(1))
    assert sorted(message.to for _, message in sent.messages) == ["session0", "session1"]
    sent.take()
    fanout.ack(1, command.command_id)
    # rank 1 restarts: its new process gets the stop, and resends go on until it acks itself
    ranks.hello("session1-again", b"id1", {"rank": 1, "local_rank": 0, "world_size": 16, "host": "h", "pid": 2,
                                           "job": "job1", "device": "cpu", "version": "t"}, at(2))
    fanout.registered(ranks.speaker(1, "session1-again"), at(2))
    assert [message.to for _, message in sent.messages] == ["session1-again"]
    assert fanout.status()["acked"] == []


def test_no_stop_no_send_to_a_registering_rank(setup):
    ranks, fanout, sent = setup
    (state,) = register(ranks, 0)
    fanout.registered(state, at(1))
    fanout.resend_due(at(100))
    assert sent.take() == [] and fanout.status() is None


def test_a_second_stop_request_gets_the_existing_command_counted_once(setup, registry):
    ranks, fanout, sent = setup
    register(ranks, 0, 1)
    first, made = fanout.begin("policy", "first reason", "nonfinite", at(1))
    sent.take()
    again, made_again = fanout.begin("operator", "second reason", "operator", at(2))
    assert made and not made_again and again is first and again.reason == "first reason"
    assert sent.take() == []  # nothing is sent for the second request
    assert stops_counted(registry) == 1


def test_a_new_job_can_be_stopped_again(setup, registry):
    ranks, fanout, sent = setup
    register(ranks, 0)
    first, _ = fanout.begin("operator", "one", "operator", at(1))
    fanout.reset()
    assert fanout.status() is None and fanout.next_resend == float("inf")
    second, made = fanout.begin("operator", "two", "operator", at(2))
    assert made and second.command_id != first.command_id
    assert stops_counted(registry) == 2


def test_a_stop_with_no_rank_yet_sends_nothing_and_waits_for_the_first(setup):
    ranks, fanout, sent = setup
    command, made = fanout.begin("operator", "early", "operator", at(1))
    assert made and sent.take() == [] and fanout.next_resend == float("inf")
    (first,) = register(ranks, 0, seconds=2)
    fanout.registered(first, at(2))
    assert sent.take() == [b"id0"]


def test_resend_s_must_be_positive(registry):
    metrics = Metrics(registry)
    with pytest.raises(ValueError, match="resend_s=0 must be a positive number of seconds"):
        StopFanout(RankTable(metrics), metrics, encoder(), Sent(), resend_s=0)


def test_the_ranks_heard_from_last_get_the_stop_first(setup):
    ranks, fanout, sent = setup
    states = register(ranks, *range(16), seconds=1)
    ranks.seen(states[5], b"id5", at(2))
    ranks.seen(states[13], b"id13", at(3))  # a rank the others' all-reduce reaches at once; rank 0 may be dead
    fanout.begin("operator", "maintenance", "operator", at(4))
    order = sent.take()
    assert order[:2] == [b"id13", b"id5"]
    assert sorted(order) == sorted(b"id%d" % rank for rank in range(16))  # each once


def launched(ranks, session, restart, seconds):
    """Rank 0 of a 1-rank job, from a process of launch ``restart``: its hello's admission and state."""
    hello = ranks.hello(session, b"id-" + session.encode(), {"rank": 0, "local_rank": 0, "world_size": 1,
                        "host": "h", "pid": 1, "job": "none", "device": "cpu", "version": "t", "restart": restart},
                        at(seconds))
    return hello.admission, hello.state


@pytest.mark.parametrize("on_restart, holds", [("stop", True), ("run", False)])
def test_a_stop_holds_for_a_torchrun_restart_as_on_restart_says_and_never_for_a_new_launch(
        registry, caplog, on_restart, holds):
    caplog.set_level(logging.INFO, "nanguard.coordinator")
    metrics = Metrics(registry)
    ranks, sent = RankTable(metrics), Sent()
    fanout = StopFanout(ranks, metrics, encoder(), sent, resend_s=RESEND_S, on_restart=on_restart)
    _, first = launched(ranks, "launch1", 0, 0)
    command, _ = fanout.begin("policy", "non-finite loss at step 10", "nonfinite", at(1))
    assert (command.job, command.restart) == ("none", 0)
    ranks.bye(first, False, at(2))
    admission, state = launched(ranks, "launch1-restart1", 1, 3)  # torchrun restarts the worker
    assert fanout.admitted(admission) is not holds
    assert (fanout.command is command) is holds
    said = ("the stop of job none restart 0 (command %s: non-finite loss at step 10) holds for its torchrun restart, "
            "job none restart 1 (--on-restart stop" if holds else
            "the stop of job none restart 0 (command %s) is lifted for job none restart 1 (its torchrun restart, "
            "--on-restart run)") % command.command_id
    assert said in caplog.text
    if holds:
        ranks.bye(state, False, at(4))
        admission, _ = launched(ranks, "launch2", 0, 3600)  # an hour later, the cause fixed
        assert fanout.admitted(admission) and fanout.command is None
        assert f"the stop of job none restart 0 (command {command.command_id}) is lifted for job none restart 0 " \
               "(a new launch)" in caplog.text
    assert registry.get_sample_value("nanguard_job_stopped") == 0


def test_clear_lifts_the_standing_stop_and_a_later_one_can_be_decided(setup, registry):
    ranks, fanout, sent = setup
    register(ranks, 0)
    first, _ = fanout.begin("operator", "one", "operator", at(1))
    assert fanout.clear() is first and fanout.command is None and fanout.next_resend == float("inf")
    assert registry.get_sample_value("nanguard_job_stopped") == 0
    assert fanout.clear() is None  # none stands
    second, made = fanout.begin("policy", "two", "nonfinite", at(2))
    assert made and second.command_id != first.command_id


def test_on_restart_is_stop_or_run(registry):
    with pytest.raises(ValueError, match="on_restart='later' must be one of stop, run"):
        StopFanout(RankTable(Metrics(registry)), Metrics(CollectorRegistry()), encoder(), Sent(), on_restart="later")
