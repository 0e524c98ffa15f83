"""The coordinator's loop in this process, on a real socket: what it does when it fails itself."""

import logging

import pytest
import zmq
from prometheus_client import CollectorRegistry

from nanguard.coordinator.handlers import Handlers
from nanguard.coordinator.main import ZERO_COPY_RECV, daemon_context
from nanguard.coordinator.server import Coordinator
from nanguard.wire import Codec


@pytest.fixture
def started(tmp_path):
    made = []

    def start(**kwargs) -> Coordinator:
        registry = CollectorRegistry()
        coordinator = Coordinator("tcp://127.0.0.1:0", token=None, registry=registry,
                                  log_path=str(tmp_path / "log.jsonl"), **kwargs)
        coordinator.registry = registry
        coordinator.start()
        made.append(coordinator)
        return coordinator

    yield start
    for coordinator in made:
        coordinator.close()


def dealer(address):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def test_a_handler_that_fails_costs_one_message_counted_as_internal(started, monkeypatch, caplog):
    coordinator = started()
    real = Handlers.handle
    failures = []

    def failing_once(self, message, identity, at):
        if not failures:
            failures.append(message.type)
            raise OverflowError("a bug a message found")
        return real(self, message, identity, at)

    monkeypatch.setattr(Handlers, "handle", failing_once)
    sock = dealer(coordinator.address)
    codec = Codec("peer", None)
    try:
        for _ in range(2):
            sock.send_multipart(codec.encode("handshake", {}, to=""))
        assert sock.poll(10_000)  # the second handshake is answered: the loop went on
        assert codec.decode(sock.recv_multipart()).type == "welcome"
        value = coordinator.registry.get_sample_value
        assert value("nanguard_bad_message_reasons_total", {"reason": "internal"}) == 1
        assert value("nanguard_bad_messages_total") == 1
        assert "internal error handling a message from peer" in caplog.text and "OverflowError" in caplog.text
    finally:
        sock.close(linger=0)


def test_a_loop_that_ends_by_itself_makes_serve_forever_fail(started, monkeypatch, caplog):
    caplog.set_level(logging.CRITICAL, "nanguard.coordinator")

    def broken_loop(self, sock):
        raise zmq.ZMQError(zmq.ENOTSOCK)

    monkeypatch.setattr(Coordinator, "_loop", broken_loop)
    coordinator = started()
    assert coordinator.serve_forever() == 1
    assert "loop thread ended unexpectedly" in caplog.text


def test_serve_forever_after_shutdown_is_a_clean_exit(started):
    coordinator = started()
    coordinator.shutdown()
    assert coordinator.serve_forever() == 0


def test_a_real_coordinator_counts_events_a_re_run_did_not_reproduce(started):
    coordinator = started()
    sock = dealer(coordinator.address)
    codec = Codec("rank1@gpu-node-7:42:aa", None)

    def ask(type_, body, to):
        sock.send_multipart(codec.encode(type_, body, to=to))
        assert sock.poll(10_000), f"no answer to {type_}"
        return codec.decode(sock.recv_multipart())

    def event(**fields):
        return {"kind": "grad", "rank": 1, "step": 7, "layer": "fc.weight", "has_nan": True,
                "host": "gpu-node-7", **fields}

    try:
        instance = ask("handshake", {}, "").sender
        sock.send_multipart(codec.encode("hello", {
            "rank": 1, "local_rank": 1, "world_size": 2, "host": "gpu-node-7", "pid": 42, "job": "j",
            "device": "cuda:1", "version": "t"}, to=instance))
        assert sock.poll(10_000) and codec.decode(sock.recv_multipart()).type == "received"  # let in
        events = [event(reproduced=False, verdict="transient", device="cuda:1 GPU-5c1e"),
                  event(reproduced=False, device="cuda:1 GPU-5c1e"),
                  event(reproduced=True, verdict="reproducible", device="cuda:1 GPU-5c1e"),
                  event(reproduced=None, device="cuda:1 GPU-5c1e"), event()]
        sock.send_multipart(codec.encode("events", {"rank": 1, "job": "j", "events": events, "action": "skip"},
                                         to=instance))
        # one connection's messages are handled in order: the answer comes after the events counted
        assert ask("status_request", {}, instance).body["ranks"][0]["events"] == 5
        value = coordinator.registry.get_sample_value
        assert value("nanguard_transient_events_total", {"host": "gpu-node-7", "device": "cuda:1 GPU-5c1e"}) == 2
        assert value("nanguard_bad_messages_total") == 0
        samples = [s for family in coordinator.registry.collect() if family.name == "nanguard_transient_events"
                   for s in family.samples if s.name == "nanguard_transient_events_total"]
        assert [(s.labels, s.value) for s in samples] == [({"host": "gpu-node-7", "device": "cuda:1 GPU-5c1e"}, 2)]
    finally:
        sock.close(linger=0)


def test_the_daemons_context_copies_what_it_receives_and_nothing_is_lost(started):
    """``ZMQ_ZERO_COPY_RECV`` 0: messages small and larger than libzmq's 8 KiB read buffer arrive whole."""
    context = daemon_context()
    try:
        assert (context.get(ZERO_COPY_RECV), context.get(zmq.IO_THREADS)) == (0, 2)
        coordinator = started(context=context)
        sock = dealer(coordinator.address)
        codec = Codec("rank0@node:1:aa", None)
        try:
            instance = None
            for _ in range(3):  # handshakes in one burst: several messages in one read
                sock.send_multipart(codec.encode("handshake", {}, to=""))
            for _ in range(3):
                assert sock.poll(10_000)
                instance = codec.decode(sock.recv_multipart()).sender
            sock.send_multipart(codec.encode("hello", {
                "rank": 0, "local_rank": 0, "world_size": 1, "host": "node", "pid": 1, "job": "j", "device": "cpu",
                "version": "t"}, to=instance))
            assert sock.poll(10_000) and codec.decode(sock.recv_multipart()).type == "received"
            events = [{"kind": "spike", "rank": 0, "step": step, "layer": "x" * 1000} for step in range(40)]
            sock.send_multipart(codec.encode("events", {"rank": 0, "job": "j", "events": events}, to=instance))
            sock.send_multipart(codec.encode("status_request", {}, to=instance))
            assert sock.poll(10_000)
            assert codec.decode(sock.recv_multipart()).body["ranks"][0]["events"] == 40
            assert coordinator.registry.get_sample_value("nanguard_bad_messages_total") == 0
        finally:
            sock.close(linger=0)
            coordinator.close()
    finally:
        context.term()
