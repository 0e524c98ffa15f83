"""The operator side of the CLI: address checks, the status table, help and version; status and
stop against a real coordinator started with no option."""

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import nanguard

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
         "failed": False, "events": 0, "dropped": 0, "relayed": True},
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
    assert lines[1].split() == ["rank", "host", "link", "step", "last", "seen", "state", "events", "dropped"]
    assert lines[2].split() == ["0", "node1", "relayed", "41", "2.0", "s", "ago", "alive", "0", "0"]
    # (a coordinator of an earlier version says nothing of relays: direct)
    assert lines[3].split() == ["1", "?", "direct", "?", "100.0", "s", "ago", "dead", "12", "3"]
    assert lines[4].split() == ["2", "node2", "direct", "40", "1.0", "s", "ago", "failed", "0", "0"]
    assert lines[5].startswith("stop: command abc (operator) at ") and lines[5].endswith(
        ": maintenance; acked by 1 of 3 rank(s); nanguard clear lifts it")
    # the incarnation it stopped: the job, and the launch's restart count where the ranks said it
    for restart, of in ((2, "of job j restart 2"), (None, "of job j")):
        line = format_status({"job": "j", "ranks": ranks, "stop": {**stop, "job": "j", "restart": restart}},
                             now=1000.0).splitlines()[5]
        assert line.startswith(f"stop: command abc {of} (operator) at ")
    # a policy's stop says what /metrics counts it under (nanguard_stops_total{reason="nonfinite"})
    policy = {**stop, "origin": "policy", "reason": "rank 1 stopped at step 4 (nonfinite)", "counted_as": "nonfinite"}
    line = format_status({"job": "j", "ranks": ranks, "stop": policy}, now=1000.0).splitlines()[5]
    assert line.startswith("stop: command abc (policy, counted as nonfinite) at ")
    assert format_status({"job": None, "ranks": [], "stop": None}, now=0).splitlines() == [
        "job: (none yet), 0 rank(s)", "rank  host  link  step  last seen  state  events  dropped", "stop: none"]


def test_operator_commands_refuse_what_is_no_address(capsys, monkeypatch):
    monkeypatch.delenv("NANGUARD_COORDINATOR", raising=False)
    assert main(["status", "--coordinator", "localhost:5555"]) == 2
    assert "must look like tcp://host:port" in capsys.readouterr().err


def test_version_is_the_packages(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"nanguard {nanguard.__version__}\n"


@pytest.mark.parametrize("verb", [[], ["demo"], ["coordinator"], ["status"], ["stop"], ["keys"], ["inspect"]])
def test_help_is_plain_text(verb, capsys):
    with pytest.raises(SystemExit) as done:
        main([*verb, "--help"])
    text = capsys.readouterr().out
    assert done.value.code == 0 and "usage: nanguard" in text
    assert "`" not in text, text  # no markup: ``nanguard`` reads as noise on a terminal


def test_coordinator_help_names_the_secrets_it_reads(capsys):
    with pytest.raises(SystemExit):
        main(["coordinator", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for variable in ("NANGUARD_TOKEN", "NANGUARD_OPERATOR_TOKEN", "NANGUARD_CURVE_SECRET_KEY"):
        assert variable in text, text


def _nanguard(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanguard", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(120)
def test_status_and_stop_find_a_coordinator_started_with_no_option(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    # (the metrics port is the one option: another test may hold 9464; the address is the default)
    # (its log goes to a file: on the pipe, lines read ahead into the reader's buffer would hide the
    # ready line from select)
    with open(tmp_path / "coordinator.err", "wb") as err:
        daemon = subprocess.Popen([sys.executable, "-m", "nanguard", "coordinator", "--metrics-port", "0"],
                                  env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err,
                                  text=True, start_new_session=True)
    try:
        ready, _, _ = select.select([daemon.stdout], [], [], 30)
        line = daemon.stdout.readline() if ready else ""
        if not line.startswith("nanguard coordinator ready"):
            said = line + (tmp_path / "coordinator.err").read_text(errors="replace")
            if "in use" in said:
                pytest.skip("the default coordinator port is taken on this machine")
            pytest.fail("the coordinator did not start:\n" + said)
        status = _nanguard("status", env=env, cwd=tmp_path)
        assert status.returncode == 0 and status.stdout.startswith("job: (none yet), 0 rank(s)"), status.stderr
        stop = _nanguard("stop", "--reason", "maintenance", env=env, cwd=tmp_path)
        assert stop.returncode == 0, stop.stderr
        assert stop.stdout.startswith("Stop command ") and " sent: every rank stops at one common step" in stop.stdout
        again = _nanguard("stop", "--reason", "again", env=env, cwd=tmp_path)
        assert again.stdout.startswith(f"The job was already stopping (command {stop.stdout.split()[2]})")
    finally:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait(10)
        daemon.stdout.close()


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
