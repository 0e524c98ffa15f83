"""The coordinator's loop in this process, on a real socket: what it does when it fails itself."""

import logging

import pytest
import zmq
from prometheus_client import CollectorRegistry

from nanguard.coordinator.handlers import Handlers
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
