"""The operator side of the CLI without a daemon: address checks, the status table."""

import pytest

from nanguard.cli import format_status, main
from nanguard.coordinator.main import is_loopback


@pytest.mark.parametrize("bind, local", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.8.9.10:0", True), ("tcp://localhost:*", True),
    ("tcp://[::1]:5555", True), ("ipc:///tmp/nanguard.sock", True), ("inproc://x", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.0.0.5:5555", False),
    ("tcp://eth0:5555", False), ("tcp://master-node:5555", False), ("udp://127.0.0.1:1", False),
])
def test_is_loopback(bind, local):
    assert is_loopback(bind) is local


def test_status_table():
    ranks = [
        {"rank": 0, "host": "node1", "pid": 1, "world_size": 2, "step": 41, "step_time_s": 0.3,
         "grad_norm": 1.0, "last_seen": 998.0, "alive": True, "stalled": False, "finished": False,
         "failed": False, "events": 0, "dropped": 0},
        {"rank": 1, "host": "", "pid": None, "world_size": None, "step": None, "step_time_s": None,
         "grad_norm": None, "last_seen": 900.0, "alive": False, "stalled": False, "finished": False,
         "failed": False, "events": 12, "dropped": 3},
        {"rank": 2, "host": "node2", "pid": 3, "world_size": 2, "step": 40, "step_time_s": None,
         "grad_norm": None, "last_seen": 999.0, "alive": False, "stalled": False, "finished": False,
         "failed": True, "events": 0, "dropped": 0},
    ]
    stop = {"command_id": "abc", "origin": "operator", "reason": "maintenance", "time": 999.0, "acked": [0]}
    text = format_status({"job": "j", "ranks": ranks, "stop": stop}, now=1000.0)
    lines = text.splitlines()
    assert lines[0] == "job: j, 3 rank(s)"
    assert lines[1].split() == ["rank", "host", "step", "last", "seen", "state", "events", "dropped"]
    assert lines[2].split() == ["0", "node1", "41", "2.0", "s", "ago", "alive", "0", "0"]
    assert lines[3].split() == ["1", "?", "?", "100.0", "s", "ago", "dead", "12", "3"]
    assert lines[4].split() == ["2", "node2", "40", "1.0", "s", "ago", "failed", "0", "0"]
    assert lines[5].startswith("stop: command abc (operator) at ") and lines[5].endswith(
        ": maintenance; acked by 1 of 3 rank(s)")
    # a policy's stop says what /metrics counts it under (nanguard_stops_total{reason="nonfinite"})
    policy = {**stop, "origin": "policy", "reason": "rank 1 stopped at step 4 (nonfinite)", "counted_as": "nonfinite"}
    line = format_status({"job": "j", "ranks": ranks, "stop": policy}, now=1000.0).splitlines()[5]
    assert line.startswith("stop: command abc (policy, counted as nonfinite) at ")
    assert format_status({"job": None, "ranks": [], "stop": None}, now=0).splitlines() == [
        "job: (none yet), 0 rank(s)", "rank  host  step  last seen  state  events  dropped", "stop: none"]


@pytest.mark.parametrize("argv, fragment", [
    (["status"], "no coordinator address"),
    (["status", "--coordinator", "localhost:5555"], "must look like tcp://host:port"),
])
def test_operator_commands_need_an_address(argv, fragment, capsys, monkeypatch):
    monkeypatch.delenv("NANGUARD_COORDINATOR", raising=False)
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_nanguard_coordinator_alone_serves_on_loopback_with_a_log_here(monkeypatch):
    import nanguard.coordinator.main as daemon

    seen = []
    monkeypatch.setattr(daemon, "run", lambda args: seen.append(args) or 0)
    assert main(["coordinator"]) == 0
    (args,) = seen
    assert (args.bind, args.metrics_host, args.metrics_port) == ("tcp://127.0.0.1:5555", "127.0.0.1", 9464)
    assert args.log == "nanguard-coordinator.jsonl" and is_loopback(args.bind)


def test_nanguard_keys_prints_a_pair(capsys):
    from nanguard import curve

    assert main(["keys"]) == 0
    keys = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines() if "=" in line)
    assert curve.public_key(keys["NANGUARD_CURVE_SECRET_KEY"]) == keys["NANGUARD_CURVE_PUBLIC_KEY"]
