"""The rank-side client against a bare ROUTER socket in this process (the test plays coordinator)."""

import contextlib
import threading
import time

import pytest
import zmq

from nanguard import Event
from nanguard.client import Client
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

    def receive(self, count=1, timeout_s=10.0):
        """The next ``count`` messages as (routing id, Message), under one deadline."""
        deadline = time.monotonic() + timeout_s
        out = []
        while len(out) < count:
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(left * 1000), f"got {len(out)} of {count} messages"
            identity, *frames = self.sock.recv_multipart()
            out.append((identity, self.codec.decode(frames)))
        self.received += out
        return out

    def until(self, type_, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while True:
            identity, message = self.receive(1, max(0.01, deadline - time.monotonic()))[0]
            if message.type == type_:
                return identity, message

    def send(self, identity, type_, body):
        self.sock.send_multipart([identity, *self.codec.encode(type_, body)])

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
    assert identity == b"rank3@j"
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
    assert coordinator.until("bye")[1].body == {"rank": 3, "job": "j"}


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
