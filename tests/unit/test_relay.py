"""A node's relay (``nanguard/relay.py``) on real sockets: a coordinator in this process, a relay on an
ipc path, and clients behind it, as local rank 0 and its node's other ranks run them."""

import os
import time

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from nanguard import relay
from nanguard.client import Client
from nanguard.coordinator.control import request
from nanguard.coordinator.server import Coordinator
from nanguard.errors import ProtocolError

TOKEN, OPERATOR = "relay-test-token", "relay-test-operator"


def identity(rank, local_rank):
    return {"rank": rank, "local_rank": local_rank, "world_size": 4, "host": "node1", "pid": 4000 + rank,
            "job": "relayed", "device": "cpu", "version": "test"}


def wait_for(what, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


@pytest.fixture(params=["token", "no token"])
def coordinator(tmp_path, request):
    """A coordinator with the ranks' and the operator's tokens (messages of two frames: payload, MAC),
    or with none (one frame)."""
    token, operator = (TOKEN, OPERATOR) if request.param == "token" else (None, None)
    made = Coordinator("tcp://127.0.0.1:0", token=token, operator_token=operator, registry=CollectorRegistry(),
                       log_path=str(tmp_path / "log.jsonl"), resend_s=0.1)
    made.token, made.operator = token, operator
    made.start()
    yield made
    made.close()


@pytest.fixture
def address(tmp_path):
    return relay.local_address(uid=os.getuid(), run_id=str(tmp_path), restart=0, node="0\0127.0.0.1\029500")


@pytest.fixture
def closing():
    opened = []
    yield opened.append
    for thing in reversed(opened):
        thing.close(timeout_s=0.5) if isinstance(thing, (Client, relay.Relay)) else thing.close()


def status(coordinator, token=None):
    token = getattr(coordinator, "token", token)
    return {r["rank"]: r for r in request(coordinator.address, token, "status_request", {}).body["ranks"]}


def stop(coordinator, reason):
    request(coordinator.address, coordinator.token, "stop_request", {"reason": reason},
            operator_token=coordinator.operator)


def test_a_nodes_ranks_share_one_connection_and_each_gets_the_stop(coordinator, address, closing):
    node = relay.Relay(coordinator.address, address, local_ranks=2)
    node.start()
    closing(node)
    stops = {}
    for rank in (0, 1):
        client = Client(coordinator.address, token=coordinator.token, identity=identity(rank, rank), heartbeat_s=0.2,
                        relay=address, on_stop=lambda cid, reason, origin, rank=rank: stops.setdefault(rank, reason))
        client.start()
        closing(client)
    ranks = wait_for(lambda: (s := status(coordinator)) and len(s) == 2 and s)
    assert all(row["relayed"] for row in ranks.values())
    stop(coordinator, "maintenance")
    wait_for(lambda: len(stops) == 2)
    assert stops == {0: "maintenance", 1: "maintenance"}
    # each rank acked through the relay: the coordinator stops re-sending
    wait_for(lambda: sorted(request(coordinator.address, coordinator.token, "status_request",
                                    {}).body["stop"]["acked"]) == [0, 1])


def test_a_rank_whose_relay_dies_goes_directly_and_still_gets_the_stop(coordinator, address, closing, monkeypatch):
    monkeypatch.setattr("nanguard.link.RELAY_LOST_S", 0.5)
    node = relay.Relay(coordinator.address, address, local_ranks=2)
    node.start()
    stops = []
    client = Client(coordinator.address, token=coordinator.token, identity=identity(1, 1), heartbeat_s=0.2,
                    relay=address,
                    on_stop=lambda cid, reason, origin: stops.append(reason))
    client.start()
    closing(client)
    wait_for(lambda: status(coordinator).get(1, {}).get("relayed"))
    node.close(timeout_s=0.0)  # local rank 0 is gone
    assert not os.path.exists(address[len("ipc://"):])  # (its socket's file with it)
    wait_for(lambda: status(coordinator).get(1, {}).get("relayed") is False)
    assert client.route.relay is None
    stop(coordinator, "after the relay")
    wait_for(lambda: stops == ["after the relay"])


def test_a_relay_that_never_comes_is_waited_for_then_passed_over(coordinator, address, closing, monkeypatch):
    monkeypatch.setattr("nanguard.link.RELAY_WAIT_S", 0.5)
    client = Client(coordinator.address, token=coordinator.token, identity=identity(2, 1), heartbeat_s=0.2,
                    relay=address)
    client.start()
    closing(client)
    assert wait_for(lambda: status(coordinator).get(2, {}).get("relayed") is False)


def test_a_coordinator_restart_behind_the_relay_is_a_new_handshake(tmp_path, address, closing):
    """(Told UP by the relay, not by a connection of its own.)"""
    first = Coordinator("tcp://127.0.0.1:0", token=TOKEN, registry=CollectorRegistry(),
                        log_path=str(tmp_path / "a.jsonl"))
    first.start()
    port_address = first.address
    node = relay.Relay(port_address, address, local_ranks=1)
    node.start()
    closing(node)
    client = Client(port_address, token=TOKEN, identity=identity(0, 0), heartbeat_s=0.2, relay=address)
    client.start()
    closing(client)
    wait_for(lambda: 0 in status(first, TOKEN))
    first.close()
    second = Coordinator(port_address, token=TOKEN, registry=CollectorRegistry(), log_path=str(tmp_path / "b.jsonl"))
    second.start()
    closing(second)
    # told UP by the relay, the client learns the new instance and says hello again (well before the
    # 15 s after which a quiet link is made again)
    wait_for(lambda: status(second, TOKEN).get(0, {}).get("relayed"), timeout_s=8.0)
    assert client.route.relay == address


def test_the_envelope_is_read_and_written_back_the_same():
    route, frames = relay.unwrap([relay.RELAYED, b"\x00abcd", b"{}", b"mac"], b"\x00conn")
    assert route == (b"\x00conn", b"\x00abcd") and list(frames) == [b"{}", b"mac"]
    assert relay.envelope(route) == (b"\x00conn", (relay.RELAYED, b"\x00abcd"))
    assert relay.unwrap([b"{}", b"mac"], b"\x00conn") == (b"\x00conn", [b"{}", b"mac"])
    assert relay.envelope(b"\x00conn") == (b"\x00conn", ())
    with pytest.raises(ProtocolError, match="local route is 0 bytes"):
        relay.unwrap([relay.RELAYED, b"", b"{}"], b"\x00conn")


def test_addresses_differ_by_job_restart_node_and_user():
    base = dict(uid=1000, run_id="job", restart=0, node="0\0h\0p")
    one = relay.local_address(**base)
    assert one == relay.local_address(**base) and one.startswith("ipc://")
    for change in ({"uid": 1001}, {"run_id": "other"}, {"restart": 1}, {"node": "1\0h\0p"}):
        assert relay.local_address(**{**base, **change}) != one
    assert len(one) < 100  # (a unix socket's path is at most 107 bytes)


def test_a_folder_others_can_enter_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    address = relay.local_address(uid=os.getuid(), run_id="j", restart=0, node="")
    relay.ensure_folder(address)
    folder = os.path.dirname(address[len("ipc://"):])
    assert os.stat(folder).st_mode & 0o777 == 0o700
    os.chmod(folder, 0o777)
    with pytest.raises(OSError, match="mode 700"):
        relay.ensure_folder(address)


def test_a_relay_forwards_nothing_that_is_not_a_relayed_message(coordinator, address, closing):
    """What the coordinator's socket sends a relay is only ever enveloped; a rank's empty message is dropped."""
    node = relay.Relay(coordinator.address, address, local_ranks=1)
    node.start()
    closing(node)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    closing(sock)
    sock.send(b"")  # one empty frame: nothing to relay
    from nanguard.wire import Codec
    codec = Codec("raw-rank", coordinator.token)
    deadline = time.monotonic() + 10
    while not sock.poll(200) and time.monotonic() < deadline:
        sock.send_multipart(codec.encode("handshake", {}, to=""))
    frames = sock.recv_multipart()
    while frames[0] in (relay.UP, relay.DOWN):
        frames = sock.recv_multipart()
    assert codec.decode(frames).type == "welcome"


def test_two_guards_of_one_process_share_its_relay(coordinator, address):
    first = relay.shared(coordinator.address, address, local_ranks=2)
    second = relay.shared(coordinator.address, address, local_ranks=2)
    assert second is first and first.users == 2
    first.release(timeout_s=0.0)
    assert not first.closed and os.path.exists(address[len("ipc://"):])
    second.release(timeout_s=0.0)
    assert first.closed and not os.path.exists(address[len("ipc://"):])
    third = relay.shared(coordinator.address, address, local_ranks=2)  # a later guard: a new one
    assert third is not first
    third.release(timeout_s=0.0)


frames_lists = st.lists(st.one_of(st.binary(max_size=300), st.just(relay.RELAYED)), max_size=6)


@given(frames_lists, st.binary(min_size=1, max_size=8))
def test_any_frames_are_unwrapped_or_refused_and_the_route_sends_back(frames, connection):
    """Whatever a peer sends: a route and a tail of its frames, or a ProtocolError; never another
    error, and the route's envelope leads back to the connection it came over."""
    try:
        route, rest = relay.unwrap(frames, connection)
    except ProtocolError:
        assert frames[0] == relay.RELAYED and len(frames) >= 3
        return
    assert list(rest) == list(frames[len(frames) - len(rest):])
    first, before = relay.envelope(route)
    assert first == connection
    assert list(before) + list(rest) == (list(frames) if before else list(rest))


def test_the_relays_own_link_is_encrypted_and_a_wrong_key_is_said(tmp_path, address, closing, caplog):
    """CurveZMQ: ranks behind a relay that holds the coordinator's public key reach it; a relay given
    another key says so on local rank 0's log, and its ranks are not registered."""
    from nanguard import curve

    public, secret = curve.keypair()
    served = Coordinator("tcp://127.0.0.1:0", token=TOKEN, registry=CollectorRegistry(), curve_secret_key=secret,
                         log_path=str(tmp_path / "log.jsonl"))
    served.start()
    closing(served)
    node = relay.Relay(served.address, address, curve_public_key=public, local_ranks=1)
    node.start()
    closing(node)
    client = Client(served.address, token=TOKEN, identity=identity(0, 0), heartbeat_s=0.2, relay=address,
                    curve_public_key=public)
    client.start()
    closing(client)
    ranks = lambda: {r["rank"]: r for r in request(served.address, TOKEN, "status_request", {},  # noqa: E731
                                                   curve_public_key=public).body["ranks"]}
    assert wait_for(lambda: ranks().get(0, {}).get("relayed"))
    wrong = relay.Relay(served.address, address + "-wrong", curve_public_key=curve.keypair()[0], local_ranks=1)
    with caplog.at_level("WARNING", logger="nanguard.relay"):
        wrong.start()
        closing(wrong)
        other = Client(served.address, token=TOKEN, identity=identity(1, 1), heartbeat_s=0.2,
                       relay=address + "-wrong", curve_public_key=public)
        other.start()
        closing(other)
        wait_for(lambda: "failed its handshake" in caplog.text)
    assert 1 not in ranks()
