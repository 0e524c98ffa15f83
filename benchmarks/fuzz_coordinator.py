"""Hostile input against a real coordinator: does it live, keep answering /metrics, count every
message under the right reason, change no state, and keep its memory?

A real ``python -m nanguard coordinator`` subprocess with ``NANGUARD_OPERATOR_TOKEN`` (and, in the
second half, ``NANGUARD_TOKEN`` too, which the fuzzer then holds: a compromised rank); one real
rank registered beside it (``nanguard.client.Client``). One DEALER socket sends ``--messages``
messages of every hostile kind (``Hostile``: random bytes, random frame lists, truncated and
oversized payloads, wrong types, huge numbers, deep nesting, wrong and missing MACs, any of these
inside a node relay's envelope and envelopes with a bad local route, replays of
captured messages, other jobs, other coordinator instances, ranks outside the world size, rank
messages from sessions that never said hello, stops without the operator token, types that do
not travel to the coordinator), each with the reason the coordinator must count it under. Then
it checks the counts, that /metrics answers, that ``status`` shows the one real rank and no stop,
and that an operator's stop still reaches the real rank; it reports the coordinator's RSS before
and after, and its peak.

    python benchmarks/fuzz_coordinator.py                     # 10^6 messages (several minutes)
    python benchmarks/fuzz_coordinator.py --messages 20000    # a smoke run

tests/integration/test_coordinator_fuzz.py runs the same kinds, CI-sized.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmark the checkout this file lives in

import zmq  # noqa: E402

from nanguard.errors import ProtocolError  # noqa: E402
from nanguard.protocol import BAD_MESSAGE_REASONS  # noqa: E402
from nanguard.relay import RELAYED  # noqa: E402
from nanguard.wire import MAX_BYTES, MAX_FRAME_BYTES, TYPES, Codec, ReplayFilter  # noqa: E402

JOB = "fuzz-job"
WORLD_SIZE = 4
RANK_TOKEN = "fuzz-rank-token"
OPERATOR_TOKEN = "fuzz-operator-token"
"""the coordinator reads (and counts) frames up to this; larger ones end their connection in ZeroMQ"""
STALE_S = 3600.0


def hello_body(rank: int, job: str = JOB, world_size: int = WORLD_SIZE) -> dict:
    return {"rank": rank, "local_rank": rank, "world_size": world_size, "host": "fuzz", "pid": 1,
            "job": job, "device": "cpu", "version": "fuzz"}


HEARTBEAT = {"rank": 0, "world_size": WORLD_SIZE, "job": JOB, "host": "fuzz", "pid": 1, "step": 1,
             "step_time_s": None, "dropped": 0, "grad_norm": None}
ACK = {"rank": 0, "command_id": "c0ffee"}
EVENT = {"kind": "forward", "rank": 0, "step": 3, "layer": "blocks.1", "has_nan": True}


class Hostile:
    """Hostile messages for the coordinator ``instance``, each with the reason it must be counted
    under; ``token`` and ``operator_token`` are the coordinator's secrets, of which the fuzzer
    holds only ``token`` (None: ranks need none there); ``captured``: frames that the coordinator
    already accepted (played again, they are replays, as are recent messages of this fuzzer that
    it decoded and then refused)."""

    def __init__(self, instance: str, rng: random.Random, *, token: str | None, operator_token: str,
                 captured: list[list[bytes]]):
        self.instance = instance
        self.rng = rng
        self.token = token
        self.captured = captured
        self._reference = Codec(instance, token, operator_token=operator_token)
        self._replay_filter = ReplayFilter()  # the coordinator's own, fed the same messages in order
        now = time.time()
        for frames in captured:
            self._replay_filter.check(self._reference.decode(frames), now)
        self._recent: deque[list[bytes]] = deque(captured, maxlen=100)
        """messages the coordinator decoded and remembered: what a replay plays again"""
        self._count = 0
        kinds: list[tuple[Callable[[], tuple[list[bytes], str] | None], int]] = [
            (self.random_bytes, 10), (self.random_frames, 4), (self.truncated, 8), (self.oversized, 1),
            (self.huge_number, 8), (self.deep_nesting, 4), (self.wrong_type, 16), (self.bad_mac, 4),
            (self.version, 3), (self.replay, 4), (self.other_instance, 6), (self.stale, 3),
            (self.other_job, 3), (self.out_of_range, 3), (self.unregistered, 6), (self.forbidden, 3),
            (self.unexpected, 4), (self.extra_frame, 3),
        ]
        if token is not None:
            kinds.append((self.no_mac, 4))
        # (the oversized frame closes its connection in ZeroMQ: its count does not depend on an envelope)
        self._wrappable = [kind for kind, weight in kinds for _ in range(weight) if kind != self.oversized]
        kinds += [(self.relayed, 8), (self.bad_envelope, 2)]
        self._kinds = [kind for kind, weight in kinds for _ in range(weight)]

    def message(self) -> tuple[list[bytes], str]:
        """The next hostile message and the reason it is counted under."""
        while True:
            made = self.rng.choice(self._kinds)()
            if made is not None:
                return made

    # --- helpers ---------------------------------------------------------------------------
    def _codec(self) -> Codec:
        """A fresh session, signing as a rank when the fuzzer holds the ranks' token."""
        self._count += 1
        return Codec(f"fuzz{self._count}@h:1:{self.rng.getrandbits(32):08x}", self.token)

    def _envelope(self, type_: str, body: object, **fields) -> dict:
        self._count += 1
        data = {"v": 2, "type": type_, "sender": f"fuzz{self._count}", "seq": 1, "time": time.time(),
                "to": self.instance, "body": body}
        data.update(fields)
        return data

    def _frames(self, payload: bytes) -> list[bytes]:
        """``payload`` with the MAC the fuzzer can make (a valid one when it holds the token)."""
        if self.token is None:
            return [payload]
        import hmac

        return [payload, hmac.digest(self.token.encode(), payload, "sha256")]

    def _judged(self, frames: list[bytes], handled: str = "unregistered") -> tuple[list[bytes], str]:
        """``frames`` with the reason the coordinator counts them under: what its codec says, then
        its replay filter; a message that passes both is refused by the handler as ``handled``."""
        try:
            self._replay_filter.check(self._reference.decode(frames), time.time())
        except ProtocolError as exc:
            return frames, exc.reason
        self._recent.append(frames)
        return frames, handled

    def _handled(self, frames: list[bytes], reason: str) -> tuple[list[bytes], str]:
        """A message made to pass the codec and the replay filter, and be refused as ``reason``."""
        made = self._judged(frames, reason)
        assert made[1] == reason, made
        return made

    def _json(self, depth: int = 0) -> object:
        rng = self.rng
        roll = rng.random()
        if depth > 3 or roll < 0.55:
            return rng.choice([None, True, False, -1, 0, 1, 2**64, 10**400, -(10**400), 1.5, 1e308, "",
                               "x" * rng.randrange(700), "nan", "inf", self.instance, rng.choice(TYPES)])
        if roll < 0.8:
            return [self._json(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["rank", "job", "x", "", "body", "events"]): self._json(depth + 1)
                for _ in range(rng.randrange(4))}

    # --- kinds -----------------------------------------------------------------------------
    def random_bytes(self):
        frames = [self.rng.randbytes(self.rng.randrange(0, 400))]
        if self.token is not None and self.rng.random() < 0.5:
            frames = self._frames(frames[0])
        made = self._judged(frames)
        return made if made[1] != "unregistered" else None  # random bytes that decode: not hostile

    def random_frames(self):
        return [self.rng.randbytes(self.rng.randrange(0, 50)) for _ in range(self.rng.randrange(3, 6))], "malformed"

    def truncated(self):
        payload = json.dumps(self._envelope("hello", hello_body(1))).encode()
        return self._judged(self._frames(payload[:self.rng.randrange(0, len(payload) - 1)]))

    def oversized(self):
        return [b"x" * self.rng.randrange(MAX_BYTES + 1, MAX_FRAME_BYTES + 1)], "oversized"

    def huge_number(self):
        huge = self.rng.choice([1, -1]) * 10 ** self.rng.randrange(309, 1200)
        field = self.rng.choice(["time", "seq", "grad_norm", "step_time_s", "finite_max", "rank"])
        if field in ("time", "seq"):
            data = self._envelope("ack", ACK, **{field: huge})
        elif field == "finite_max":
            data = self._envelope("events", {"rank": 0, "job": JOB, "events": [dict(EVENT, finite_max=huge)]})
        else:
            data = self._envelope("heartbeat", dict(HEARTBEAT, **{field: huge}))
        return self._judged(self._frames(json.dumps(data).encode()))

    def deep_nesting(self):
        # not near the parser's recursion limit (~1000 levels), where where the stack stood decides
        depth = self.rng.choice([self.rng.randrange(50, 800), self.rng.randrange(1200, 5000)])
        nested = "[" * depth + "]" * depth
        body = json.dumps(dict(ACK, command_id="X")).replace('"X"', nested)
        payload = json.dumps(self._envelope("ack", {})).replace("{}", body).encode()
        return self._judged(self._frames(payload))

    def wrong_type(self):
        field = self.rng.choice(["v", "type", "sender", "seq", "time", "to", "body", "body.rank",
                                 "body.command_id", "extra"])
        data = self._envelope("ack", dict(ACK))
        value = self._json()
        if field == "sender" and isinstance(value, str) and 0 < len(value) <= 256:
            value = [value]  # a valid name is no wrong type (and two alike would be a replay)
        if field.startswith("body."):
            data["body"][field[5:]] = value
        else:
            data[field] = value
        return self._judged(self._frames(json.dumps(data).encode()))

    def bad_mac(self):
        payload = json.dumps(self._envelope("ack", ACK)).encode()
        return [payload, self.rng.randbytes(self.rng.choice([0, 1, 31, 32, 33, 64]))], "unauthenticated"

    def no_mac(self):
        return [json.dumps(self._envelope("heartbeat", HEARTBEAT)).encode()], "unauthenticated"

    def version(self):
        data = self._envelope("ack", ACK, v=self.rng.choice([0, 1, 3, "2", 2.0, None]))
        return self._frames(json.dumps(data).encode()), "version"

    def replay(self):
        return list(self.rng.choice(self._recent)), "replayed"

    def other_instance(self):
        to = self.rng.choice(["", f"coordinator@elsewhere:1:{self.rng.getrandbits(32):08x}", self.instance + "x"])
        type_, body = self.rng.choice([("ack", ACK), ("hello", hello_body(1)), ("stop_request", {"reason": "r"}),
                                       ("heartbeat", HEARTBEAT)])
        return self._codec().encode(type_, body, to=to), "instance"

    def stale(self):
        data = self._envelope("ack", ACK, time=time.time() + self.rng.choice([-1, 1]) * STALE_S)
        return self._frames(json.dumps(data).encode()), "stale"

    def other_job(self):
        return self._handled(self._codec().encode("hello", hello_body(0, job=f"other-{self.rng.randrange(9)}"),
                                                  to=self.instance), "wrong_job")

    def out_of_range(self):
        rank, world = self.rng.choice([(WORLD_SIZE, WORLD_SIZE), (WORLD_SIZE + 7, WORLD_SIZE), (0, 1 << 20)])
        return self._handled(self._codec().encode("hello", hello_body(rank, world_size=world), to=self.instance),
                             "out_of_range")

    def unregistered(self):
        type_, body = self.rng.choice([("heartbeat", HEARTBEAT), ("ack", ACK), ("bye", {"rank": 0, "job": JOB, "clean": True}),
                                       ("stopped", {"rank": 0, "job": JOB, "step": 1, "reason": "nonfinite"}),
                                       ("events", {"rank": 0, "job": JOB, "events": [EVENT]})])
        return self._handled(self._codec().encode(type_, body, to=self.instance), "unregistered")

    def forbidden(self):
        return self._handled(self._codec().encode("stop_request", {"reason": "fuzz"}, to=self.instance),
                             "forbidden")

    def unexpected(self):
        type_, body = self.rng.choice([("stop", {"command_id": "c", "reason": "r", "origin": "operator"}),
                                       ("welcome", {"handshake_seq": 1}), ("refused", {"reason": "r"}),
                                       ("stop_accepted", {"command_id": "c", "existing": False})])
        return self._handled(self._codec().encode(type_, body, to=self.instance), "unexpected")

    def relayed(self):
        """Another kind's message in a node relay's envelope (``nanguard/relay.py``): counted as that
        message is, whatever local route the envelope names."""
        made = self.rng.choice(self._wrappable)()
        if made is None:
            return None
        local = self.rng.randbytes(self.rng.randrange(1, 256))
        return [RELAYED, local, *made[0]], made[1]

    def bad_envelope(self):
        local = self.rng.choice([b"", b"x" * 256])  # a local route is 1 to 255 bytes
        return [RELAYED, local, *self._codec().encode("ack", ACK, to=self.instance)], "malformed"

    def extra_frame(self):
        return [*self._codec().encode("ack", ACK, to=self.instance), b"", b"x"][:3], "malformed"


def send_all(sock: zmq.Socket, hostile: Hostile, count: int) -> Counter:
    """Send ``count`` hostile messages on ``sock``; the expected count of each reason."""
    expected: Counter = Counter()
    for _ in range(count):
        frames, reason = hostile.message()
        sock.send_multipart(frames)
        expected[reason] += 1
    return expected


def bad_counts(samples: dict) -> dict[str, float]:
    """``nanguard_bad_message_reasons_total`` by reason, from parsed /metrics samples."""
    return {reason: samples.get(("nanguard_bad_message_reasons_total", (("reason", reason),)), 0.0)
            for reason in BAD_MESSAGE_REASONS}


def main() -> int:
    from coordinator_load import Coordinator  # the coordinator subprocess helper of the load benchmark

    from nanguard.client import Client
    from nanguard.coordinator.control import request

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, token in (("open ranks", None), ("compromised rank", RANK_TOKEN)):
            coordinator = Coordinator(Path(tmp) / f"{name.replace(' ', '-')}.jsonl", token,
                                      operator_token=OPERATOR_TOKEN)
            try:
                results[name] = _run(coordinator, token, args.messages // 2, random.Random(args.seed), Client,
                                     request)
            finally:
                code = coordinator.close()
            results[name]["exit_code"] = code
    print(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results.values()) else 1


def _run(coordinator, token, count, rng, client_class, request) -> dict:
    """One fuzz run against a started coordinator; its figures."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(coordinator.address)
    stops: list = []
    rank = client_class(coordinator.address, token=token, identity=hello_body(0), heartbeat_s=0.5,
                        on_stop=lambda *a: stops.append(a))
    rank.start()
    try:
        codec = Codec("fuzz-setup@h:1:0", token)
        sock.send_multipart(codec.encode("handshake", {}, to=""))
        instance = codec.decode(sock.recv_multipart()).sender
        captured = [codec.encode("handshake", {}, to="") for _ in range(3)]
        for frames in captured:  # accepted once each; the fuzzer plays them again
            sock.send_multipart(frames)
        _until(lambda: len(coordinator.status()["ranks"]) == 1, "the real rank registered")
        before = coordinator.proc_stats()
        started = time.monotonic()
        expected = send_all(sock, Hostile(instance, rng, token=token, operator_token=OPERATOR_TOKEN,
                                          captured=captured), count)
        total = sum(expected.values())
        _until(lambda: sum(bad_counts(coordinator.samples()).values()) >= total, f"{total} counted",
               timeout_s=600)
        seconds = time.monotonic() - started
        after = coordinator.proc_stats()
        counted = bad_counts(coordinator.samples())
        status = coordinator.status()
        stop = request(coordinator.address, None, "stop_request", {"reason": "after the fuzz"},
                       operator_token=OPERATOR_TOKEN, timeout_s=30)
        _until(lambda: stops, "the real rank's stop")
        ok = (counted == {reason: float(expected.get(reason, 0)) for reason in BAD_MESSAGE_REASONS}
              and [r["rank"] for r in status["ranks"]] == [0] and status["stop"] is None
              and stops[0][0] == stop.body["command_id"])
        return {"messages": total, "seconds": round(seconds, 1), "messages_per_s": round(total / seconds),
                "rss_mb_before": round(before["rss_mb"], 1), "rss_mb_after": round(after["rss_mb"], 1),
                "peak_rss_mb": round(after["peak_rss_mb"], 1), "counted": {k: v for k, v in counted.items() if v},
                "ok": ok}
    finally:
        rank.close()
        sock.close(linger=0)
        context.term()


def _until(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"fuzz: {what}: not within {timeout_s:g} s")
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
