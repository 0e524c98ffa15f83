"""Chaos around the coordinator while a real 2-rank torchrun job (gloo, CPU) runs: it is paused, it
restarts, the network between it and the ranks drops, an intruder takes a rank's old routing id,
captured requests are played again. Training goes on, no rank reads as dead when it is not, and
the one who may stop the job still reaches every rank.
"""

from __future__ import annotations

import selectors
import signal
import socket
import threading
import time

import pytest
import zmq

from nanguard.coordinator.control import request
from nanguard.protocol import STOP_KINDS
from nanguard.wire import Codec

from conftest import CoordinatorProcess, free_port
from test_coordinated import progress_file, wait_for_progress

pytestmark = pytest.mark.slow

SLOW = ("--steps", "3000", "--step-sleep", "0.05")
TOKEN, OPERATOR_TOKEN = "chaos-ranks", "chaos-operators"
SECRETS = {"NANGUARD_TOKEN": TOKEN, "NANGUARD_OPERATOR_TOKEN": OPERATOR_TOKEN}


def status(coordinator) -> dict:
    return request(coordinator.address, TOKEN, "status_request", {}, timeout_s=20).body


def operator_stop(coordinator, reason: str) -> str:
    reply = request(coordinator.address, None, "stop_request", {"reason": reason}, operator_token=OPERATOR_TOKEN,
                    timeout_s=20)
    return reply.body["command_id"]


def stopped_together(job, reason: str) -> dict[int, dict]:
    """Every rank stopped at one common step on the stop whose reason includes ``reason``."""
    results = job.wait(120).results()
    stops = {rank: r["stop"] for rank, r in results.items()}
    assert sorted(stops) == [0, 1] and all(s is not None for s in stops.values()), results
    assert len({s["step"] for s in stops.values()}) == 1, stops
    assert any(reason in s["reason"] for s in stops.values()), stops
    return results


def start_job(torchrun, tmp_path, address: str, **env: str):
    progress = progress_file(tmp_path)
    job = torchrun.spawn("ddp_train.py", *SLOW, "--progress-file", str(progress),
                         env={"NANGUARD_COORDINATOR": address, "NANGUARD_HEARTBEAT_S": "0.2", **env})
    wait_for_progress(progress, 5, job)
    return job


@pytest.mark.timeout(300)
def test_a_paused_coordinator_marks_no_rank_dead_when_it_resumes(torchrun, coordinator, tmp_path):
    coordinator.start(env=SECRETS)  # --dead-after-s 15: the 30 s pause is twice that
    job = start_job(torchrun, tmp_path, coordinator.address, NANGUARD_TOKEN=TOKEN)
    coordinator.wait_for("nanguard_ranks_alive", at_least=2)
    coordinator.proc.send_signal(signal.SIGSTOP)
    time.sleep(30)
    coordinator.proc.send_signal(signal.SIGCONT)
    seen = []
    deadline = time.monotonic() + 20  # over dead_after_s of listening after the pause
    while time.monotonic() < deadline:
        seen.append(coordinator.value("nanguard_ranks_alive"))
        time.sleep(0.1)
    assert len(seen) > 20 and set(seen) == {2.0}, seen
    assert "did not run for" in (tmp_path / "coordinator1.err").read_text()
    operator_stop(coordinator, "end of the pause test")
    stopped_together(job, "end of the pause test")


def welcomed(context: zmq.Context, address: str, codec: Codec) -> tuple[zmq.Socket, str]:
    """A socket to ``address`` and the coordinator instance its handshake learned."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart(codec.encode("handshake", {}, to=""))
    assert sock.poll(20_000), "no welcome"
    return sock, codec.decode(sock.recv_multipart()).sender


@pytest.mark.timeout(300)
def test_a_restarted_coordinator_reaches_every_rank_with_a_stop(torchrun, coordinator, tmp_path):
    coordinator.start(env=SECRETS)
    job = start_job(torchrun, tmp_path, coordinator.address, NANGUARD_TOKEN=TOKEN)
    coordinator.wait_for("nanguard_ranks_alive", at_least=2)
    # what a sniffer caught on its way to this instance: an operator's stop, a rank's hello
    context = zmq.Context()
    operator, rank = Codec("operator@h:1:a", operator_token=OPERATOR_TOKEN), Codec("rank5@h:1:b", TOKEN)
    sock, first = welcomed(context, coordinator.address, operator)
    sniffed = [operator.encode("stop_request", {"reason": "sniffed"}, to=first),
               rank.encode("hello", {"rank": 1, "local_rank": 1, "world_size": 2, "host": "phantom", "pid": 1,
                                     "job": status(coordinator)["job"], "device": "cpu", "version": "x"}, to=first)]
    sock.close(linger=0)
    coordinator.kill()
    time.sleep(1.0)
    coordinator.start(env=SECRETS)  # same port, a new instance that knows nothing of the job
    try:
        coordinator.wait_for("nanguard_ranks_alive", at_least=2, timeout=30)
        # the ranks said hello to the new instance before anything else: nothing of theirs was refused
        assert coordinator.value("nanguard_bad_messages_total") == 0
        player, second = welcomed(context, coordinator.address, Codec("player", TOKEN))
        assert second != first
        for frames in sniffed:
            player.send_multipart(frames)
        coordinator.wait_for("nanguard_bad_message_reasons_total", at_least=2, reason="instance")
        player.close(linger=0)
        now = status(coordinator)
        assert now["stop"] is None and "phantom" not in {r["host"] for r in now["ranks"]}
        operator_stop(coordinator, "after the restart")
        stopped_together(job, "after the restart")
        assert coordinator.value("nanguard_bad_messages_total") == 2
    finally:
        context.destroy(linger=0)


class Proxy:
    """A TCP relay from a local port to ``upstream``, in one named thread; ``cut(seconds)`` drops
    every connection and refuses new ones for that long (a network blip); ``seen`` holds the first
    MiB of what went through (what a sniffer on the network reads)."""

    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = free_port()
        self.seen = bytearray()
        self._selector = selectors.DefaultSelector()
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._listener: socket.socket | None = None
        self._closed_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-proxy", daemon=True)
        self._lock = threading.Lock()
        self._listen()
        self._thread.start()

    def cut(self, seconds: float) -> None:
        with self._lock:
            self._closed_until = time.monotonic() + seconds

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()

    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._listener = listener

    def _drop_all(self) -> None:
        for sock in list(self._pairs):
            self._selector.unregister(sock)
            sock.close()
        self._pairs.clear()
        if self._listener is not None:
            self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    closed = time.monotonic() < self._closed_until
                if closed and (self._pairs or self._listener is not None):
                    self._drop_all()
                elif not closed and self._listener is None:
                    self._listen()
                for key, _ in self._selector.select(0.05):
                    self._ready(key.fileobj)
        finally:
            self._drop_all()
            self._selector.close()

    def _ready(self, sock: socket.socket) -> None:
        if sock is self._listener:
            client, _ = sock.accept()
            server = socket.create_connection(self.upstream)
            for one, other in ((client, server), (server, client)):
                one.setblocking(False)
                self._pairs[one] = other
                self._selector.register(one, selectors.EVENT_READ)
            return
        if sock not in self._pairs:
            return
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        other = self._pairs[sock]
        if len(self.seen) < 1 << 20:
            self.seen += data
        if not data:
            for one in (sock, other):
                self._pairs.pop(one, None)
                self._selector.unregister(one)
                one.close()
            return
        other.setblocking(True)
        other.sendall(data)
        other.setblocking(False)


@pytest.mark.timeout(300)
def test_after_a_network_blip_every_rank_is_reachable_again(torchrun, coordinator, tmp_path):
    coordinator.start(env=SECRETS)
    proxy = Proxy(coordinator.port)
    try:
        job = start_job(torchrun, tmp_path, f"tcp://127.0.0.1:{proxy.port}", NANGUARD_TOKEN=TOKEN)
        coordinator.wait_for("nanguard_ranks_alive", at_least=2)
        sessions = {r["rank"]: r["pid"] for r in status(coordinator)["ranks"]}
        proxy.cut(3.0)
        time.sleep(4.0)
        # the ranks reconnect, are welcomed by the same instance and say hello again
        coordinator.wait_for("nanguard_ranks_alive", at_least=2, timeout=30)
        assert {r["rank"]: r["pid"] for r in status(coordinator)["ranks"]} == sessions
        operator_stop(coordinator, "after the blip")
        stopped_together(job, "after the blip")
        assert coordinator.value("nanguard_bad_messages_total") == 0
    finally:
        proxy.close()


@pytest.mark.timeout(300)
def test_intruders_and_replayed_requests_are_refused_and_the_real_stop_still_arrives(torchrun, coordinator,
                                                                                       tmp_path):
    coordinator.start(env=SECRETS)
    other = CoordinatorProcess(tmp_path / "other", port=free_port())  # another coordinator, same secrets
    (tmp_path / "other").mkdir()
    other.start(env=SECRETS)
    context = zmq.Context()
    intruders: list[zmq.Socket] = []
    sniffer = context.socket(zmq.DEALER)
    player = context.socket(zmq.DEALER)
    try:
        job = start_job(torchrun, tmp_path, coordinator.address, NANGUARD_TOKEN=TOKEN)
        coordinator.wait_for("nanguard_ranks_alive", at_least=2)
        run_id = status(coordinator)["job"]
        # intruders connect with the routing ids ranks had before (rank{N}@{job}): ids no longer
        # mean anything, and without the token they cannot even say hello
        for rank in (0, 1):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, f"rank{rank}@{run_id}".encode())
            sock.connect(coordinator.address)
            sock.send_multipart(Codec(f"intruder{rank}", None).encode("handshake", {}, to=""))
            intruders.append(sock)
        # an operator's stop sniffed on its way to the other coordinator, played to this one
        operator = Codec("operator@h:1:sniffed", operator_token=OPERATOR_TOKEN)
        sniffer.setsockopt(zmq.LINGER, 0)
        sniffer.connect(other.address)
        sniffer.send_multipart(operator.encode("handshake", {}, to=""))
        assert sniffer.poll(20_000)
        other_instance = operator.decode(sniffer.recv_multipart()).sender
        sniffed = operator.encode("stop_request", {"reason": "meant for the other job"}, to=other_instance)
        sniffer.send_multipart(sniffed)  # the other coordinator takes it: it was a real request there
        player.setsockopt(zmq.LINGER, 0)
        player.connect(coordinator.address)
        player.send_multipart(sniffed)
        # a compromised rank (it holds NANGUARD_TOKEN) asks for a stop: an operator's right only
        rogue = Codec("rank1@h:1:rogue", TOKEN)
        player.send_multipart(rogue.encode("handshake", {}, to=""))
        assert player.poll(20_000)
        instance = rogue.decode(player.recv_multipart()).sender
        player.send_multipart(rogue.encode("stop_request", {"reason": "rogue"}, to=instance))
        for reason, count in (("unauthenticated", 2), ("instance", 1), ("forbidden", 1)):
            coordinator.wait_for("nanguard_bad_message_reasons_total", at_least=count, reason=reason)
        assert status(coordinator)["stop"] is None and job.procs[0].poll() is None
        command_id = operator_stop(coordinator, "the real one")
        stopped_together(job, "the real one")
        assert all(not sock.poll(500) for sock in intruders)  # nothing ever reached the intruders
        assert status(coordinator)["stop"]["command_id"] == command_id
        assert coordinator.value("nanguard_stops_total", reason="operator") == 1
    finally:
        for sock in (*intruders, sniffer, player):
            sock.close(linger=0)
        context.term()
        other.kill()


@pytest.mark.timeout(300)
def test_a_rank_killed_leaves_no_rank_reported_finished(torchrun, coordinator, tmp_path):
    """Rank 1 is SIGKILLed mid-run; rank 0 then fails in its next collective (or torchrun tears it
    down). Neither ends "finished": rank 0's goodbye says its process ended by an error."""
    coordinator.start(env=SECRETS)
    job = torchrun.spawn("ddp_train.py", "--steps", "3000", "--step-sleep", "0.05", "--fault", "kill",
                         "--fault-rank", "1", "--fault-step", "40", "--progress-file", str(progress_file(tmp_path)),
                         env={"NANGUARD_COORDINATOR": coordinator.address, "NANGUARD_HEARTBEAT_S": "0.2",
                              "NANGUARD_TOKEN": TOKEN})
    coordinator.wait_for("nanguard_ranks_alive", at_least=2, timeout=60)
    ended = job.wait(120)
    assert ended.returncodes != [0], ended.output[-3000:]
    rows = {r["rank"]: r for r in status(coordinator)["ranks"]}
    assert not rows[0]["finished"] and not rows[1]["finished"], rows
    # rank 0 ended by an uncaught error and said so (failed at once); torchrun's SIGTERM, which
    # may come first, ends it without a goodbye: then it is dead once it stays silent
    until_failed_or_dead = time.monotonic() + 30
    while time.monotonic() < until_failed_or_dead:
        rows = {r["rank"]: r for r in status(coordinator)["ranks"]}
        if all(r["failed"] or not r["alive"] for r in rows.values()):
            break
        time.sleep(0.2)
    assert all(r["failed"] or not r["alive"] for r in rows.values()), rows
    assert coordinator.value("nanguard_ranks_finished") == 0
    assert coordinator.value("nanguard_bad_messages_total") == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("on_nan", ["warn", "skip"])
def test_an_operator_stop_during_a_nan_storm_stops_every_rank_at_one_step(torchrun, coordinator, tmp_path, on_nan):
    """Rank 1's forward turns out NaN on every step from step 10 on (under ``warn`` DDP spreads it to
    rank 0 too); an operator's stop still ends both ranks at one common step, and the bad steps
    were reported on the way. The coordinator is told that non-finite events only warn (else its
    policy would stop the job at the first one, as the ranks' own ``raise`` would)."""
    coordinator.start("--warn-kinds", ",".join(STOP_KINDS), env=SECRETS)
    progress = progress_file(tmp_path)
    job = torchrun.spawn("ddp_train.py", *SLOW, "--fault", "forward", "--fault-rank", "1", "--fault-step", "10",
                         "--fault-until", "3000", "--on-nan", on_nan, "--progress-file", str(progress),
                         env={"NANGUARD_COORDINATOR": coordinator.address, "NANGUARD_HEARTBEAT_S": "0.2",
                              "NANGUARD_TOKEN": TOKEN})
    wait_for_progress(progress, 30, job)
    assert coordinator.wait_for("nanguard_nonfinite_events_total", kind="forward", rank="1") >= 1
    assert status(coordinator)["stop"] is None  # warn and skip never stop the job on their own
    operator_stop(coordinator, f"storm under {on_nan}")
    results = stopped_together(job, f"storm under {on_nan}")
    assert all(r["stop"]["loop_step"] >= 30 for r in results.values()), {r: v["stop"] for r, v in results.items()}
    if on_nan == "skip":  # every bad step was skipped on both ranks: the weights stayed finite
        assert all(r["final_finite"] and r["skipped_steps"] >= 20 for r in results.values()), results
    else:  # warned, applied: DDP's all-reduce carried rank 1's NaN into both ranks' weights
        assert not any(r["final_finite"] for r in results.values()), results
    assert coordinator.value("nanguard_stops_total", reason="operator") == 1
    assert coordinator.value("nanguard_bad_messages_total") == 0
