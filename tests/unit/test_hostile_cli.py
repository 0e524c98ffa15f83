"""Hostile input at the edges: the operator commands' arguments, the coordinator's, ``init``'s
settings, and text that ranks (or a coordinator) put on the wire for operators to read.

Each case once ended in a traceback, a wrapped port, a half-started daemon, an overflow deep in a
guard, or a terminal driven by escape sequences a rank sent; real processes and real sockets
where the defect lived at that level.
"""

from __future__ import annotations

import collections
import json
import os
import re
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanguard.cli import format_status
from nanguard.config import Settings
from nanguard.coordinator.control import request
from nanguard.errors import ConfigError, CoordinatorUnreachable, ProtocolError
from nanguard.events import Event
from nanguard._text import printable
from nanguard.protocol import job_name, parse_address
from nanguard.wire import Codec, check_body, wire_event

ROOT = Path(__file__).resolve().parents[2]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("NANGUARD_")}, "PYTHONPATH": str(ROOT)}
TOKEN, OPERATOR_TOKEN = "rank-secret", "operator-secret"
ESCAPES = "\x1b]0;PWNED\x07\x1b[2J\x1b[31mstop: none\x1b[0m"
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HELLO = {"rank": 1, "local_rank": 1, "world_size": 2, "host": "node1", "pid": 42, "job": "j",
         "device": "cpu", "version": "0.1.0"}

# text with at least one character str.isprintable() refuses (C0, DEL, C1, line breaks, format)
# (drawn from the categories str.isprintable() refuses, not filtered out of every character: a filter
# that drops most draws failed Hypothesis's health check on a loaded machine)
controls = st.characters(codec="utf-8", categories=("Cc", "Cf", "Co", "Cn", "Zl", "Zp", "Zs"),
                         exclude_characters=" ").filter(lambda c: not c.isprintable())
hostile_text = st.tuples(st.text(max_size=20), controls, st.text(max_size=20)).map("".join)
printable_text = st.text(st.characters(codec="utf-8").filter(str.isprintable), max_size=60)


def nanguard(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanguard", *argv], env={**ENV, **(env or {})},
                          capture_output=True, timeout=timeout)


def assert_one_line_refusal(result: subprocess.CompletedProcess, *fragments: str) -> str:
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


# --- D1: nanguard status|stop --timeout-s ---------------------------------------------------


@pytest.mark.parametrize("verb", [["status"], ["stop", "--reason", "x"]])
@pytest.mark.parametrize("timeout", ["inf", "1e300", "-1", "nan", "0", "86401"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused_on_one_line(verb, timeout):
    result = nanguard(*verb, "--coordinator", "tcp://127.0.0.1:1", "--timeout-s", timeout)
    assert_one_line_refusal(result, "--timeout-s must be a positive finite number of seconds (at most 86400)",
                            "nothing was sent")


def test_request_refuses_a_timeout_it_cannot_wait():
    for timeout in (float("inf"), float("nan"), -1.0, 0, True, "5"):
        with pytest.raises(ValueError, match="timeout_s must be a positive finite number"):
            request("tcp://127.0.0.1:1", None, "status_request", {}, timeout_s=timeout)


# --- D2, D10: nanguard coordinator --metrics-port, --bind -------------------------------------


def test_a_metrics_port_out_of_range_is_refused_before_anything_starts(tmp_path):
    result = nanguard("coordinator", "--bind", "tcp://127.0.0.1:0", "--metrics-port", "99999",
                      "--log", str(tmp_path / "log.jsonl"), timeout=30)
    assert_one_line_refusal(result, "--metrics-port 99999 is not a port (0-65535); nothing was started")
    assert not (tmp_path / "log.jsonl").exists()


@pytest.mark.parametrize("bind, insecure", [
    ("tcp://127.0.0.1:99999", True), ("tcp://127.0.0.1:99999", False), ("foo", False), ("tcp://", False),
    (":-5", False), ("ipc:///", False), ("tcp://0.0.0.0:70000", True), ("inproc://x", False),
])
def test_a_bind_that_is_no_address_is_refused_as_such(tmp_path, bind, insecure):
    result = nanguard("coordinator", "--bind", bind, "--metrics-port", "0", "--log", str(tmp_path / "log.jsonl"),
                      *(["--insecure"] if insecure else []), timeout=30)
    err = assert_one_line_refusal(result, f"--bind {bind!r}", "nothing was started")
    assert "without a token" not in err
    assert not (tmp_path / "log.jsonl").exists()


@pytest.mark.parametrize("address", ["inproc://x", "ipc:///", "ipc://", "ipc://dir/", "ipc:///tmp/a\x1b"])
def test_an_address_no_rank_nor_operator_can_connect_to_is_refused(address):
    with pytest.raises(ValueError, match="tcp://host:port"):
        parse_address(address)
    with pytest.raises(ConfigError, match="coordinator="):
        Settings.resolve({"coordinator": address}, environ={})
    if "\x1b" not in address:
        assert_one_line_refusal(nanguard("status", "--coordinator", address), "must look like tcp://host:port")


def test_the_coordinator_class_refuses_a_port_zeromq_would_wrap(tmp_path):
    from prometheus_client import CollectorRegistry

    from nanguard.coordinator.server import Coordinator

    with pytest.raises(ValueError, match="tcp://127.0.0.1:99999' must look like tcp://host:port"):
        Coordinator("tcp://127.0.0.1:99999", token=None, registry=CollectorRegistry(),
                    log_path=str(tmp_path / "log.jsonl"))


def test_inproc_stays_an_address_to_bind_in_process():
    assert parse_address("inproc://x", bind=True).scheme == "inproc"
    assert parse_address("ipc:///tmp/nanguard.sock").host == "/tmp/nanguard.sock"


# --- D9: control characters from the wire ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Daemon:
    """A real ``nanguard coordinator`` process on a free loopback port, with both tokens."""

    def __init__(self, tmp_path: Path):
        self.stderr_path = tmp_path / "coordinator.err"
        port = _free_port()
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nanguard", "coordinator", "--bind", f"tcp://127.0.0.1:{port}",
                 "--metrics-port", "0", "--log", str(tmp_path / "log.jsonl")],
                env={**ENV, "NANGUARD_TOKEN": TOKEN, "NANGUARD_OPERATOR_TOKEN": OPERATOR_TOKEN},
                cwd=tmp_path, stdout=subprocess.PIPE, stderr=err)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline().decode() if ready else ""
        match = re.match(r"nanguard coordinator ready bind=(\S+) metrics=(\S+)", line)
        if match is None:
            self.close()
            raise AssertionError(f"no ready line: {line!r}; {self.stderr_path.read_text()}")
        self.address, self.metrics_url = match.groups()

    def metric(self, name: str, reason: str | None = None) -> float:
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        label = "" if reason is None else f'{{reason="{reason}"}}'
        found = re.search(rf"^{re.escape(name + label)} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def wait_for(self, name: str, value: float, reason: str | None = None) -> None:
        deadline = time.monotonic() + 20
        while self.metric(name, reason) < value:
            assert time.monotonic() < deadline, f"{name}{reason or ''} never reached {value}"
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()


@pytest.fixture
def daemon(tmp_path):
    d = _Daemon(tmp_path)
    yield d
    d.close()


class _Rank:
    """A hand-made rank session on a real DEALER socket, speaking with the project's own codec."""

    def __init__(self, address: str, sender: str = "rank1@node1:42:aa"):
        self.codec = Codec(sender, TOKEN)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sock.send_multipart(self.codec.encode("handshake", {}, to=""))
        assert self.sock.poll(10_000), "no welcome"
        self.instance = json.loads(self.sock.recv_multipart()[0])["sender"]

    def send(self, type_: str, body: dict) -> None:
        self.sock.send_multipart(self.codec.encode(type_, body, to=self.instance))

    def send_raw(self, envelope: dict) -> None:
        import hashlib
        import hmac

        payload = json.dumps(envelope).encode()
        self.sock.send_multipart([payload, hmac.new(TOKEN.encode(), payload, hashlib.sha256).digest()])


def test_terminal_escapes_in_a_hello_are_refused_and_never_reach_the_operator(daemon):
    rank = _Rank(daemon.address)
    try:
        rank.send("hello", dict(HELLO, rank=0, host="h" + ESCAPES, job="j" + ESCAPES))
        rank.send("hello", dict(HELLO, host="node1"))  # a plain one from the same session: accepted
        daemon.wait_for("nanguard_ranks_registered", 1)
        layer = Event(kind="forward", rank=1, step=3, layer="fc" + ESCAPES).to_dict()
        rank.send("events", {"rank": 1, "job": "j", "events": [layer], "action": "raise"})
        rank.send_raw({"v": 2, "type": "heartbeat", "sender": "evil" + ESCAPES, "seq": 1, "time": time.time(),
                       "to": rank.instance, "body": {}})
        daemon.wait_for("nanguard_bad_message_reasons_total", 2, "schema")
        daemon.wait_for("nanguard_bad_message_reasons_total", 1, "malformed")
        with pytest.raises(CoordinatorUnreachable):  # an operator's hostile reason: dropped, no stop
            request(daemon.address, None, "stop_request", {"reason": "r" + ESCAPES},
                    operator_token=OPERATOR_TOKEN, timeout_s=1.0)
        daemon.wait_for("nanguard_bad_message_reasons_total", 3, "schema")
    finally:
        rank.sock.close(linger=0)
    result = nanguard("status", "--coordinator", daemon.address, env={"NANGUARD_OPERATOR_TOKEN": OPERATOR_TOKEN})
    assert result.returncode == 0, result.stderr
    assert b"\x1b" not in result.stdout + result.stderr
    lines = result.stdout.decode().splitlines()
    assert lines[0] == "job: j, 1 rank(s)" and lines[2].split()[:2] == ["1", "node1"], lines
    assert lines[-1] == "stop: none" and len(lines) == 4, lines
    assert daemon.metric("nanguard_job_stopped") == 0
    daemon.close()
    assert b"\x1b" not in daemon.stderr_path.read_bytes()


class _HostileCoordinator(threading.Thread):
    """A coordinator (an old or a hostile one) whose status reply carries terminal escapes."""

    def __init__(self, reply_type: str, body: dict):
        super().__init__(daemon=True)
        self.codec = Codec("coordinator@evil:1:aa", TOKEN)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.reply_type, self.body = reply_type, body

    def run(self) -> None:
        for _ in range(2):
            if not self.sock.poll(30_000):
                return
            identity, *frames = self.sock.recv_multipart()
            message = self.codec.decode(frames)
            type_, body = (("welcome", {"handshake_seq": message.seq}) if message.type == "handshake"
                           else (self.reply_type, self.body))
            self.sock.send_multipart([identity, *self.codec.encode(type_, body, to=message.sender)])


@pytest.mark.parametrize("verb, reply_type, body", [
    (["status"], "status", {"job": "j" + ESCAPES, "stop": None, "ranks": [
        {"rank": 0, "host": "h" + ESCAPES, "pid": 1, "world_size": 1, "step": 1, "step_time_s": None,
         "grad_norm": None, "last_seen": time.time(), "alive": True, "stalled": False, "finished": False,
         "failed": False, "events": 0, "dropped": 0}]}),
    (["status", "--json"], "status", {"job": "j" + ESCAPES, "ranks": [], "stop": None}),
    (["stop", "--reason", "x"], "refused", {"reason": "no" + ESCAPES}),
    (["stop", "--reason", "x"], "stop_accepted", {"command_id": "c" + ESCAPES, "existing": False}),
])
def test_a_hostile_coordinator_cannot_drive_the_operators_terminal(verb, reply_type, body):
    fake = _HostileCoordinator(reply_type, body)
    fake.start()
    try:
        result = nanguard(*verb, "--coordinator", fake.address, "--timeout-s", "2", env={"NANGUARD_TOKEN": TOKEN})
    finally:
        fake.join(10)
        fake.sock.close(linger=0)
    out = result.stdout + result.stderr
    assert b"\x1b" not in out and b"\x07" not in out, out
    assert result.returncode == 1 and b"refused" in result.stderr and b"Traceback" not in out, out


def test_a_reason_the_coordinator_would_refuse_is_not_sent():
    result = nanguard("stop", "--coordinator", "tcp://127.0.0.1:1", "--reason", "a\nb")
    assert_one_line_refusal(result, "nothing was sent", "printable")


@PROPERTY
@given(job=hostile_text | printable_text, host=hostile_text | printable_text, reason=hostile_text,
       command_id=hostile_text)
def test_the_status_table_shows_no_control_character_whatever_it_is_given(job, host, reason, command_id):
    rank = {"rank": 0, "host": host, "pid": 1, "world_size": 1, "step": 1, "step_time_s": None,
            "grad_norm": None, "last_seen": 1.0, "alive": True, "stalled": False, "finished": False,
            "failed": False, "events": 0, "dropped": 0}
    stop = {"command_id": command_id, "origin": "operator" + reason, "reason": reason, "time": 1.0, "acked": []}
    text = format_status({"job": job, "ranks": [rank], "stop": stop}, now=2.0)
    assert all(line.isprintable() for line in text.split("\n"))
    assert len(text.split("\n")) == 4


@PROPERTY
@given(text=st.text(max_size=80))
def test_printable_escapes_exactly_what_is_not_printable(text):
    shown = printable(text)
    assert shown.isprintable()
    assert (shown == text) is text.isprintable()


@PROPERTY
@given(text=hostile_text, field=st.sampled_from(["host", "job", "device", "version"]))
def test_the_schema_refuses_any_control_character_in_a_hello(text, field):
    with pytest.raises(ProtocolError) as refused:
        check_body("hello", dict(HELLO, **{field: text[:64]}))
    assert refused.value.reason == "schema"


@PROPERTY
@given(text=printable_text, field=st.sampled_from(["host", "job", "device", "version"]))
def test_the_schema_takes_any_printable_text_in_a_hello(text, field):
    assert check_body("hello", dict(HELLO, **{field: text}))[field] == text


@PROPERTY
@given(text=hostile_text, type_and_field=st.sampled_from([
    ("stop_request", "reason"), ("refused", "reason"), ("stop", "reason"), ("ack", "command_id"),
    ("captured", "incident"), ("heartbeat", "host"), ("bye", "job")]))
def test_the_schema_refuses_any_control_character_in_free_text(text, type_and_field):
    type_, field = type_and_field
    bodies = {"stop_request": {}, "refused": {}, "stop": {"command_id": "c", "origin": "operator"},
              "ack": {"rank": 0}, "captured": {"rank": 0, "job": "j", "step": 1},
              "heartbeat": {"rank": 0, "world_size": 1, "job": "j", "pid": 1, "step": 1, "step_time_s": None,
                            "dropped": 0, "grad_norm": None}, "bye": {"rank": 0, "clean": True}}
    body = {**bodies[type_], field: text[:60]}
    with pytest.raises(ProtocolError) as refused:
        check_body(type_, body)
    assert refused.value.reason == "schema"
    assert check_body(type_, {**body, field: printable(text)[:60]})


@PROPERTY
@given(layer=hostile_text, module_type=printable_text, message=hostile_text | printable_text)
def test_a_rank_escapes_its_event_text_and_the_schema_takes_it(layer, module_type, message):
    event = Event(kind="forward", rank=0, step=1, layer=layer, module_type=module_type, message=message)
    body = {"rank": 0, "job": "j", "events": [event.to_dict()]}
    with pytest.raises(ProtocolError):
        check_body("events", body)
    checked = check_body("events", {**body, "events": [wire_event(event.to_dict(compact=True))]})
    assert checked["events"][0]["layer"] == printable(layer)


@PROPERTY
@given(text=hostile_text | printable_text, field=st.sampled_from(["host", "device"]))
def test_an_event_host_or_device_is_printable_text_on_the_wire(text, field):
    """The device an event names becomes a label of ``nanguard_transient_events_total`` and a line
    of the coordinator's log: refused with a control character in it, as the host is; a rank's
    ``wire_event`` escapes it first."""
    event = Event(kind="grad", rank=0, step=1, layer="w", reproduced=False, verdict="transient",
                  **{field: text})
    body = {"rank": 0, "job": "j", "events": [event.to_dict()]}
    if text.isprintable():
        assert check_body("events", body)["events"][0][field] == text
    else:
        with pytest.raises(ProtocolError) as refused:
            check_body("events", body)
        assert refused.value.reason == "schema" and field in str(refused.value)
    checked = check_body("events", {**body, "events": [wire_event(event.to_dict(compact=True))]})
    assert checked["events"][0].get(field, "") == printable(text)


def test_an_event_device_is_bounded():
    event = Event(kind="grad", rank=0, step=1, layer="w", device="cuda:0 " + "x" * 300).to_dict()
    with pytest.raises(ProtocolError, match="device: longer than 256 characters"):
        check_body("events", {"rank": 0, "job": "j", "events": [event]})
    assert len(wire_event(dict(event, device="\x07" * 200))["device"]) <= 256


@PROPERTY
@given(text=hostile_text, as_key=st.booleans())
def test_an_event_extra_with_a_raw_control_character_is_refused(text, as_key):
    """``extra`` reaches the coordinator's event log as received: no raw DEL, C1 or format control
    there (C0 controls cannot be raw in JSON text; they arrive escaped and are harmless)."""
    extra = {"nested": [{text: 1} if as_key else text]}
    body = {"rank": 0, "job": "j", "events": [Event(kind="forward", rank=0, step=1, layer="l", extra=extra).to_dict()]}
    payload = json.dumps(body, ensure_ascii=False)
    raw = any(not ch.isprintable() and ord(ch) >= 0x20 for ch in text)
    if raw:
        with pytest.raises(ProtocolError) as refused:
            check_body("events", json.loads(payload))
        assert refused.value.reason == "schema" and "extra" in str(refused.value)
    else:
        assert check_body("events", json.loads(payload))["events"][0]["extra"] == extra
        assert payload.isprintable()  # (what the log holds)


@PROPERTY
@given(run_id=st.text(max_size=300))
def test_a_job_name_always_passes_the_hello_schema(run_id):
    check_body("hello", dict(HELLO, job=job_name(run_id)))


@PROPERTY
@given(sender=hostile_text)
def test_a_sender_with_a_control_character_is_refused(sender):
    with pytest.raises(ValueError):
        Codec(sender[:200] or "\x1b")
    payload = json.dumps({"v": 2, "type": "handshake", "sender": sender[:200], "seq": 1, "time": time.time(),
                          "to": "", "body": {}}).encode()
    with pytest.raises(ProtocolError):
        Codec("coordinator").decode([payload])


# --- D11, D12, D13: init's settings ------------------------------------------------------------


@pytest.mark.parametrize("name, value", [
    ("skip_modules", None), ("skip_types", 3), ("token", 123), ("token", ""), ("coordinator", 123),
    ("replay", 5), ("sample_id_key", b"id"),
    ("heartbeat_s", True), ("detail_mb", True), ("grad_norm_warn", True), ("spike_factor", True),
    ("max_events", True), ("flight_steps", False), ("replay_rank", True),
    ("detail_mb", 1e308), ("detail_mb", 2.0**20 + 1), ("detail_mb", float("nan")), ("detail_mb", 10**400),
    ("heartbeat_s", float("inf")), ("grad_norm_warn", float("inf")), ("spike_factor", 1e309),
    ("max_events", 10**30), ("event_queue", 2**31), ("flight_steps", 10**19), ("max_pending", -1),
    ("replay_device", "meta"), ("replay_device", "meta:0"), ("replay_device", 1),
])
def test_a_bad_setting_is_a_config_error_that_names_it_and_its_value(name, value):
    with pytest.raises(ConfigError) as refused:
        Settings.resolve({name: value}, environ={})
    assert str(refused.value).startswith(f"{name}={value!r} must ") or (
        name == "replay_device" and str(refused.value).startswith(f"{name}={value!r} holds no data")), refused.value


def test_a_token_that_is_no_string_never_reaches_the_link():
    with pytest.raises(ConfigError, match="token=123 must be a non-empty string"):
        Settings.resolve({"token": 123, "coordinator": "tcp://127.0.0.1:1"}, environ={})


SECRET_NOT_UTF8 = "sekrit-\udcff"  # what Python makes of an environment variable holding the byte 0xff


@pytest.mark.parametrize("name", ["token", "operator_token"])
def test_a_secret_whose_bytes_are_not_utf8_is_refused_without_showing_it(name):
    from nanguard.config import setting_from_env
    with pytest.raises(ConfigError) as refused:
        setting_from_env(name, {f"NANGUARD_{name.upper()}": SECRET_NOT_UTF8})
    assert str(refused.value) == (f"NANGUARD_{name.upper()} is invalid: it holds bytes that are not UTF-8 text"
                                  " (set it to ASCII or UTF-8)")
    if name == "token":
        with pytest.raises(ConfigError, match="^token: it holds bytes that are not UTF-8") as refused:
            Settings.resolve({"token": SECRET_NOT_UTF8}, environ={})
        assert "sekrit" not in str(refused.value)


@pytest.mark.parametrize("argv, variable", [
    (["status", "--coordinator", "tcp://127.0.0.1:9", "--timeout-s", "1"], "NANGUARD_TOKEN"),
    (["stop", "--coordinator", "tcp://127.0.0.1:9", "--timeout-s", "1", "--reason", "x"], "NANGUARD_OPERATOR_TOKEN"),
    (["coordinator", "--bind", "tcp://127.0.0.1:0", "--metrics-port", "0"], "NANGUARD_OPERATOR_TOKEN"),
])
def test_the_commands_refuse_a_secret_that_is_not_utf8_on_one_line(argv, variable):
    err = assert_one_line_refusal(nanguard(*argv, env={variable: SECRET_NOT_UTF8}, timeout=30),
                                  f"{variable} is invalid: it holds bytes that are not UTF-8 text")
    assert "sekrit" not in err


def test_a_coordinator_that_is_no_string_reads_plainly():
    with pytest.raises(ConfigError) as refused:
        Settings.resolve({"coordinator": 123}, environ={})
    assert str(refused.value).startswith("coordinator=123 must be a string like tcp://host:port")


@pytest.mark.parametrize("variable, value", [
    ("NANGUARD_DETAIL_MB", "1e308"), ("NANGUARD_DETAIL_MB", "inf"), ("NANGUARD_HEARTBEAT_S", "nan"),
    ("NANGUARD_SPIKE_FACTOR", "1e400"), ("NANGUARD_MAX_EVENTS", "1" + "0" * 30),
    ("NANGUARD_FLIGHT_STEPS", "99999999999999999999"), ("NANGUARD_REPLAY_DEVICE", "meta"),
])
def test_a_bad_variable_is_a_config_error_that_names_it(variable, value):
    with pytest.raises(ConfigError, match=variable):
        Settings.resolve({}, environ={variable: value})


def test_the_meta_device_is_refused_with_what_to_do_instead():
    with pytest.raises(ConfigError, match=r"replay_device='meta' holds no data: replay on cpu, cuda or cuda:N"):
        Settings.resolve({"replay_device": "meta"}, environ={})
    for device in ("cpu", "cuda", "cuda:3", "mps", "xpu", "xpu:1"):
        assert Settings.resolve({"replay_device": device}, environ={}).replay_device == device


@PROPERTY
@given(value=st.floats() | st.integers(min_value=-(10**400), max_value=10**400) | st.booleans())
def test_any_accepted_detail_mb_is_a_count_of_bytes(value):
    try:
        accepted = Settings.resolve({"detail_mb": value}, environ={})
    except ConfigError as exc:
        assert str(exc).startswith("detail_mb=")
        return
    assert not isinstance(value, bool)
    assert 0 <= int(accepted.detail_mb * 2**20) <= 2**40  # what the guard makes of it


@PROPERTY
@given(value=st.integers(min_value=-(10**30), max_value=10**30) | st.booleans(),
       name=st.sampled_from(["max_events", "max_pending", "event_queue", "flight_steps", "spike_warmup_steps"]))
def test_any_accepted_count_sizes_a_container(value, name):
    try:
        accepted = Settings.resolve({name: value}, environ={})
    except ConfigError as exc:
        assert str(exc).startswith(f"{name}=")
        return
    assert not isinstance(value, bool)
    collections.deque(maxlen=getattr(accepted, name))
