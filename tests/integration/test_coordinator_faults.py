"""The coordinator as a real subprocess under the faults of issue 31: a peer that never reads its
replies, a flood of handshakes that would flush the replay memory, a log that cannot be written,
idle connections on /metrics, a restart after a stop.

Every coordinator runs in its own session and is killed on teardown; every socket is closed with
linger 0; every wait is a poll under a generous deadline (no timing is asserted).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
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
    said = coordinator.stderr_path.read_text()  # (all of it: 64 ranks' lines pass stderr()'s tail)
    assert said.count("does not read what the coordinator sends it") == 1, said[-4000:]  # said once


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


# --- 6. idle connections on /metrics -------------------------------------------------------------


def few_descriptors() -> None:
    """In the coordinator's child before it starts: a soft limit of 128 open descriptors under a hard
    one of 1,024 (what many machines give a service)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 1024))


def open_files_limit(pid: int) -> int:
    line = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                if line.startswith("Max open files"))
    return int(line.split()[3])


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc/PID/limits (Linux)")
def test_idle_metrics_connections_are_closed_and_cannot_exhaust_the_coordinator(daemons):
    coordinator = daemons(preexec=few_descriptors)
    assert open_files_limit(coordinator.proc.pid) == 1024  # the soft limit raised to the hard one
    host, port = coordinator.metrics_url.split("//")[1].split("/")[0].rsplit(":", 1)
    idle = []
    try:
        for _ in range(300):  # more than the 128 descriptors the coordinator had, and than its cap
            sock = socket.socket()
            idle.append(sock)
            sock.settimeout(5)
            with contextlib.suppress(TimeoutError):  # a backlog that is full: the connection waits in it
                sock.connect((host, int(port)))
                sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and then nothing: the header never ends
            sock.setblocking(False)
        # the operator still reaches the coordinator while they are open, and each one is closed
        assert coordinator.status()["ranks"] == []
        wait_for(lambda: all(closed_by_peer(s) for s in idle), "every idle connection closed by the coordinator",
                 timeout_s=DEADLINE_S)
        assert coordinator.metric("nanguard_ranks_alive") == 0  # /metrics answers again
    finally:
        for sock in idle:
            sock.close()
    assert "/metrics has 32 connections open" in coordinator.stderr()


# --- 1. a log that cannot be written; the stop across a restart --------------------------------

LOG_LIMIT_BYTES = 64 * 1024


def small_disk() -> None:
    """In the coordinator's child before it starts: no file it writes may pass 64 KiB (RLIMIT_FSIZE),
    and a write past it fails with EFBIG instead of killing it (SIGXFSZ ignored): a full disk, as
    far as the log can tell, without root."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LOG_LIMIT_BYTES, LOG_LIMIT_BYTES))


class Rank:
    """Rank 0 of a one-rank job over a raw DEALER: hello, heartbeats, events; it reads its stop."""

    def __init__(self, sock: zmq.Socket, name: str, job: str = "disk-job"):
        self.sock, self.codec, self.job = sock, Codec(name), job
        self.instance = handshake(sock, self.codec)
        sock.send_multipart(hello(self.codec, self.instance, 0, 1, job))

    def heartbeats(self, count: int, step: int = 1) -> None:
        body = {"rank": 0, "world_size": 1, "job": self.job, "host": "testhost", "pid": 100, "step": step,
                "step_time_s": 0.1, "dropped": 0, "grad_norm": 1.0}
        for _ in range(count):
            self.sock.send_multipart(self.codec.encode("heartbeat", body, to=self.instance))

    def nan(self, step: int) -> None:
        event = {"kind": "forward", "rank": 0, "step": step, "layer": "blocks.1.gate", "has_nan": True}
        self.sock.send_multipart(self.codec.encode("events", {"rank": 0, "job": self.job, "events": [event]},
                                                   to=self.instance))

    def stop(self) -> dict:
        """The next stop command sent to this rank (other messages are skipped)."""
        deadline = time.monotonic() + DEADLINE_S
        while self.sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
            message = self.codec.decode(self.sock.recv_multipart())
            if message.type == "stop":
                return message.body
        pytest.fail(f"no stop within {DEADLINE_S:g} s")


def test_a_full_disk_costs_log_lines_counted_never_the_coordinator_and_logging_resumes(daemons, dealers):
    coordinator = daemons("--log-max-mb", "100", preexec=small_disk)
    rank = Rank(dealers(coordinator.address), "rank0-session")
    rank.heartbeats(2000)  # ~300 bytes a line: well past 64 KiB
    wait_for(lambda: coordinator.metric("nanguard_log_errors_total"), "a failed log write counted",
             timeout_s=DEADLINE_S)
    rank.nan(step=7)  # the stop is decided, sent and kept while the log cannot be written
    assert rank.stop()["origin"] == "policy"
    rank.heartbeats(50)
    wait_for(lambda: coordinator.metric("nanguard_log_errors_total") > 1, "more failed writes", timeout_s=DEADLINE_S)
    assert coordinator.status()["stop"]["reason"].startswith("non-finite forward event on rank 0 at step 7")
    assert coordinator.proc.poll() is None
    assert coordinator.stderr().count("cannot write the log") == 1  # said once, however often it fails
    # space comes back (an operator moved the log away): logging goes on by itself
    os.truncate(coordinator.log, 0)
    wait_for(lambda: rank.heartbeats(1, step=2) or "is written again" in coordinator.stderr(),
             "the log written again", timeout_s=DEADLINE_S, every_s=0.5)
    wait_for(lambda: coordinator.log.read_bytes().endswith(b"}\n"), "new lines in the log", timeout_s=DEADLINE_S)
    lines = coordinator.log.read_bytes().splitlines()
    assert "heartbeat" in {json.loads(line)["msg"]["type"] for line in lines}  # every line whole
    assert json.loads(coordinator.log.with_suffix(".state.json").read_text())["stop"]["origin"] == "policy"


def test_the_stop_survives_a_restart_of_the_coordinator(daemons, dealers):
    coordinator = daemons()
    first = Rank(dealers(coordinator.address), "rank0-before")
    first.nan(step=3)
    command = first.stop()
    coordinator.restart()  # a new instance: the ranks reconnect, say hello again
    again = Rank(dealers(coordinator.address), "rank0-after")
    assert again.stop()["command_id"] == command["command_id"]
    assert coordinator.status()["stop"]["reason"] == command["reason"]
    assert coordinator.metric("nanguard_job_stopped") == 1
    assert "was stopped before this coordinator started" in coordinator.stderr()


def test_a_corrupt_state_file_is_said_in_one_line_and_left_out(daemons, tmp_path):
    state = tmp_path / "state.json"
    state.write_bytes(b'{"version": 1, "job": "j", "world_size": 2, "stop": {"command_id": 5')
    coordinator = daemons("--state", str(state))
    assert coordinator.status()["stop"] is None
    said = [line for line in coordinator.stderr().splitlines() if str(state) in line]
    assert len(said) == 1 and "is not a nanguard coordinator state" in said[0] and "starting without it" in said[0]


def test_a_log_on_a_device_that_is_always_full_stops_nothing(daemons, dealers, tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    coordinator = daemons("--log", "/dev/full", "--state", str(tmp_path / "state.json"))
    rank = Rank(dealers(coordinator.address), "rank0-full")
    rank.heartbeats(20)
    wait_for(lambda: coordinator.metric("nanguard_log_errors_total"), "failed writes counted", timeout_s=DEADLINE_S)
    rank.nan(step=1)
    assert rank.stop()["origin"] == "policy"
    assert coordinator.stderr().count("cannot write the log /dev/full: No space left on device") == 1
