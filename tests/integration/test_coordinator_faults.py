"""The coordinator as a real subprocess under the faults of issue 31: a peer that never reads its
replies, a flood of handshakes that would flush the replay memory, a log that cannot be written,
idle connections on /metrics, a restart after a stop.

Every coordinator runs in its own session and is killed on teardown; every socket is closed with
linger 0; every wait is a poll under a generous deadline (no timing is asserted).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from nanguard.wire import Codec

from test_coordinator import CoordinatorProcess, clean_env, wait_for

TOKEN, OPERATOR_TOKEN = "faults-ranks", "faults-operators"
SECRETS = {"NANGUARD_TOKEN": TOKEN, "NANGUARD_OPERATOR_TOKEN": OPERATOR_TOKEN}
DEADLINE_S = 60.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Daemon(CoordinatorProcess):
    """test_coordinator's coordinator subprocess with an environment of its own, ``preexec`` run in
    the child before it starts (resource limits), and ``restart``: the same command again after a
    clean end (SIGTERM)."""

    def __init__(self, tmp_path: Path, name: str, args: tuple[str, ...], env: dict[str, str], preexec=None):
        self.token = env.get("NANGUARD_TOKEN")
        self.log = tmp_path / f"{name}.jsonl"
        self.stderr_path = tmp_path / f"{name}.stderr"
        self._argv = [sys.executable, "-m", "nanguard", "coordinator", "--bind", "tcp://127.0.0.1:0",
                      "--metrics-port", "0", "--log", str(self.log), *args]
        self._env, self._preexec = clean_env(**env), preexec
        self.start()

    def start(self) -> None:
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(self._argv, stdout=subprocess.PIPE, stderr=err, env=self._env,
                                         start_new_session=True, preexec_fn=self._preexec, cwd=self.log.parent)
        self.address, self.metrics_url = self._ready()

    def restart(self) -> None:
        assert self.signal(signal.SIGTERM) == 0, self.stderr()
        self.proc.stdout.close()
        self.start()


@pytest.fixture
def daemons(tmp_path):
    """``daemons(*args, env=, preexec=)``: a started Daemon, killed when the test ends."""
    started: list[Daemon] = []
    yield lambda *args, env=None, preexec=None: started.append(
        Daemon(tmp_path, f"c{len(started)}", args, env or {}, preexec)) or started[-1]
    for daemon in started:
        daemon.kill()
    assert not [d.stderr() for d in started if "Traceback" in d.stderr()]


@pytest.fixture
def dealers():
    """``dealers(address, **options)``: a DEALER with ZeroMQ ``options`` (set before it connects: a
    buffer size applies to the connections made after it), closed with linger 0 at the end."""
    with contextlib.ExitStack() as stack:
        def make(address: str, **options: int) -> zmq.Socket:
            sock = stack.enter_context(zmq.Context.instance().socket(zmq.DEALER))
            for name, value in {"LINGER": 0, **options}.items():
                sock.setsockopt(getattr(zmq, name), value)
            sock.connect(address)
            return sock

        yield make


def handshake(sock: zmq.Socket, codec: Codec) -> str:
    """Send a handshake and read its welcome: the coordinator's instance id."""
    sock.send_multipart(codec.encode("handshake", {}, to=""))
    assert sock.poll(20_000), "no welcome"
    return codec.decode(sock.recv_multipart()).sender


def hello(codec: Codec, instance: str, rank: int, world_size: int, job: str) -> list[bytes]:
    body = {"rank": rank, "local_rank": rank, "world_size": world_size, "host": "testhost", "pid": 100 + rank,
            "job": job, "device": "cpu", "version": "test"}
    return codec.encode("hello", body, to=instance)


# --- 2. replies a peer never reads ------------------------------------------------------------


def test_replies_a_peer_never_reads_are_bounded_dropped_and_counted(daemons, dealers):
    coordinator = daemons()
    ranks = dealers(coordinator.address)
    instance = handshake(ranks, Codec("registrar"))
    for rank in range(64):  # a status reply of 64 rows (~16 kB): what the kernel's buffers cannot hide
        ranks.send_multipart(hello(Codec(f"rank-session-{rank}"), instance, rank, 64, "unread"))
    wait_for(lambda: len(coordinator.status()["ranks"]) == 64, "64 ranks registered", timeout_s=DEADLINE_S)
    # a peer that reads one welcome and then nothing: ZeroMQ held 1,000 replies for it (and RSS grew
    # with them); now a few are queued and the rest dropped and counted
    silent = dealers(coordinator.address, RCVHWM=1, RCVBUF=4096)
    reader = Codec("never-reads")
    instance = handshake(silent, reader)
    for _ in range(3000):
        silent.send_multipart(reader.encode("status_request", {}, to=instance))
    wait_for(lambda: coordinator.metric("nanguard_replies_dropped_total", reason="full"),
             "replies dropped and counted", timeout_s=DEADLINE_S)
    assert len(coordinator.status()["ranks"]) == 64  # others are answered as before
    assert coordinator.proc.poll() is None
    assert "does not read what the coordinator sends it" in coordinator.stderr()
    assert coordinator.stderr().count("does not read what the coordinator sends it") == 1  # said once


# --- 3. a flood of handshakes cannot flush the replay memory ----------------------------------


def test_handshakes_under_new_names_cannot_make_an_operators_stop_playable_again(daemons, dealers):
    coordinator = daemons(env=SECRETS)
    link = dealers(coordinator.address)
    rank = Codec("rank0-of-job-a", TOKEN)
    instance = handshake(link, rank)
    link.send_multipart(hello(rank, instance, 0, 1, "job-a"))
    wait_for(lambda: coordinator.status()["job"] == "job-a", "job-a registered")
    # the operator stops job a; an eavesdropper on the plain link keeps the request
    operator = dealers(coordinator.address)
    operator_codec = Codec("operator-session", operator_token=OPERATOR_TOKEN)
    handshake(operator, operator_codec)
    captured = operator_codec.encode("stop_request", {"reason": "maintenance"}, to=instance)
    operator.send_multipart(captured)
    assert operator.poll(20_000) and operator_codec.decode(operator.recv_multipart()).type == "stop_accepted"
    link.send_multipart(rank.encode("bye", {"rank": 0, "job": "job-a", "clean": True}, to=instance))
    next_rank = Codec("rank0-of-job-b", TOKEN)
    link.send_multipart(hello(next_rank, instance, 0, 1, "job-b"))
    wait_for(lambda: coordinator.status()["job"] == "job-b", "job-b registered")
    assert coordinator.status()["stop"] is None
    # a holder of the ranks' token handshakes under 65,552 new names, then plays the operator's stop
    flood = dealers(coordinator.address, SNDHWM=100_000)
    for i in range(65_552):
        flood.send_multipart(Codec(f"flood-{i}", TOKEN).encode("handshake", {}, to=""))
    flood.send_multipart(captured)

    def replayed_or_stopped():
        replayed = coordinator.metric("nanguard_bad_message_reasons_total", reason="replayed")
        return replayed or coordinator.metric("nanguard_stops_total", reason="operator") > 1

    wait_for(replayed_or_stopped, "the played stop request to be refused or obeyed", timeout_s=180)
    assert coordinator.metric("nanguard_stops_total", reason="operator") == 1  # job a's own
    assert coordinator.metric("nanguard_bad_message_reasons_total", reason="replayed") == 1
    assert coordinator.status()["stop"] is None
