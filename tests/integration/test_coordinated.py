"""Real torchrun jobs (gloo on CPU) reporting to a real coordinator subprocess over ZeroMQ.

What the ranks do when the coordinator is there, asks them to stop, dies, comes back, comes
late, or never comes; the coordinator's /metrics is read through Prometheus' text parser.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanguard.coordinator.control import request

pytestmark = pytest.mark.slow

SLOW_STEPS = ("--steps", "400", "--step-sleep", "0.05")


def wait_for_progress(progress: Path, steps: int, job, timeout: float = 60) -> None:
    """Until rank 0 has done ``steps`` steps (the worker writes the count after every step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if progress.exists() and progress.read_text() and int(progress.read_text()) >= steps:
            return
        if all(p.poll() is not None for p in job.procs):
            pytest.fail("the job ended before it made progress:\n" + job.wait(1).output[-4000:])
        time.sleep(0.1)
    pytest.fail(f"no progress to step {steps} within {timeout}s")


def stopped_at(job, step: int, world: int = 2) -> dict[int, dict]:
    """The ranks' results, once it is checked that every rank stopped on a NonFiniteError at ``step``."""
    results = job.ok(world=world)
    assert {r["error"]["event"]["step"] for r in results.values()} == {step}, results
    return results


def progress_file(tmp_path: Path) -> Path:
    return tmp_path / "progress"


@pytest.mark.timeout(240)
def test_nan_on_rank_1_stops_both_ranks_and_shows_in_metrics(torchrun, coordinator):
    coordinator.start()
    job = torchrun.standalone("ddp_train.py", "--fault", "forward", "--fault-rank", "1",
                              "--fault-step", "5", "--steps", "8",
                              env={"NANGUARD_COORDINATOR": coordinator.address})
    stopped_at(job, 5)
    assert coordinator.wait_for("nanguard_nonfinite_events_total", kind="forward", rank="1") == 1
    assert coordinator.wait_for("nanguard_stops_total", reason="nonfinite") == 1
    assert coordinator.wait_for("nanguard_incidents_total") == 1
    status = coordinator.cli("status", "--coordinator", coordinator.address)  # says what /metrics counts
    assert status.returncode == 0 and "(policy, counted as nonfinite)" in status.stdout, status.stdout + status.stderr
    # rank 0 saw no event of its own; both ranks reported progress
    assert coordinator.value("nanguard_nonfinite_events_total", kind="forward", rank="0") is None
    # the last heartbeat, sent when the guard closes, has the last step decided clean (4)
    assert coordinator.wait_for("nanguard_ranks_finished", at_least=2) == 2
    assert coordinator.value("nanguard_rank_step", rank="0") == coordinator.value("nanguard_rank_step",
                                                                                  rank="1") == 4
    assert coordinator.value("nanguard_bad_messages_total") == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("worker, fault, kind", [
    # FSDP2: every rank's forward uses the weight gathered with rank 1's bad shard
    ("fsdp_train.py", ("--fault", "weight"), "forward"),
    # accumulation without no_sync: rank 1's NaN of micro-batch 0 is in rank 0's buckets of micro-batch 1
    ("ddp_train.py", ("--fault", "backward", "--accum", "2", "--sync-every-micro"), "grad"),
], ids=["fsdp2 shard", "ddp accumulation"])
def test_only_the_rank_where_the_nan_was_born_reports_an_event(torchrun, coordinator, worker, fault, kind):
    coordinator.start()
    job = torchrun.standalone(worker, *fault, "--fault-rank", "1", "--fault-step", "3", "--steps", "5",
                              env={"NANGUARD_COORDINATOR": coordinator.address})
    results = job.ok(world=2)
    assert {r["error"]["event"]["rank"] for r in results.values()} == {1}, results
    assert coordinator.wait_for("nanguard_nonfinite_events_total", kind=kind, rank="1") == 1
    assert coordinator.wait_for("nanguard_ranks_finished", at_least=2) == 2
    assert coordinator.value("nanguard_nonfinite_events_total", kind=kind, rank="0") is None


@pytest.mark.timeout(240)
def test_an_evaluations_nan_is_counted_apart_and_the_job_trains_on(torchrun, coordinator):
    coordinator.start()
    job = torchrun.standalone("ddp_train.py", "--eval-nan-step", "3", "--fault-rank", "1", "--steps", "6",
                              env={"NANGUARD_COORDINATOR": coordinator.address})
    results = job.ok(world=2)
    assert all(r["error"] is None and r["steps_done"] == 6 for r in results.values()), results
    assert [e["rank"] for e in results[1]["events"]] == [1] and not results[0]["events"], results
    assert coordinator.wait_for("nanguard_evaluation_events_total", kind=results[1]["events"][0]["kind"],
                                rank="1") == 1
    assert coordinator.wait_for("nanguard_ranks_finished", at_least=2) == 2
    assert coordinator.value("nanguard_nonfinite_events_total", kind="forward", rank="1") is None
    assert coordinator.value("nanguard_stops_total", reason="nonfinite") == 0
    assert coordinator.value("nanguard_stops_total", reason="policy") == 0
    assert coordinator.value("nanguard_bad_messages_total") == 0


@pytest.mark.timeout(240)
def test_operator_stop_mid_run_stops_every_rank_at_one_step(torchrun, coordinator, tmp_path):
    coordinator.start()
    progress = progress_file(tmp_path)
    job = torchrun.spawn("ddp_train.py", *SLOW_STEPS, "--progress-file", str(progress),
                         env={"NANGUARD_COORDINATOR": coordinator.address})
    wait_for_progress(progress, 5, job)
    coordinator.wait_for("nanguard_ranks_alive", at_least=2)
    stop = coordinator.cli("stop", "--reason", "maintenance window", "--coordinator", coordinator.address)
    assert stop.returncode == 0, stop.stderr
    results = job.wait(120).results()
    stops = {rank: r["stop"] for rank, r in results.items()}
    assert all(s is not None for s in stops.values()), results
    assert len({s["step"] for s in stops.values()}) == 1, stops  # one common step
    for rank, s in stops.items():
        assert results[rank]["steps_done"] == s["step"] < 400
        assert s["weights_after"] == s["weights_before"], f"rank {rank} applied the stopped step"
    assert any("maintenance window" in s["reason"] for s in stops.values())
    assert coordinator.wait_for("nanguard_stops_total", reason="operator") == 1


@pytest.mark.timeout(240)
def test_coordinator_killed_and_restarted_mid_run(torchrun, coordinator, tmp_path):
    coordinator.start()
    progress = progress_file(tmp_path)
    job = torchrun.spawn("ddp_train.py", "--steps", "120", "--step-sleep", "0.05",
                         "--warn-every-step", "--progress-file", str(progress),
                         env={"NANGUARD_COORDINATOR": coordinator.address, "NANGUARD_HEARTBEAT_S": "0.2"})
    wait_for_progress(progress, 5, job)
    coordinator.kill()
    time.sleep(1.0)
    coordinator.start()  # same port, a fresh process that knows nothing of the job
    # the ranks re-register from their heartbeats, and their new events arrive
    coordinator.wait_for("nanguard_ranks_alive", at_least=2, timeout=20)
    coordinator.wait_for("nanguard_warning_events_total", kind="grad_norm", rank="0", timeout=20)
    results = job.wait(120).ok(world=2)
    assert all(r["steps_done"] == 120 for r in results.values())  # training went on


@pytest.mark.timeout(240)
def test_coordinator_started_after_the_ranks_gets_them_and_their_drop_counts(torchrun, coordinator,
                                                                               tmp_path):
    progress = progress_file(tmp_path)
    # a warning event every step and room for 2: while nobody listens, events are dropped
    job = torchrun.spawn("ddp_train.py", "--steps", "150", "--step-sleep", "0.05",
                         "--warn-every-step", "--progress-file", str(progress),
                         env={"NANGUARD_COORDINATOR": coordinator.address, "NANGUARD_EVENT_QUEUE": "2",
                              "NANGUARD_HEARTBEAT_S": "0.2"})
    wait_for_progress(progress, 20, job)
    coordinator.start()
    coordinator.wait_for("nanguard_ranks_registered", at_least=2, timeout=20)
    assert coordinator.wait_for("nanguard_events_dropped_total", rank="0", timeout=20) >= 1
    results = job.wait(120).ok(world=2)
    assert all(r["steps_done"] == 150 for r in results.values())


@pytest.mark.timeout(240)
def test_no_coordinator_at_all_the_job_is_still_guarded(torchrun, coordinator):
    nobody = coordinator.address  # never started: nothing listens there
    job = torchrun.standalone("ddp_train.py", "--fault", "forward", "--fault-rank", "1",
                              "--fault-step", "5", "--steps", "8", env={"NANGUARD_COORDINATOR": nobody})
    results = stopped_at(job, 5)
    assert all(r["error"]["incident"] for r in results.values())


@pytest.mark.timeout(240)
def test_token_authenticates_ranks_and_a_wrong_token_is_refused(torchrun, coordinator):
    coordinator.start(env={"NANGUARD_TOKEN": "s3cret"})
    job = torchrun.standalone("ddp_train.py", "--fault", "forward", "--fault-rank", "1",
                              "--fault-step", "3", "--steps", "6",
                              env={"NANGUARD_COORDINATOR": coordinator.address, "NANGUARD_TOKEN": "s3cret"})
    job.ok(world=2)
    assert coordinator.wait_for("nanguard_nonfinite_events_total", kind="forward", rank="1") == 1
    assert coordinator.value("nanguard_bad_messages_total") == 0
    # a job with the wrong token: every message refused, nothing registered, nothing stopped
    job = torchrun.standalone("ddp_train.py", "--fault", "forward", "--fault-rank", "0",
                              "--fault-step", "3", "--steps", "6",
                              env={"NANGUARD_COORDINATOR": coordinator.address, "NANGUARD_TOKEN": "wrong"})
    job.ok(world=2)  # the job is guarded locally all the same
    assert coordinator.wait_for("nanguard_bad_messages_total", at_least=1) >= 1
    assert coordinator.value("nanguard_bad_message_reasons_total", reason="unauthenticated") >= 1
    assert coordinator.value("nanguard_nonfinite_events_total", kind="forward", rank="0") is None
    status = coordinator.cli("status", "--json", "--coordinator", coordinator.address)
    assert status.returncode != 0  # no token: the operator is refused too (it times out)
    status = coordinator.cli("status", "--json", "--coordinator", coordinator.address,
                             env={"NANGUARD_TOKEN": "s3cret"})
    assert status.returncode == 0, status.stderr


SINGLE_PROCESS = """
import sys, time, torch, nanguard
from torch import nn
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
guard = nanguard.init(model, opt)
try:
    for step in range(100000):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 3:
            print("running", flush=True)
        time.sleep(0.02)
except nanguard.StopRequested as err:
    print(f"stopped at step {err.step}: {err.reason}", flush=True)
    sys.exit(0)
sys.exit(1)
"""


@pytest.mark.timeout(120)
def test_stop_without_torch_distributed_at_the_next_step(coordinator, tmp_path):
    import subprocess
    import sys

    coordinator.start()
    script = tmp_path / "single.py"
    script.write_text(SINGLE_PROCESS)
    env = {**coordinator.env(), "NANGUARD_COORDINATOR": coordinator.address}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "running"
        coordinator.wait_for("nanguard_ranks_alive", at_least=1)
        stop = coordinator.cli("stop", "--reason", "drain", "--coordinator", coordinator.address)
        assert stop.returncode == 0, stop.stderr
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "drain" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(240)
def test_two_nodes_report_to_one_coordinator(torchrun, coordinator):
    """Two torchrun agents (c10d rendezvous, as on two machines) with one coordinator: both
    nodes' ranks register, and the stop is counted once for the job."""
    coordinator.start()
    job = torchrun.multi_node("ddp_train.py", "--fault", "forward", "--fault-node", "1",
                              "--fault-step", "4", "--steps", "6",
                              env={"NANGUARD_COORDINATOR": coordinator.address})
    results = stopped_at(job, 4)
    assert coordinator.wait_for("nanguard_ranks_registered", at_least=2) == 2
    faulty = next(rank for rank, r in results.items() if r["faulty"])
    assert coordinator.wait_for("nanguard_nonfinite_events_total", kind="forward", rank=str(faulty)) == 1
    assert coordinator.wait_for("nanguard_stops_total", reason="nonfinite") == 1


@pytest.mark.timeout(300)
def test_each_node_reports_through_its_local_rank_0s_relay(torchrun, coordinator):
    """Two agents of two ranks each: every rank's link goes through its own node's relay (two relays,
    told apart by the node), the stop reaches all four at one step and each acks it."""
    coordinator.start()
    job = torchrun.multi_node("ddp_train.py", "--fault", "forward", "--fault-node", "1", "--fault-step", "3",
                              "--steps", "5", nproc=2, env={"NANGUARD_COORDINATOR": coordinator.address})
    stopped_at(job, 3, world=4)
    assert coordinator.wait_for("nanguard_ranks_finished", at_least=4) == 4
    status = request(coordinator.address, None, "status_request", {}, timeout_s=20).body
    assert [(r["rank"], r["relayed"]) for r in status["ranks"]] == [(rank, True) for rank in range(4)]
    assert sorted(status["stop"]["acked"]) == [0, 1, 2, 3]
    assert coordinator.value("nanguard_bad_messages_total") == 0


@pytest.mark.timeout(240)
def test_without_the_relay_every_rank_has_its_own_link(torchrun, coordinator):
    coordinator.start()
    job = torchrun.standalone("ddp_train.py", "--steps", "3",
                              env={"NANGUARD_COORDINATOR": coordinator.address, "NANGUARD_RELAY": "0"})
    job.ok(world=2)
    assert coordinator.wait_for("nanguard_ranks_finished", at_least=2) == 2
    status = request(coordinator.address, None, "status_request", {}, timeout_s=20).body
    assert [r["relayed"] for r in status["ranks"]] == [False, False]


GUARDED_SCRIPT = """
import os
import signal
import sys
import time
import torch
import nanguard
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
guard = nanguard.init(model, opt)
for step in range(3):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
from nanguard.coordinator.control import request  # (the test's own wait: this rank is registered)
deadline = time.monotonic() + 60
while not request(os.environ["NANGUARD_COORDINATOR"], None, "status_request", {}, timeout_s=20).body["ranks"]:
    assert time.monotonic() < deadline, "not registered within 60 s"
    time.sleep(0.05)
if sys.argv[1] == "raise":
    raise RuntimeError("the script's own error")
if sys.argv[1] == "with":
    with guard:
        raise KeyError("inside the guard's with block")
if sys.argv[1] == "finally":  # a collective that failed after a peer died, a guard closed on the way out
    try:
        raise RuntimeError("Connection closed by peer")
    finally:
        guard.close()
if sys.argv[1].startswith("signal"):  # a handler that ends the process with a code of its own
    signal.signal(signal.SIGUSR1, lambda signum, frame: sys.exit(3))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(30)  # (the handler runs first)
    finally:
        if sys.argv[1] == "signal-finally":
            guard.close()
if sys.argv[1] == "exit-0":
    sys.exit(0)
if sys.argv[1] == "nan-finally":  # nanguard's own stop, through a finally: ends as it always did
    try:
        model(torch.full((3, 4), float("nan"))).sum().backward()
        opt.step()
    finally:
        guard.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending, finished, returncode", [
    ("return", True, 0), ("exit-0", True, 0), ("raise", False, 1), ("with", False, 1), ("finally", False, 1),
    ("signal", False, 3), ("signal-finally", False, 3), ("nan-finally", True, 1)])
def test_a_rank_that_ends_by_an_error_is_failed_not_finished(coordinator, tmp_path, ending, finished, returncode):
    """The goodbye says how the process ended: a script that returns (or exits with 0) is finished;
    one ended by an uncaught exception (at exit, leaving ``with guard`` by it, or closing the guard in
    a ``finally`` on its way out) or by a non-zero exit code (a signal handler's ``sys.exit(3)``) is
    failed at once. nanguard's own stop through a ``finally`` reads finished, as before."""
    coordinator.start()
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script), ending], capture_output=True, text=True, timeout=90,
                          env=coordinator.env(NANGUARD_COORDINATOR=coordinator.address))
    assert done.returncode == returncode, done.stderr[-3000:]
    row = request(coordinator.address, None, "status_request", {}, timeout_s=20).body["ranks"][0]
    assert (row["finished"], row["failed"], row["alive"]) == (finished, not finished, False), row
    # the rank-count gauges are recounted on the coordinator's tick (0.5 s), both at once
    counted, other = ("nanguard_ranks_finished", "nanguard_ranks_failed")[::1 if finished else -1]
    assert coordinator.wait_for(counted, 1) == 1 and coordinator.value(other) == 0
