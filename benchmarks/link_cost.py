"""What the link's protections cost per message: the HMAC (nanguard's tokens, in Python, on the
coordinator's loop thread) and CurveZMQ encryption (in ZeroMQ's I/O threads).

1. ``Codec.decode`` of a ~300-byte heartbeat, without and with a token: what the coordinator's
   loop pays per message for the MAC (medians over rounds).
2. One DEALER sending ~300-byte messages to a ROUTER as fast as it takes them, in one process,
   plain and with CurveZMQ (alternating rounds): messages per second, and the extra microseconds
   per message that encryption and decryption cost.

    python benchmarks/link_cost.py
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmark the checkout this file lives in

import zmq  # noqa: E402

from nanguard import curve  # noqa: E402
from nanguard.wire import Codec  # noqa: E402

HEARTBEAT = {"rank": 17, "world_size": 64, "job": "benchmark-job-0001", "host": "node-017.cluster.example",
             "pid": 123456, "step": 98765, "step_time_s": 0.4321, "dropped": 0, "grad_norm": 1.2345}


def decode_us(token: str | None, count: int = 20_000, rounds: int = 7) -> float:
    sender, receiver = Codec("rank17@node-017:123456:0123456789abcdef", token), Codec("coordinator", token)
    messages = [sender.encode("heartbeat", HEARTBEAT, to="coordinator") for _ in range(count)]
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for frames in messages:
            receiver.decode(frames)
        times.append((time.perf_counter() - started) / count * 1e6)
    return statistics.median(times)


def throughput(encrypted: bool, count: int = 100_000, size: int = 300) -> float:
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    try:
        if encrypted:
            public, secret = curve.keypair()
            curve.serve(router, secret)
            curve.connect(dealer, public)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"x")
        router.recv_multipart()
        payload = b"p" * size
        sender = threading.Thread(target=lambda: [dealer.send(payload) for _ in range(count)],
                                  name="link-cost-sender")
        started = time.perf_counter()
        sender.start()
        for _ in range(count):
            router.recv_multipart()
        elapsed = time.perf_counter() - started
        sender.join(30)
        return count / elapsed
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        context.term()


def main() -> int:
    plain_us, mac_us = decode_us(None), decode_us("a-token")
    print(f"Codec.decode of a {len(Codec('x').encode('heartbeat', HEARTBEAT, to='coordinator')[0])}-byte "
          f"heartbeat: {plain_us:.1f} us without a token, {mac_us:.1f} us with one "
          f"(the MAC: {mac_us - plain_us:+.1f} us on the coordinator's loop thread)")
    rates = {False: [], True: []}
    for _ in range(4):
        for encrypted in (False, True):
            rates[encrypted].append(throughput(encrypted))
    plain, encrypted = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"DEALER -> ROUTER, 300-byte messages: {plain:,.0f}/s plain, {encrypted:,.0f}/s CurveZMQ "
          f"({(1 / encrypted - 1 / plain) * 1e6:+.1f} us a message, on ZeroMQ's I/O threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
