"""The coordinator as a real subprocess, driven by real ``Client``s and raw ZeroMQ sockets.

Every coordinator runs in its own process group and is killed on teardown; every client is
closed and every socket closed with linger 0. Waits are polls under generous deadlines.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import zmq
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from nanguard.client import Client
from nanguard.coordinator.control import request
from nanguard.events import Event
from nanguard.coordinator.server import MAX_FRAME_BYTES
from nanguard.wire import MAX_BYTES, Codec

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 30.0
DEADLINE_S = 15.0
JOB = "job1"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def wait_for(predicate, what: str, timeout_s: float = DEADLINE_S, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CoordinatorProcess:
    """``python -m nanguard coordinator`` in its own session, its stderr in a file."""

    def __init__(self, tmp_path: Path, name: str, *args: str, token: str | None = None,
                 bind: str = "tcp://127.0.0.1:0"):
        self.token = token
        self.log = tmp_path / f"{name}.jsonl"
        self.stderr_path = tmp_path / f"{name}.stderr"
        argv = [sys.executable, "-m", "nanguard", "coordinator", "--bind", bind, "--metrics-port", "0",
                "--log", str(self.log), *args]
        env = clean_env(**({"NANGUARD_TOKEN": token} if token else {}))
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env,
                                         start_new_session=True)
        self.address, self.metrics_url = self._ready()

    def _ready(self) -> tuple[str, str]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self.proc.stdout], [], [], left)
            if not readable:
                break
            line = self.proc.stdout.readline().decode()
            if not line:
                break  # exited
            if line.startswith("nanguard coordinator ready"):
                fields = dict(part.split("=", 1) for part in line.split()[3:])
                return fields["bind"], fields["metrics"]
        self.kill()
        pytest.fail(f"coordinator not ready within {READY_TIMEOUT_S:g} s:\n{self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def metric(self, name: str, **labels: str) -> float | None:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return None

    def status(self) -> dict:
        return request(self.address, self.token, "status_request", {}, timeout_s=10).body

    def signal(self, sig: int, timeout_s: float = DEADLINE_S) -> int:
        os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"coordinator did not exit within {timeout_s:g} s of signal {sig}:\n{self.stderr()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.proc.stdout.close()


class StopRecorder:
    def __init__(self):
        self.calls: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def __call__(self, command_id: str, reason: str, origin: str) -> None:
        with self._lock:
            self.calls.append((command_id, reason, origin))


@pytest.fixture
def coordinators(tmp_path):
    started: list[CoordinatorProcess] = []

    def start(*args: str, name: str | None = None, **kwargs) -> CoordinatorProcess:
        coordinator = CoordinatorProcess(tmp_path, name or f"c{len(started)}", *args, **kwargs)
        started.append(coordinator)
        return coordinator

    yield start
    for coordinator in started:
        coordinator.kill()
    for coordinator in started:
        assert "Traceback" not in coordinator.stderr(), coordinator.stderr()


@pytest.fixture
def clients():
    """``clients(address, rank, ...)``: a started Client of job JOB, closed when the test ends."""
    with contextlib.ExitStack() as stack:
        def make(address: str, rank: int, *, token: str | None = None, heartbeat_s: float = 0.2,
                 **kwargs) -> Client:
            identity = {"rank": rank, "local_rank": rank, "world_size": 4, "host": "testhost",
                        "pid": 1000 + rank, "job": JOB, "device": "cpu", "version": "test"}
            return stack.enter_context(Client(address, token=token, identity=identity,
                                              heartbeat_s=heartbeat_s, **kwargs))

        yield make


@pytest.fixture
def raw_socket():
    context = zmq.Context.instance()
    made: list[zmq.Socket] = []

    def make(address: str) -> zmq.Socket:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close(linger=0)


def ranks_by_number(status: dict) -> dict[int, dict]:
    return {r["rank"]: r for r in status["ranks"]}


def nanguard_cli(*args: str, token: str | None = None, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    env = clean_env(**({"NANGUARD_TOKEN": token} if token else {}))
    return subprocess.run([sys.executable, "-m", "nanguard", *args], capture_output=True, text=True,
                          env=env, timeout=timeout_s)


def forward_event(rank: int, step: int = 25, layer: str = "blocks.1.gate") -> Event:
    return Event(kind="forward", rank=rank, step=step, layer=layer, has_nan=True, host="testhost")


# --- tests ----------------------------------------------------------------------------------


def test_hello_and_heartbeat_show_in_status_and_metrics(coordinators, clients):
    coordinator = coordinators()
    for rank in (0, 1):
        clients(coordinator.address, rank).update(step=5 + rank, step_time_s=0.25, grad_norm=1.5)
    wait_for(lambda: [r["step"] for r in coordinator.status()["ranks"]] == [5, 6], "both ranks' steps")
    result = nanguard_cli("status", "--coordinator", coordinator.address, "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["job"] == JOB and status["stop"] is None
    rank1 = ranks_by_number(status)[1]
    assert (rank1["host"], rank1["pid"], rank1["world_size"], rank1["alive"]) == ("testhost", 1001, 4, True)
    assert (rank1["step_time_s"], rank1["grad_norm"], rank1["dropped"]) == (0.25, 1.5, 0)
    table = nanguard_cli("status", "--coordinator", coordinator.address)
    assert table.returncode == 0 and "stop: none" in table.stdout and "testhost" in table.stdout
    wait_for(lambda: coordinator.metric("nanguard_ranks_alive") == 2, "ranks_alive = 2")
    assert coordinator.metric("nanguard_ranks_registered") == 2
    assert coordinator.metric("nanguard_rank_step", rank="1") == 6
    assert coordinator.metric("nanguard_rank_step_time_seconds", rank="0") == 0.25
    assert coordinator.metric("nanguard_rank_last_seen_timestamp_seconds", rank="0") > time.time() - 60
    assert coordinator.metric("nanguard_job_stopped") == 0


def test_a_scrape_as_prometheus_makes_it_shows_each_ranks_series(coordinators, clients):
    """Prometheus asks for OpenMetrics, gzipped: every per-rank family once, typed, a sample per rank
    with the values the ranks reported; the counters of one rank's events under that rank only."""
    coordinator = coordinators("--warn-kinds", "forward")
    ranks = [clients(coordinator.address, rank) for rank in range(3)]
    for rank, client in enumerate(ranks):
        client.update(step=10 + rank, step_time_s=0.5 + rank, grad_norm=2.0 * rank)
    ranks[2].send_event(forward_event(2), "warn")

    def scrape() -> dict:
        asked = urllib.request.Request(coordinator.metrics_url, headers={
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
            "Accept-Encoding": "gzip"})
        with urllib.request.urlopen(asked, timeout=10) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
            text = gzip.decompress(response.read()).decode()
        assert text.endswith("# EOF\n")
        return {family.name: family for family in openmetrics_families(text)}

    def per_rank(families: dict, name: str) -> dict[str, float]:
        return {s.labels["rank"]: s.value for s in families[name].samples}

    families = wait_for(lambda: (f := scrape()) and per_rank(f, "nanguard_rank_step") == {"0": 10, "1": 11, "2": 12}
                        and per_rank(f, "nanguard_nonfinite_events") and f, "every rank's step and the event")
    assert per_rank(families, "nanguard_rank_step_time_seconds") == {"0": 0.5, "1": 1.5, "2": 2.5}
    assert per_rank(families, "nanguard_rank_grad_norm") == {"0": 0, "1": 2, "2": 4}
    seen = per_rank(families, "nanguard_rank_last_seen_timestamp_seconds")
    assert sorted(seen) == ["0", "1", "2"] and all(time.time() - 60 < t <= time.time() + 1 for t in seen.values())
    assert families["nanguard_rank_step"].type == "gauge"
    assert families["nanguard_nonfinite_events"].type == "counter"
    assert [(s.name, s.labels, s.value) for s in families["nanguard_nonfinite_events"].samples] == [
        ("nanguard_nonfinite_events_total", {"kind": "forward", "rank": "2"}, 1)]


def test_non_finite_event_stops_every_client_exactly_once(coordinators, clients):
    coordinator = coordinators()
    recorders = [StopRecorder() for _ in range(3)]
    group = [clients(coordinator.address, rank, on_stop=recorders[rank]) for rank in range(3)]
    wait_for(lambda: len(coordinator.status()["ranks"]) == 3, "three ranks registered")
    group[1].send_event(forward_event(1), "raise")
    wait_for(lambda: all(r.calls for r in recorders), "every client's on_stop")
    command_id, reason, origin = recorders[0].calls[0]
    assert reason == "non-finite forward event on rank 1 at step 25 (layer blocks.1.gate)"
    assert origin == "policy"
    wait_for(lambda: coordinator.status()["stop"]["acked"] == [0, 1, 2], "every rank's ack")
    time.sleep(0.6)  # three resend periods: acked ranks get nothing more, duplicates are not delivered
    assert [r.calls for r in recorders] == [[(command_id, reason, origin)]] * 3
    assert coordinator.metric("nanguard_nonfinite_events_total", kind="forward", rank="1") == 1
    assert coordinator.metric("nanguard_stops_total", reason="nonfinite") == 1
    assert coordinator.metric("nanguard_job_stopped") == 1
    # a rank that registers after the stop gets it too; the ranks' own reports count no second stop
    late = StopRecorder()
    clients(coordinator.address, 3, on_stop=late)
    wait_for(lambda: late.calls, "the late rank's on_stop")
    assert late.calls[0][0] == command_id
    group[1].stopped(25, "nonfinite")
    wait_for(lambda: any("stopped" in line for line in coordinator.log.read_text().splitlines()),
             "the stopped report in the log", timeout_s=DEADLINE_S)
    assert sum(coordinator.metric("nanguard_stops_total", reason=r) for r in
               ("nonfinite", "policy", "operator")) == 1


def test_operator_stop_reaches_every_client(coordinators, clients):
    coordinator = coordinators()
    recorders = [StopRecorder() for _ in range(2)]
    for rank in range(2):
        clients(coordinator.address, rank, on_stop=recorders[rank])
    wait_for(lambda: len(coordinator.status()["ranks"]) == 2, "two ranks registered")
    result = nanguard_cli("stop", "--coordinator", coordinator.address, "--reason", "maintenance window")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Stop command ") and result.stdout.rstrip().endswith("."), result.stdout
    command_id = result.stdout.split()[2]
    wait_for(lambda: all(r.calls for r in recorders), "every client's on_stop")
    assert [r.calls for r in recorders] == [[(command_id, "maintenance window", "operator")]] * 2
    assert coordinator.metric("nanguard_stops_total", reason="operator") == 1
    again = nanguard_cli("stop", "--coordinator", coordinator.address, "--reason", "again")
    assert again.returncode == 0 and again.stdout.startswith(f"The job was already stopping (command {command_id})")
    assert coordinator.metric("nanguard_stops_total", reason="operator") == 1


def instance_of(sock: zmq.Socket, codec: Codec) -> str:
    """The coordinator instance behind ``sock``, as a peer learns it: a handshake and its welcome."""
    sock.send_multipart(codec.encode("handshake", {}, to=""))
    assert sock.poll(DEADLINE_S * 1000), "no welcome"
    return codec.decode(sock.recv_multipart()).sender


def test_bad_messages_are_counted_and_change_nothing(coordinators, clients, raw_socket):
    """Changed with wire version 2 (envelopes carry ``to``; an ack needs its rank's hello first)."""
    coordinator = coordinators()
    recorder = StopRecorder()
    clients(coordinator.address, 0, on_stop=recorder)
    wait_for(lambda: coordinator.status()["ranks"], "rank 0 registered")
    sock = raw_socket(coordinator.address)
    codec = Codec("attacker", None)
    instance = instance_of(sock, codec)

    def envelope(**fields) -> bytes:
        data = {"v": 2, "type": "ack", "sender": "attacker2", "seq": 1, "time": time.time(), "to": instance,
                "body": {"rank": 9, "command_id": "x"}}
        data.update(fields)
        return json.dumps(data).encode()

    hello = codec.encode("hello", {"rank": 1, "local_rank": 1, "world_size": 4, "host": "h", "pid": 9,
                                   "job": JOB, "device": "cpu", "version": "x"}, to=instance)
    sent = {
        "malformed": [[b"garbage %d" % i] for i in range(200)] + [[b"{}", b"", b""], [b"[1]"],
                                                                  [envelope(time=10**400)]],
        "oversized": [[b"x" * 100_000]],
        "unauthenticated": [[envelope(), b"m" * 32]],
        "version": [[envelope(v=1)]],
        "stale": [[envelope(time=time.time() - 3600, sender="attacker3")]],
        "schema": [[envelope(body={"rank": -1, "command_id": "x"}, sender="attacker4")],
                   [codec.encode("events", {"rank": 0, "job": JOB, "events": [{"kind": "forward"}]},
                                 to=instance)[0]]],
        "replayed": [hello],
        "instance": [codec.encode("ack", {"rank": 0, "command_id": "x"}, to="coordinator@elsewhere"),
                     codec.encode("ack", {"rank": 0, "command_id": "x"}, to="")],
        "unregistered": [codec.encode("ack", {"rank": 0, "command_id": "x"}, to=instance)],
        "unexpected": [codec.encode("stop", {"command_id": "x", "reason": "r", "origin": "operator"}, to=instance)],
        "wrong_job": [codec.encode("hello", {"rank": 5, "local_rank": 0, "world_size": 8, "job": "another",
                                             "host": "h", "pid": 1, "device": "cpu", "version": "x"}, to=instance)],
        "out_of_range": [codec.encode("hello", {"rank": 4, "local_rank": 0, "world_size": 4, "job": JOB,
                                                "host": "h", "pid": 1, "device": "cpu", "version": "x"}, to=instance)],
    }
    sock.send_multipart(hello)  # the first time it is fine: an open coordinator takes any rank's hello
    for messages in sent.values():
        for frames in messages:
            sock.send_multipart(frames)
    total = sum(len(messages) for messages in sent.values())
    wait_for(lambda: coordinator.metric("nanguard_bad_messages_total") == total,
             f"{total} bad messages counted")
    for reason, messages in sent.items():
        assert coordinator.metric("nanguard_bad_message_reasons_total", reason=reason) == len(messages), reason
    # a frame far over the limit never reaches Python: ZeroMQ drops that connection
    huge = raw_socket(coordinator.address)
    huge.send_multipart([b"y" * 4_000_000])
    # the coordinator is alive and well: no stop, and new ranks register
    clients(coordinator.address, 2)
    wait_for(lambda: len(coordinator.status()["ranks"]) == 3, "rank 2 registered after the flood")
    assert coordinator.status()["stop"] is None and recorder.calls == []
    assert coordinator.metric("nanguard_job_stopped") == 0
    assert coordinator.metric("nanguard_bad_messages_total") == total
    assert coordinator.proc.poll() is None


def test_oversized_frames_are_counted_up_to_zeromqs_limit_and_above_it_end_their_connection(
        coordinators, raw_socket):
    """What docs/security.md says about oversized messages (wire.MAX_BYTES, server.MAX_FRAME_BYTES)."""
    coordinator = coordinators()
    sock = raw_socket(coordinator.address)
    for size in (MAX_BYTES + 1, MAX_BYTES + 1000, MAX_FRAME_BYTES):
        sock.send_multipart([b"x" * size])
    wait_for(lambda: coordinator.metric("nanguard_bad_message_reasons_total", reason="oversized") == 3,
             "three oversized frames counted")
    # one byte over ZeroMQ's limit: the connection that carried it is closed before nanguard reads it
    # (no memory spent), so it is never counted. What the peer sent after it is lost with the
    # connection when its ZeroMQ had already written it, or delivered after the reconnect when it
    # was still queued (a matter of timing): at most that one more message, and not as oversized
    sock.send_multipart([b"y" * (MAX_FRAME_BYTES + 1)])
    sock.send_multipart([b"after the frame over the limit"])
    time.sleep(1.0)
    assert coordinator.metric("nanguard_bad_message_reasons_total", reason="oversized") == 3
    assert coordinator.metric("nanguard_bad_messages_total") in (3, 4)
    # the peer's ZeroMQ reconnects by itself; what it sends then is read (and counted) again
    wait_for(lambda: sock.send_multipart([b"x" * (MAX_BYTES + 1)]) or
             coordinator.metric("nanguard_bad_message_reasons_total", reason="oversized") >= 4,
             "an oversized frame counted after the reconnect", every_s=0.5)
    assert coordinator.proc.poll() is None


def test_token_mismatch_is_refused(coordinators, clients):
    coordinator = coordinators(token="right")
    clients(coordinator.address, 0, token="right")
    clients(coordinator.address, 1, token="wrong")
    clients(coordinator.address, 2, token=None)
    wait_for(lambda: coordinator.metric("nanguard_bad_message_reasons_total", reason="unauthenticated") >= 4,
             "the wrong clients' messages counted")
    assert [r["rank"] for r in coordinator.status()["ranks"]] == [0]
    result = nanguard_cli("status", "--coordinator", coordinator.address, "--timeout-s", "1", token="wrong")
    assert result.returncode == 1
    assert coordinator.address in result.stderr and "within 1 s" in result.stderr
    assert "NANGUARD_TOKEN" in result.stderr
    assert nanguard_cli("status", "--coordinator", coordinator.address, token="right").returncode == 0


def test_refuses_a_non_loopback_bind_without_a_token(tmp_path):
    result = nanguard_cli("coordinator", "--bind", "tcp://0.0.0.0:0", "--metrics-port", "0",
                          "--log", str(tmp_path / "log.jsonl"))
    assert result.returncode == 2
    assert "refusing to listen on tcp://0.0.0.0:0 without a token" in result.stderr
    assert "NANGUARD_TOKEN" in result.stderr and "--insecure" in result.stderr
    assert not (tmp_path / "log.jsonl").exists()


def test_without_log_the_log_is_in_the_working_directory_and_its_path_is_printed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "nanguard", "coordinator", "--bind", "tcp://127.0.0.1:0",
                             "--metrics-port", "0"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=clean_env(), start_new_session=True, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("nanguard coordinator ready"), proc.stderr.read() if proc.poll() is not None else line
        fields = dict(part.split("=", 1) for part in line.split()[3:])
        assert fields["log"] == str(tmp_path / "nanguard-coordinator.jsonl")
        assert (tmp_path / "nanguard-coordinator.jsonl").exists()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_status_of_an_unreachable_coordinator(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    result = nanguard_cli("status", "--coordinator", address, "--timeout-s", "0.5")
    assert result.returncode == 1
    assert f"no answer from the coordinator at {address} within 0.5 s" in result.stderr


def test_sigterm_exits_cleanly_with_a_complete_log(coordinators, clients):
    coordinator = coordinators()
    client = clients(coordinator.address, 0)
    for step in range(20):
        client.send_event(Event(kind="grad_norm", rank=0, step=step, layer="", grad_norm=1e6), "warn")
    wait_for(lambda: coordinator.metric("nanguard_warning_events_total", kind="grad_norm", rank="0") == 20,
             "20 warnings")
    assert coordinator.signal(signal.SIGTERM) == 0, coordinator.stderr()
    lines = coordinator.log.read_bytes().split(b"\n")
    assert lines[-1] == b""  # ends with a newline: no half-written line
    records = [json.loads(line) for line in lines[:-1]]
    assert all(set(r) == {"received", "msg"} and r["msg"]["v"] == 2 for r in records)
    types = [r["msg"]["type"] for r in records]
    assert types[:2] == ["handshake", "hello"] and "heartbeat" in types
    assert sum(len(r["msg"]["body"]["events"]) for r in records if r["msg"]["type"] == "events") == 20
    assert "stopped; log" in coordinator.stderr()


def test_restarted_coordinator_gets_heartbeats_and_events(coordinators, clients):
    first = coordinators(name="first")
    client = clients(first.address, 2)
    client.update(step=3, step_time_s=0.1, grad_norm=None)
    wait_for(lambda: first.status()["ranks"], "rank 2 registered")
    first.kill()
    second = coordinators(name="second", bind=first.address)
    assert second.address == first.address
    client.update(step=4, step_time_s=0.1, grad_norm=None)
    wait_for(lambda: [r["step"] for r in second.status()["ranks"]] == [4], "rank 2 back with step 4")
    client.send_event(Event(kind="spike", rank=2, step=4, layer=""), "warn")
    wait_for(lambda: second.metric("nanguard_warning_events_total", kind="spike", rank="2") == 1,
             "the event after the restart")


def test_client_started_before_the_coordinator_gets_through(coordinators, clients):
    address = f"tcp://127.0.0.1:{free_port()}"
    client = clients(address, 0)
    client.send_event(Event(kind="spike", rank=0, step=1, layer=""), "warn")  # waits in the queue
    time.sleep(0.3)
    coordinator = coordinators(bind=address)
    wait_for(lambda: coordinator.status()["ranks"], "rank 0 registered")
    wait_for(lambda: coordinator.metric("nanguard_warning_events_total", kind="spike", rank="0") == 1,
             "the event queued before the coordinator was up")
    assert client.dropped == 0


def test_no_coordinator_never_blocks_and_close_is_bounded(clients):
    client = clients(f"tcp://127.0.0.1:{free_port()}", 0, queue_size=64)
    event = forward_event(0)
    # a call that blocked on the missing peer would hang here until the test's timeout
    results = [client.send_event(event, "raise") for _ in range(5000)]
    assert results.count(True) == 64 and client.dropped == 5000 - 64
    client.update(1, 0.1, None)
    client.close(timeout_s=1.0)
    assert client.dropped == 5000  # what was queued is counted as dropped too
    assert not any(t.name == "nanguard-client" and t.is_alive() for t in threading.enumerate())


def test_queue_full_storm_is_counted_and_reported(coordinators, clients):
    coordinator = coordinators()
    client = clients(coordinator.address, 1, queue_size=16)
    wait_for(lambda: coordinator.status()["ranks"], "rank 1 registered")
    storm = 5000
    for step in range(storm):
        client.send_event(Event(kind="grad_norm", rank=1, step=step, layer="", grad_norm=1e9), "warn")
    dropped = client.dropped
    assert dropped > 0
    wait_for(lambda: coordinator.metric("nanguard_events_dropped_total", rank="1") == dropped,
             f"{dropped} dropped events reported by heartbeat")
    wait_for(lambda: coordinator.metric("nanguard_warning_events_total", kind="grad_norm", rank="1")
             == storm - dropped, "every event that was not dropped")
    assert ranks_by_number(coordinator.status())[1]["dropped"] == dropped


def test_the_coordinator_side_never_imports_torch():
    code = ("import nanguard.coordinator.server, nanguard.coordinator.main, nanguard.wire, nanguard.client, "
            "nanguard.cli, nanguard.coordinator.control; import sys; assert 'torch' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('torch'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(),
                            timeout=60)
    assert result.returncode == 0, result.stderr
