"""The rank-side client against a bare ROUTER socket in this process (the test plays coordinator,
answering handshakes as the real one does)."""

import contextlib
import json
import threading
import time

import pytest
import zmq

from nanguard import Event, ProtocolError
from nanguard.client import Client
from nanguard.link import Admission, Link, Silence
from nanguard.wire import Codec

IDENTITY = {"rank": 3, "local_rank": 1, "world_size": 4, "host": "node1", "pid": 4242, "job": "j",
            "device": "cpu", "version": "test"}


class FakeCoordinator:
    def __init__(self, token=None):
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.codec = Codec("fake-coordinator", token)
        self.received = []
        self.sessions = {}
        """routing id of each session heard"""
        self.welcome = True

    def receive(self, count=1, timeout_s=10.0):
        """The next ``count`` messages but handshakes (answered) as (routing id, Message), under one
        deadline."""
        deadline = time.monotonic() + timeout_s
        out = []
        while len(out) < count:
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(left * 1000), f"got {len(out)} of {count} messages"
            identity, *frames = self.sock.recv_multipart()
            message = self.codec.decode(frames)
            self.sessions[message.sender] = identity
            if message.type == "handshake" and self.welcome:
                self.sock.send_multipart([identity, *self.codec.encode("welcome", {"handshake_seq": message.seq},
                                                                       to=message.sender)])
                continue
            out.append((identity, message))
        self.received += out
        return out

    def until(self, type_, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while True:
            identity, message = self.receive(1, max(0.01, deadline - time.monotonic()))[0]
            if message.type == type_:
                return identity, message

    def send(self, identity, type_, body, to=None):
        """To the session last heard on ``identity`` unless ``to`` names another."""
        if to is None:
            to = next(sender for sender, routing_id in self.sessions.items() if routing_id == identity)
        self.sock.send_multipart([identity, *self.codec.encode(type_, body, to=to)])

    def close(self):
        self.sock.close(linger=0)
        self.context.term()


@pytest.fixture
def coordinator():
    fake = FakeCoordinator()
    yield fake
    fake.close()


@pytest.fixture
def make_client():
    """Started clients, each closed when the test ends (a client is a context manager)."""
    with contextlib.ExitStack() as clients:
        yield lambda address, token=None, **kw: clients.enter_context(
            Client(address, token=token, identity=IDENTITY, **kw))


def event(step, kind="grad_norm", **kw):
    return Event(kind=kind, rank=3, step=step, layer="", grad_norm=10.0, **kw)


@pytest.mark.parametrize("identity, fragment", [
    ({k: v for k, v in IDENTITY.items() if k != "pid"}, "exactly the fields"),
    ({**IDENTITY, "colour": "red"}, "exactly the fields"),
    ({**IDENTITY, "rank": -1}, "invalid identity"),
    ({**IDENTITY, "host": "h" * 300}, "invalid identity"),
])
def test_identity_is_checked(identity, fragment):
    with pytest.raises(ValueError, match=fragment):
        Client("tcp://127.0.0.1:1", token=None, identity=identity)


def test_address_is_checked():
    with pytest.raises(ValueError, match="tcp://host:port"):
        Client("localhost:5555", token=None, identity=IDENTITY)


def test_hello_first_then_heartbeats_with_the_latest_values(coordinator, make_client):
    client = make_client(coordinator.address, heartbeat_s=0.05)
    client.update(step=7, step_time_s=0.5, grad_norm=float("nan"))
    identity, hello = coordinator.receive()[0]
    assert hello.type == "hello" and hello.body == IDENTITY
    assert hello.to == "fake-coordinator"  # bound to the instance that welcomed it
    assert identity[:1] == b"\x00"  # a routing id the ROUTER assigned: no peer can claim it
    _, beat = coordinator.until("heartbeat")
    while beat.body["step"] != 7:
        _, beat = coordinator.until("heartbeat")
    assert beat.body["step_time_s"] == 0.5 and beat.body["dropped"] == 0
    assert beat.body["grad_norm"] != beat.body["grad_norm"]  # NaN travels as "nan"


def test_events_are_batched_by_action_and_unsendable_ones_dropped(coordinator, make_client):
    client = make_client(coordinator.address, heartbeat_s=60)
    coordinator.until("hello")
    for step in range(5):
        assert client.send_event(event(step), "warn")
    assert client.send_event(event(5, extra={"bad": {1, 2}}), "warn")  # a set: not JSON
    assert client.send_event(event(6, kind="forward"), "raise")
    got = []
    while len(got) < 6:
        _, message = coordinator.until("events")
        got += [(e["step"], message.body["action"]) for e in message.body["events"]]
    assert got == [(0, "warn"), (1, "warn"), (2, "warn"), (3, "warn"), (4, "warn"), (6, "raise")]
    deadline = time.monotonic() + 10
    while client.dropped != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_stop_is_acked_every_time_and_delivered_once(coordinator, make_client):
    calls = []
    delivered = threading.Event()

    def on_stop(command_id, reason, origin):
        calls.append((command_id, reason, origin))
        delivered.set()

    make_client(coordinator.address, on_stop=on_stop, heartbeat_s=60)
    identity, _ = coordinator.until("hello")
    for _ in range(3):
        coordinator.send(identity, "stop", {"command_id": "c1", "reason": "because", "origin": "operator"})
        _, ack = coordinator.until("ack")
        assert ack.body == {"rank": 3, "command_id": "c1"}
    assert delivered.wait(10)
    assert calls == [("c1", "because", "operator")]


def test_bad_commands_are_ignored(coordinator, make_client):
    calls = []
    make_client(coordinator.address, on_stop=lambda *a: calls.append(a), heartbeat_s=60)
    identity, _ = coordinator.until("hello")
    coordinator.sock.send_multipart([identity, b"garbage"])
    coordinator.send(identity, "status_request", {})
    coordinator.send(identity, "stop", {"command_id": "c1", "reason": "r", "origin": "policy"},
                     to="rank3@node1:4242:another-process")
    hostile = json.dumps({"v": 2, "type": "stop", "sender": "fake-coordinator", "seq": 10**6,
                          "time": 10**400, "to": "x", "body": {}}).encode()
    coordinator.sock.send_multipart([identity, hostile])
    coordinator.send(identity, "stop", {"command_id": "c2", "reason": "r", "origin": "policy"})
    _, ack = coordinator.until("ack")
    assert ack.body["command_id"] == "c2"
    time.sleep(0.1)
    assert calls == [("c2", "r", "policy")]


def test_control_messages_and_bye(coordinator, make_client):
    client = make_client(coordinator.address, heartbeat_s=60)
    coordinator.until("hello")
    client.captured(12, "/incidents/j-step12")
    client.stopped(12, "nonfinite")
    with pytest.raises(ValueError, match="stop reason"):
        client.stopped(12, "bored")
    assert coordinator.until("captured")[1].body == {"rank": 3, "job": "j", "step": 12,
                                                     "incident": "/incidents/j-step12"}
    assert coordinator.until("stopped")[1].body["reason"] == "nonfinite"
    client.close(timeout_s=2.0)
    assert coordinator.until("bye")[1].body == {"rank": 3, "job": "j", "clean": True}


def test_events_not_received_are_sent_again_and_those_never_received_counted_before_the_goodbye(
        coordinator, make_client, monkeypatch):
    """Numbered batches: one the coordinator never answers is sent again (same numbers), until it
    says ``received``; at close, what it never received counts as dropped in the last heartbeat,
    which goes before the goodbye."""
    monkeypatch.setattr("nanguard.outbox._RESEND_AFTER_S", 0.2)
    client = make_client(coordinator.address, heartbeat_s=60)
    identity, _ = coordinator.until("hello")
    for step in range(3):
        client.send_event(event(step), "warn")
    _, first = coordinator.until("events")
    assert first.body["first"] == 0 and [e["step"] for e in first.body["events"]] == [0, 1, 2]
    _, again = coordinator.until("events")  # no answer came: sent again, numbered as before
    assert again.body["first"] == 0 and again.body["events"] == first.body["events"]
    coordinator.send(identity, "received", {"rank": 3, "events": 3})
    client.send_event(event(3), "warn")
    _, later = coordinator.until("events")
    assert later.body["first"] == 3 and [e["step"] for e in later.body["events"]] == [3]
    client.close(timeout_s=1.0)  # event 3 is never received
    ending = []
    while not ending or ending[-1].type != "bye":
        ending += [m for _, m in coordinator.receive() if m.type != "events"]  # (event 3, sent again)
    assert [m.type for m in ending] == ["heartbeat", "bye"]
    assert ending[0].body["dropped"] == 1 and client.dropped == 1


def test_token_is_used(make_client):
    fake = FakeCoordinator(token="s3cret")
    try:
        make_client(fake.address, token="s3cret")
        assert fake.until("hello")[1].sender.startswith("rank3@node1:4242:")
    finally:
        fake.close()


def test_send_event_checks_the_action():
    client = Client("tcp://127.0.0.1:1", token=None, identity=IDENTITY)  # never started
    with pytest.raises(ValueError, match="action 'explode'"):
        client.send_event(event(0), "explode")
    assert client.send_event(event(0), "skip")


def test_nothing_but_handshakes_before_a_welcome_and_they_are_repeated(coordinator, make_client):
    coordinator.welcome = False  # the welcome is lost (say, the coordinator is busy restarting)
    client = make_client(coordinator.address, heartbeat_s=0.05)
    client.captured(1, "/incidents/x")
    handshakes = []
    while len(handshakes) < 2:
        identity, *frames = coordinator.sock.recv_multipart()
        handshakes.append(coordinator.codec.decode(frames))
    assert [m.type for m in handshakes] == ["handshake", "handshake"]  # nothing else went out
    assert handshakes[1].seq > handshakes[0].seq and handshakes[0].to == ""
    coordinator.sock.send_multipart([identity, *coordinator.codec.encode(
        "welcome", {"handshake_seq": handshakes[0].seq}, to=handshakes[0].sender)])  # answers the first
    _, hello = coordinator.until("hello")
    assert coordinator.until("captured")[1].to == "fake-coordinator"


def test_a_welcome_that_answers_no_handshake_of_this_connection_is_refused():
    link = Link(Codec("rank3@h:1:aa", None))
    coordinator = Codec("coordinator-a", None)
    welcome = coordinator.encode("welcome", {"handshake_seq": 1}, to=link.sender)
    with pytest.raises(ProtocolError) as info:
        link.read(welcome, time.time())  # no handshake sent yet: a replayed welcome
    assert info.value.reason == "replayed" and link.instance is None
    link.handshake()
    link.handshake()
    assert link.read(coordinator.encode("welcome", {"handshake_seq": 2}, to=link.sender), time.time()).type \
        == "welcome"
    assert link.instance == "coordinator-a"
    # a stop from another coordinator instance (an earlier one, or another job's) is refused
    other = Codec("coordinator-b", None).encode("stop", {"command_id": "c", "reason": "r", "origin": "operator"},
                                                to=link.sender)
    with pytest.raises(ProtocolError) as info:
        link.read(other, time.time())
    assert info.value.reason == "instance"
    # and so is anything addressed to another session
    with pytest.raises(ProtocolError) as info:
        link.read(coordinator.encode("stop", {"command_id": "c", "reason": "r", "origin": "operator"},
                                     to="rank3@h:1:bb"), time.time())
    assert info.value.reason == "instance"


def test_an_unclean_close_says_so(coordinator, make_client):
    client = make_client(coordinator.address, heartbeat_s=60)
    coordinator.until("hello")
    client.close(timeout_s=2.0, clean=False)
    assert coordinator.until("bye")[1].body == {"rank": 3, "job": "j", "clean": False}


def test_a_context_left_by_an_exception_is_an_unclean_close(coordinator):
    with pytest.raises(RuntimeError):
        with Client(coordinator.address, token=None, identity=IDENTITY, heartbeat_s=60):
            coordinator.until("hello")
            raise RuntimeError("training failed")
    assert coordinator.until("bye")[1].body["clean"] is False


def test_an_error_on_the_client_thread_does_not_end_it(coordinator, make_client, monkeypatch, caplog):
    calls = []
    client = make_client(coordinator.address, on_stop=lambda *a: calls.append(a), heartbeat_s=60)
    identity, _ = coordinator.until("hello")
    real_read = Link.read
    failures = []

    def failing_once(self, frames, now):
        if not failures:
            failures.append(1)
            raise OverflowError("a bug that a peer found")
        return real_read(self, frames, now)

    monkeypatch.setattr(Link, "read", failing_once)
    coordinator.send(identity, "stop", {"command_id": "c1", "reason": "r", "origin": "operator"})
    coordinator.send(identity, "stop", {"command_id": "c2", "reason": "r", "origin": "operator"})
    assert coordinator.until("ack")[1].body["command_id"] in ("c1", "c2")
    assert failures and client._thread.is_alive()
    assert "the coordinator link failed on a turn" in caplog.text and "OverflowError" in caplog.text


def test_a_restarted_coordinator_gets_a_new_handshake_and_hello(make_client):
    first = FakeCoordinator()
    client = make_client(first.address, heartbeat_s=0.05)
    try:
        assert first.until("hello")[1].to == "fake-coordinator"
    finally:
        first.close()
    second = FakeCoordinator()  # another instance on the same port
    second.sock.close(linger=0)
    second.sock = second.context.socket(zmq.ROUTER)
    second.sock.setsockopt(zmq.LINGER, 0)
    second.sock.bind(first.address)
    second.codec = Codec("fake-coordinator-2", None)
    try:
        client.update(9, 0.1, None)
        _, hello = second.until("hello")
        assert hello.to == "fake-coordinator-2"
        _, beat = second.until("heartbeat")
        assert beat.to == "fake-coordinator-2"
        assert not any(m.to == "fake-coordinator" for _, m in second.received)
    finally:
        client.close()
        second.close()


def test_a_quiet_link_asks_for_an_answer_and_one_that_stays_quiet_is_made_again(coordinator, make_client,
                                                                                 monkeypatch):
    """No ZeroMQ pings (wire.py says why): heartbeats ask for an answer once nothing came back for a
    quarter of the dead time; an answer lets the link be, none makes a new connection."""
    monkeypatch.setattr("nanguard.client._LINK_DEAD_S", 2.0)
    client = make_client(coordinator.address, heartbeat_s=0.1)
    identity, _ = coordinator.until("hello")
    _, beat = coordinator.until("heartbeat")
    assert "answer" not in beat.body  # the welcome was just heard
    while "answer" not in beat.body:
        _, beat = coordinator.until("heartbeat", timeout_s=5)
    asked = time.monotonic()
    coordinator.send(identity, "received", {"rank": 3, "events": 0})
    _, beat = coordinator.until("heartbeat")
    while "answer" in beat.body:  # the ones sent before the answer came
        _, beat = coordinator.until("heartbeat")
    assert time.monotonic() - asked < 1.0  # the answer was heard: it stopped asking
    # no answer from now on: after the dead time a new connection (another routing id) says hello
    first_sender = beat.sender
    new_identity, hello = coordinator.until("hello", timeout_s=10)
    assert new_identity != identity and hello.sender == first_sender  # the same session, a new connection
    assert client._thread.is_alive()


def test_a_hello_the_coordinator_does_not_answer_is_sent_again_until_it_does(coordinator, make_client,
                                                                          monkeypatch, caplog):
    """A coordinator refuses a new launch while it counts the last one's ranks alive (killed without a
    bye): the rank, unanswered, says hello again every few seconds, says once that it is not let in,
    and once more when it is; an answered hello is not sent again."""
    monkeypatch.setattr("nanguard.client._HELLO_AGAIN_S", 0.3)
    caplog.set_level("WARNING", logger="nanguard.client")
    make_client(coordinator.address, heartbeat_s=0.1)
    identity, first = coordinator.until("hello")
    _, again = coordinator.until("hello", timeout_s=5)  # refused (no answer): asked again
    assert again.sender == first.sender and again.seq > first.seq
    _, third = coordinator.until("hello", timeout_s=5)
    refused = [r.getMessage() for r in caplog.records if "has not let this rank in" in r.getMessage()]
    assert len(refused) == 1 and "asks again every 0.3 s" in refused[0], refused
    coordinator.send(identity, "received", {"rank": 3, "events": 0})
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        _, message = coordinator.receive(1)[0]
        assert message.type != "hello" or time.monotonic() < deadline - 1.2, "hello sent again once let in"
    assert any("let this rank in after" in r.getMessage() for r in caplog.records)


def test_admission_says_a_refusal_once_and_only_after_again_s():
    admission = Admission("tcp://10.0.0.7:5555", again_s=5.0)
    assert admission.again(100.0) == (False, None)  # no hello sent yet
    admission.asked(100.0)
    assert admission.again(104.9) == (False, None)
    again, said = admission.again(105.0)
    assert again and "has not let this rank in (5 s without an answer to its hello)" in said
    assert admission.again(107.0) == (False, None) and admission.again(110.0) == (True, None)
    assert admission.answered(111.0) == "nanguard: the coordinator at tcp://10.0.0.7:5555 let this rank in after 11 s"
    assert admission.again(200.0) == (False, None)  # answered: nothing more to ask
    admission.asked(300.0)
    assert admission.answered(300.5) is None  # answered before a refusal was said: nothing to say


def test_silence_is_said_once_per_outage_with_its_likely_causes_and_its_end():
    silence = Silence("tcp://10.0.0.7:5555", after_s=6.0, now=100.0)
    assert silence.check(105.9, connected=False) is None  # not yet a few heartbeats
    said = silence.check(106.0, connected=False)
    assert "no coordinator has answered at tcp://10.0.0.7:5555 for 6 s" in said
    assert "is nanguard coordinator running there" in said and "NANGUARD_CURVE_PUBLIC_KEY" in said
    assert silence.check(200.0, connected=False) is None  # once
    assert silence.up(210.0) == ("nanguard: the coordinator at tcp://10.0.0.7:5555 answers again after 110 s; "
                                 "this rank reports to it")
    assert silence.up(211.0) is None and silence.check(300.0, connected=True) is None  # up
    silence.down(300.0)
    silence.down(301.0)  # (the outage began at the first)
    said = silence.check(306.0, connected=True)
    assert "accepts the connection but has not welcomed this rank for 6 s" in said and "NANGUARD_TOKEN" in said


def test_a_link_that_comes_up_in_time_says_nothing():
    silence = Silence("tcp://127.0.0.1:5555", after_s=6.0, now=0.0)
    assert silence.up(2.0) is None and silence.check(60.0, connected=True) is None
