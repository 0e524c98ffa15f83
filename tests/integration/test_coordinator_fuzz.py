"""Hostile input at the socket against a real coordinator subprocess (CI-sized; the same kinds as
benchmarks/fuzz_coordinator.py, which sends a million): the process lives, /metrics answers, every
message is counted under the reason it deserves, and nothing changes (no phantom rank, no stop),
whether ranks need no token (open, as on loopback) or the fuzzer holds the ranks' token (a
compromised training process). What never reaches nanguard (frames over ZeroMQ's limit, raw TCP
garbage, connection storms) leaves it alive too."""

from __future__ import annotations

import importlib.util
import random
import socket
import threading
import time

import pytest
import zmq

from nanguard.client import Client
from nanguard.coordinator.control import request
from nanguard.protocol import BAD_MESSAGE_REASONS
from nanguard.wire import Codec

from conftest import REPO, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_spec = importlib.util.spec_from_file_location("fuzz_coordinator", REPO / "benchmarks" / "fuzz_coordinator.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

MESSAGES = 5000
"""per run; two runs: 10^4 hostile messages"""


class Recorder:
    def __init__(self):
        self.calls = []
        self._lock = threading.Lock()

    def __call__(self, *args):
        with self._lock:
            self.calls.append(args)


def connection_abuse(address: str, port: int) -> None:
    """What never reaches nanguard's code: it must not hurt the coordinator either."""
    context = zmq.Context()
    try:
        huge = context.socket(zmq.DEALER)
        huge.setsockopt(zmq.LINGER, 0)
        huge.connect(address)
        huge.send(b"y" * 4_000_000)  # over ZeroMQ's frame limit: it closes this connection
        storm = [context.socket(zmq.DEALER) for _ in range(50)]
        for sock in storm:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        time.sleep(0.5)
        for sock in storm:
            sock.close(linger=0)
        for payload in (b"\x00" * 64, b"GET / HTTP/1.0\r\n\r\n", random.Random(3).randbytes(4096)):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(payload)  # not ZeroMQ at all
        time.sleep(0.5)
        huge.close(linger=0)
    finally:
        context.term()


@pytest.mark.parametrize("token", [None, fuzz.RANK_TOKEN], ids=["open-ranks", "compromised-rank"])
def test_hostile_messages_are_counted_and_change_nothing(coordinator, token):
    env = {"NANGUARD_OPERATOR_TOKEN": fuzz.OPERATOR_TOKEN, **({"NANGUARD_TOKEN": token} if token else {})}
    coordinator.start("--dead-after-s", "600", env=env)
    stops = Recorder()
    rank = Client(coordinator.address, token=token, identity=fuzz.hello_body(0), heartbeat_s=0.5, on_stop=stops)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(coordinator.address)
    rank.start()
    try:
        def status():
            return request(coordinator.address, None, "status_request", {}, operator_token=fuzz.OPERATOR_TOKEN,
                           timeout_s=20).body

        until(lambda: len(status()["ranks"]) == 1, "the real rank registered")
        codec = Codec("fuzz-setup@h:1:0", token)
        sock.send_multipart(codec.encode("handshake", {}, to=""))
        assert sock.poll(20_000), "no welcome"
        instance = codec.decode(sock.recv_multipart()).sender
        captured = [codec.encode("handshake", {}, to="") for _ in range(3)]
        for frames in captured:  # accepted once each (answered, uncounted); the fuzzer plays them again
            sock.send_multipart(frames)
        hostile = fuzz.Hostile(instance, random.Random(1 if token is None else 2), token=token,
                               operator_token=fuzz.OPERATOR_TOKEN, captured=captured)
        expected = fuzz.send_all(sock, hostile, MESSAGES)
        assert len(expected) >= 12, expected  # every kind of refusal showed up

        def counted():
            return fuzz.bad_counts(coordinator.samples())

        until(lambda: sum(counted().values()) >= MESSAGES, f"{MESSAGES} bad messages counted", timeout_s=120)
        before = counted()
        assert before == {reason: float(expected.get(reason, 0)) for reason in BAD_MESSAGE_REASONS}
        connection_abuse(coordinator.address, coordinator.port)
        assert coordinator.proc.poll() is None
        # raw TCP bytes can pass for frames of an old ZeroMQ peer (ZMTP 1.0): refused by the codec
        grown = {reason for reason, value in counted().items() if value != before[reason]}
        assert grown <= {"malformed", "unauthenticated", "oversized"}, grown
        final = status()
        assert final["job"] == fuzz.JOB and [r["rank"] for r in final["ranks"]] == [0] and final["stop"] is None
        assert final["ranks"][0]["alive"] and stops.calls == []
        assert coordinator.value("nanguard_job_stopped") == 0
        assert coordinator.value("nanguard_bad_message_reasons_total", reason="internal") == 0
        # and the one who may stop the job still can: the real rank gets it
        reply = request(coordinator.address, None, "stop_request", {"reason": "after the fuzz"},
                        operator_token=fuzz.OPERATOR_TOKEN, timeout_s=20)
        until(lambda: stops.calls, "the real rank's stop")
        assert stops.calls[0][:2] == (reply.body["command_id"], "after the fuzz")
    finally:
        rank.close()
        sock.close(linger=0)
        context.term()
