"""What a standing stop does to the next processes of its job (issue 31, item 5), with a real coordinator
subprocess and ranks simulated by real DEALER connections that say their TORCHELASTIC_RESTART_COUNT:
a torchrun restart of the stopped launch is stopped (``--on-restart stop``) or runs (``run``), a new
launch of the same run id runs, ``nanguard clear`` (operator credential only) lifts the stop, and all
of it survives a restart of the coordinator. Every wait is a poll under a deadline; every process and
socket is closed by the fixtures.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys

import pytest
import zmq

from nanguard.wire import Codec

from test_coordinator import clean_env, wait_for
from test_coordinator_faults import DEADLINE_S, OPERATOR_TOKEN, SECRETS, TOKEN, Daemon, Rank, handshake

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def coordinators(tmp_path):
    """``coordinators(*args)``: a started coordinator holding both tokens, killed when the test ends."""
    started: list[Daemon] = []
    yield lambda *args: started.append(Daemon(tmp_path, f"c{len(started)}", args, SECRETS)) or started[-1]
    for daemon in started:
        daemon.kill()
    assert not [d.stderr() for d in started if "Traceback" in d.stderr()]


@pytest.fixture
def links():
    """``links(address)``: a DEALER connected to ``address``, closed with linger 0 at the end."""
    with contextlib.ExitStack() as stack:
        def make(address: str) -> zmq.Socket:
            sock = stack.enter_context(zmq.Context.instance().socket(zmq.DEALER))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            return sock

        yield make


class Process(Rank):
    """Rank 0 of a one-rank job ``none`` (torchrun's run id when none is set), one process of launch
    ``restart``, over a raw DEALER: hello, a non-finite event, its stop, its goodbye."""

    def __init__(self, sock: zmq.Socket, name: str, restart: int, job: str = "none"):
        self.sock, self.codec, self.job, self.pid = sock, Codec(name, TOKEN), job, 1000 + restart
        self.instance = handshake(sock, self.codec)
        body = {"rank": 0, "local_rank": 0, "world_size": 1, "host": "testhost", "pid": self.pid, "job": job,
                "device": "cpu", "version": "test", "restart": restart}
        sock.send_multipart(self.codec.encode("hello", body, to=self.instance))

    def bye(self) -> None:
        """An unclean goodbye: what a rank ended by NonFiniteError or StopRequested says."""
        self.sock.send_multipart(self.codec.encode("bye", {"rank": 0, "job": self.job, "clean": False},
                                                   to=self.instance))

    def registered(self, coordinator) -> dict | None:
        """Wait until the coordinator has this process as rank 0; then its standing stop (or None).
        The hello was handled before the status request: a stop for this process is already sent."""
        wait_for(lambda: [r["pid"] for r in coordinator.status()["ranks"]] == [self.pid],
                 f"pid {self.pid} registered", timeout_s=DEADLINE_S)
        return coordinator.status()["stop"]

    def got_no_stop(self) -> bool:
        """No stop came: the coordinator answers this process's own status request after anything it
        sent it before (one connection, in order; the ``received`` that lets a hello in is passed over)."""
        self.sock.send_multipart(self.codec.encode("status_request", {}, to=self.instance))
        while True:
            assert self.sock.poll(DEADLINE_S * 1000), f"no answer within {DEADLINE_S:g} s"
            type_ = self.codec.decode(self.sock.recv_multipart()).type
            if type_ != "received":
                return type_ == "status"


def nanguard(coordinator, *args: str, operator: bool = True) -> subprocess.CompletedProcess:
    """``nanguard ARGS`` against ``coordinator``, as an operator (or with the ranks' token only)."""
    env = clean_env(NANGUARD_TOKEN=TOKEN, **({"NANGUARD_OPERATOR_TOKEN": OPERATOR_TOKEN} if operator else {}))
    return subprocess.run([sys.executable, "-m", "nanguard", *args, "--coordinator", coordinator.address],
                          env=env, capture_output=True, text=True, timeout=60)


def stopped_launch(coordinator, links) -> dict:
    """The first launch of job ``none`` goes non-finite at step 10, is stopped and ends; its stop."""
    first = Process(links(coordinator.address), "launch1-restart0", restart=0)
    first.nan(step=10)
    command = first.stop()
    first.bye()
    return command


def test_a_torchrun_restart_is_stopped_and_a_new_launch_runs_across_a_coordinator_restart(coordinators, links):
    coordinator = coordinators()
    command = stopped_launch(coordinator, links)
    coordinator.restart()  # the stop and the launch it stopped are kept in the state file
    state = json.loads(coordinator.log.with_suffix(".state.json").read_text())
    assert (state["restart"], state["stop"]["job"], state["stop"]["restart"]) == (0, "none", 0)
    # torchrun restarts the worker: the same run id, restart count 1; stopped at its first step
    restarted = Process(links(coordinator.address), "launch1-restart1", restart=1)
    assert restarted.stop()["command_id"] == command["command_id"]
    assert restarted.registered(coordinator)["command_id"] == command["command_id"]
    restarted.bye()
    # an hour later, the cause fixed, the same command again: run id "none", restart count 0
    launch = Process(links(coordinator.address), "launch2-restart0", restart=0)
    assert launch.registered(coordinator) is None
    assert launch.got_no_stop()
    launch.nan(step=3)  # and it is guarded as the first launch was
    assert launch.stop()["command_id"] != command["command_id"]
    said = coordinator.stderr()
    assert f"the stop of job none restart 0 (command {command['command_id']}: non-finite" in said
    assert "holds for its torchrun restart, job none restart 1 (--on-restart stop" in said
    assert f"the stop of job none restart 0 (command {command['command_id']}) is lifted for job none restart 0 " \
           "(a new launch)" in said


def test_with_on_restart_run_a_torchrun_restart_runs(coordinators, links):
    coordinator = coordinators("--on-restart", "run")
    command = stopped_launch(coordinator, links)
    restarted = Process(links(coordinator.address), "launch1-restart1", restart=1)
    assert restarted.registered(coordinator) is None
    assert restarted.got_no_stop()
    assert coordinator.metric("nanguard_job_stopped") == 0
    assert f"(command {command['command_id']}) is lifted for job none restart 1 (its torchrun restart, " \
           "--on-restart run)" in coordinator.stderr()


def test_nanguard_clear_lifts_a_standing_stop_only_with_the_operator_credential(coordinators, links):
    coordinator = coordinators()
    command = stopped_launch(coordinator, links)
    shown = nanguard(coordinator, "status")
    assert shown.returncode == 0, shown.stderr
    assert f"stop: command {command['command_id']} of job none restart 0 (policy" in shown.stdout
    # a rank's credential cannot lift it
    refused = nanguard(coordinator, "clear", "--reason", "a rank tries", operator=False)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.strip() == ("nanguard clear: the coordinator refused the request: lifting a job's stop "
                                      "needs the operator credential: set NANGUARD_OPERATOR_TOKEN on the coordinator "
                                      "and in the operator's environment (ranks never hold it)")
    assert coordinator.status()["stop"]["command_id"] == command["command_id"]
    assert coordinator.metric("nanguard_bad_message_reasons_total", reason="forbidden") == 1
    # the operator's does, and says so in the coordinator's log, with who and why
    cleared = nanguard(coordinator, "clear", "--reason", "fixed the data loader")
    assert cleared.returncode == 0, cleared.stderr
    assert cleared.stdout.startswith(f"Stop command {command['command_id']} lifted")
    assert coordinator.status()["stop"] is None and coordinator.metric("nanguard_job_stopped") == 0
    lines = [line for line in coordinator.stderr().splitlines() if "lifted the stop" in line]
    assert len(lines) == 1 and " WARNING: operator operator@" in lines[0]
    assert lines[0].endswith(f"lifted the stop of job none restart 0 (command {command['command_id']}: non-finite "
                             "forward event on rank 0 at step 10 (layer blocks.1.gate)): fixed the data loader; "
                             "ranks that register from now on run")
    # kept across a restart of the coordinator; the next process of the same launch runs
    coordinator.restart()
    assert json.loads(coordinator.log.with_suffix(".state.json").read_text())["stop"] is None
    restarted = Process(links(coordinator.address), "launch1-restart1", restart=1)
    assert restarted.registered(coordinator) is None and restarted.got_no_stop()
    assert nanguard(coordinator, "clear", "--reason", "again").stdout == "No stop was standing; nothing changed.\n"


@pytest.mark.timeout(600)
def test_a_real_torchrun_restart_is_stopped_and_the_next_launch_of_run_id_none_runs(torchrun, coordinator):
    """Two real launches of a 2-rank job with torchrun's default run id (``none``): the first goes
    non-finite at step 2, torchrun restarts it (--max-restarts 1) and the standing stop ends the
    restart (which would not meet the NaN again) at its first step; the second, the cause fixed, runs."""
    # a rank torchrun kills says no bye: it counts as alive for --dead-after-s, and the next launch's
    # hellos are refused until then, and sent again (every 5 s) until let in
    coordinator.start("--dead-after-s", "4", env=SECRETS)
    env = {"NANGUARD_COORDINATOR": coordinator.address, "NANGUARD_TOKEN": TOKEN}
    first = torchrun.spawn("uncaught.py", "--fault-rank", "1", "--fault-restart", "0", "--steps", "3000",
                           "--step-sleep", "0.05", env=env, max_restarts=1, run_id=False).wait(240)
    tail = first.output[-6000:]
    assert first.returncodes != [0], tail
    assert "nanguard: NonFiniteError ended the job at step 2" in first.output, tail  # restart 0
    # restart 1: the stop holds; its reason is the coordinator's first word of the NaN, the rank's
    # event or its "stopped" message, whichever reached it first
    assert re.search(r"nanguard: StopRequested ended the job: stop requested \((non-finite|rank 1 stopped at "
                     r"step 2 \(nonfinite\))", first.output), tail
    fixed = torchrun.spawn("uncaught.py", "--fault-rank", "-1", "--steps", "300", "--step-sleep", "0.05", env=env,
                           run_id=False).wait(150)
    assert fixed.returncodes == [0], fixed.output[-6000:]
    said = (coordinator.tmp_path / "coordinator1.err").read_text()
    assert "holds for its torchrun restart, job none restart 1 (--on-restart stop" in said, said[-4000:]
    assert "is lifted for job none restart 0 (a new launch)" in said, said[-4000:]
