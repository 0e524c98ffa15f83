"""Real torchrun jobs (gloo on CPU): every rank stops at the same step, before the update.

Each test launches one job of the workers in tests/integration/workers/ and asserts on the
JSON each rank wrote. Run with: python -m pytest -q tests/integration
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from common import FAULT_LAYER, FIRST_LAYER  # noqa: E402  (no torch import at collection)

pytestmark = pytest.mark.slow


def assert_common_stop(results: dict[int, dict], step: int, *, same_weights_across_ranks=True):
    """Every rank raised NonFiniteError at ``step`` with one identical event, and neither the
    weights nor the optimizer state moved in that step. Returns the (common) event."""
    errors = {rank: r["error"] for rank, r in results.items()}
    for rank, error in errors.items():
        assert error is not None, f"rank {rank} did not raise (ran {results[rank]['steps_done']} steps)"
        assert error["type"] == "NonFiniteError" and error["is_runtime_error"]
        assert error["loop_step"] == step, f"rank {rank} raised in loop step {error['loop_step']}"
        assert error["event"]["step"] == step
        assert results[rank]["steps_done"] == step
        # nothing of the bad step reached the weights or the optimizer state
        assert error["weights_after"] == error["weights_before"], f"rank {rank}: weights changed"
        assert error["optim_after"] == error["optim_before"], f"rank {rank}: optimizer state changed"
        assert error["weights_after"] == results[rank]["step_digests"][step]
    # the same step and the same event (all its fields) on every rank
    assert len({e["guard_step"] for e in errors.values()}) == 1, errors
    # guard.step counts the refused call too (the demo prints guard.step - 1 as the stop step)
    assert errors[0]["guard_step"] == step + 1
    events = [e["event"] for e in errors.values()]
    assert all(e == events[0] for e in events), events
    if same_weights_across_ranks:
        assert len({e["weights_after"] for e in errors.values()}) == 1, "ranks' weights differ"
        assert len({e["optim_after"] for e in errors.values()}) == 1, "ranks' optimizer state differ"
    return events[0]


def ddp_fault_on_rank_1(torchrun, fault):
    """A 2-rank DDP job whose rank 1 meets ``fault`` at step 5: the common stop's event."""
    job = torchrun.standalone("ddp_train.py", "--fault", fault, "--fault-rank", "1",
                              "--fault-step", "5", "--steps", "8")
    return job, assert_common_stop(job.ok(world=2), step=5)


@pytest.mark.timeout(180)
def test_ddp_forward_nan_on_one_rank_stops_every_rank_before_the_update(torchrun):
    job, event = ddp_fault_on_rank_1(torchrun, "forward")
    assert event["kind"] == "forward"
    assert event["rank"] == 1
    assert event["layer"] == FAULT_LAYER  # no DDP "module." prefix
    assert event["module_type"] == "Fault"
    assert event["input_nonfinite"] is False
    assert event["output_nonfinite"] is True
    assert event["has_nan"] is True
    # only the producing rank logs the report
    assert job.output.count(f"nanguard: non-finite output in {FAULT_LAYER}") == 1
    # every rank wrote its part of one incident, which reads back whole
    from nanguard import incident as capture

    incidents = {r["error"]["incident"] for r in job.ok(world=2).values()}
    assert len(incidents) == 1 and None not in incidents
    incident = capture.read_incident(incidents.pop())
    assert (incident.step, incident.world_size) == (5, 2)
    assert incident.first_event.to_dict() == event
    for rank in (0, 1):
        assert incident.rank_batches(rank) and incident.rank_state(rank)["model"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("worker, fault, accum, micro, kind, layer, same_weights, verdict", [
    # the workers' Fault goes off again on the same input in rank 1's process only: tied to that
    # process, as a device's fault is, so the peer's re-run is clean
    ("ddp_train.py", "forward", 1, 0, "forward", FAULT_LAYER, True, "device"),
    ("ddp_train.py", "backward", 1, 0, "grad", "blocks.1.fc.weight", True, "device"),
    ("ddp_train.py", "forward", 3, 2, "forward", FAULT_LAYER, True, "device"),  # no_sync micro-batches
    ("ddp_train.py", "backward", 3, 1, "grad", "blocks.1.fc.weight", True, "device"),
    # a NaN in the batch is bad wherever it is re-run
    ("ddp_train.py", "input", 1, 0, "forward", FIRST_LAYER, True, "reproducible"),
    # rank 1's own weight went NaN before the step: the replicas differ, so no peer can re-run it
    ("ddp_train.py", "weight", 1, 0, "forward", "blocks.1.fc", False, "reproducible"),
    # FSDP2: the ranks re-run together; no peer holds a whole copy of the weights to compare on
    ("fsdp_train.py", "forward", 1, 0, "forward", FAULT_LAYER, False, "reproducible"),
])
def test_the_sentinel_names_what_the_full_mode_names_and_the_re_run_reproduces_it(
        torchrun, worker, fault, accum, micro, kind, layer, same_weights, verdict):
    events = {}
    for mode in ("full", "sentinel"):
        job = torchrun.standalone(worker, "--fault", fault, "--fault-rank", "1", "--fault-step", "3",
                                  "--fault-micro", str(micro), "--accum", str(accum), "--steps", "5",
                                  "--mode", mode)
        events[mode] = assert_common_stop(job.ok(world=2), step=3, same_weights_across_ranks=same_weights)
    full, sentinel = events["full"], events["sentinel"]
    for name in ("step", "rank", "kind", "layer", "module_type", "micro_batch", "input_nonfinite"):
        assert full[name] == sentinel[name], (name, full, sentinel)
    assert (sentinel["kind"], sentinel["layer"], sentinel["rank"]) == (kind, layer, 1)
    if accum > 1:  # under no_sync too, a backward-born NaN is given its micro-batch (each one's backward re-run apart)
        assert sentinel["micro_batch"] == micro, sentinel
    assert (sentinel["reproduced"], sentinel["verdict"], sentinel["device"]) == (True, verdict, "cpu"), sentinel["message"]
    said = {"device": "clean when re-run on rank 0's device", "reproducible": "bad again when re-run on rank 0's"}
    if fault == "weight":
        assert "the ranks' weights differ" in sentinel["message"], sentinel["message"]
    elif worker == "ddp_train.py":
        assert said[verdict] in sentinel["message"], sentinel["message"]
    # the full mode re-runs the bad step too, for the same verdict
    assert (full["reproduced"], full["verdict"], full["device"]) == (True, verdict, "cpu"), full["message"]


@pytest.mark.timeout(180)
def test_a_fault_of_the_moment_on_one_rank_is_a_transient_of_that_rank(torchrun):
    # rank 1's forward goes NaN once, as a device's fault would; its re-run is clean
    job = torchrun.standalone("ddp_train.py", "--fault", "forward", "--fault-once", "--fault-rank", "1",
                              "--fault-step", "3", "--steps", "5", "--mode", "sentinel")
    event = assert_common_stop(job.ok(world=2), step=3)
    assert (event["rank"], event["reproduced"], event["verdict"], event["device"]) == (1, False, "transient", "cpu")
    assert event["layer"] == "" and "not reproduced" in event["message"]


@pytest.mark.timeout(180)
def test_ddp_a_nan_that_a_collective_in_the_forward_spreads_is_named_on_the_rank_it_was_born(torchrun):
    # a cross-rank mean before the head hands rank 1's NaN to rank 0, where the first bad output is
    # the mean's: the job's event is rank 1's fault, seen earlier in the step, not the lowest rank's
    job = torchrun.standalone("ddp_train.py", "--fault", "forward", "--fault-rank", "1", "--fault-step", "5",
                              "--steps", "8", "--synced")
    event = assert_common_stop(job.ok(world=2), step=5)
    assert (event["rank"], event["layer"], event["input_nonfinite"]) == (1, FAULT_LAYER, False)


@pytest.mark.timeout(180)
def test_ddp_nan_in_the_input_batch_is_reported_as_an_input(torchrun):
    _, event = ddp_fault_on_rank_1(torchrun, "input")
    assert event["kind"] == "forward"
    assert event["rank"] == 1
    assert event["input_nonfinite"] is True
    assert event["layer"] == FIRST_LAYER  # the first module the bad batch reached


@pytest.mark.timeout(180)
def test_ddp_nan_born_in_backward_on_one_rank(torchrun):
    _, event = ddp_fault_on_rank_1(torchrun, "backward")
    assert event["kind"] == "grad"
    # the first non-finite gradient in backward order: the parameter just before the fault
    assert event["layer"] == "blocks.1.fc.weight"
    assert set(event["extra"]["bad_params"]) == {
        f"{m}.{p}" for m in ("embed", "blocks.0.fc", "blocks.1.fc") for p in ("weight", "bias")}
    # DESIGN, Contract: err.event is the job's first event "whichever rank saw it ... a forward
    # producer wins over the gradients it poisoned, and over what DDP's all-reduce spread to
    # other ranks". Rank 0's NaN gradients are only what the all-reduce spread from rank 1.
    assert event["extra"]["born_here"] is True
    assert event["rank"] == 1, (
        f"job's first event names rank {event['rank']}; the NaN was born on rank 1 and DDP's"
        " all-reduce only spread it to rank 0")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault, extra, rank", [
    ("after-backward", (), 1),  # rank 1's script divides a gradient by 0 after backward()
    ("backward-huge", ("--fp16-hook",), 0),  # a finite float32 gradient overflows in fp16 compression
], ids=["script", "fp16 compression"])
def test_ddp_gradients_made_non_finite_after_the_backward_pass_are_never_applied(torchrun, fault, extra, rank):
    job = torchrun.standalone("ddp_train.py", "--fault", fault, "--fault-rank", "1", "--fault-step", "5",
                              "--steps", "8", *extra)
    event = assert_common_stop(job.ok(world=2), step=5)
    assert (event["kind"], event["rank"], event["extra"]["after_backward"]) == ("grad", rank, True), event
    assert "finite as the backward pass left it" in event["message"]
    if fault == "after-backward":
        assert event["layer"] == "blocks.1.fc.weight"


@pytest.mark.timeout(180)
def test_ddp_a_nan_that_a_collective_in_the_backward_spreads_is_named_on_the_rank_it_was_born(torchrun):
    # a cross-rank mean after embed, whose backward all-reduces gradients (a synchronised norm's
    # does): rank 1's NaN, born in blocks.1's backward, reaches rank 0's embed gradient through it
    job = torchrun.standalone("ddp_train.py", "--fault", "backward", "--fault-rank", "1", "--fault-step", "5",
                              "--steps", "8", "--sync-grad")
    event = assert_common_stop(job.ok(world=2), step=5)
    assert (event["kind"], event["rank"], event["layer"]) == ("grad", 1, "blocks.1.fc.weight"), event


@pytest.mark.timeout(180)
def test_gradients_summed_by_hand_name_no_rank_as_where_they_were_born(torchrun):
    # no DDP: rank 1's script divides a gradient by 0, then all-reduces every gradient itself; every
    # rank then holds the same bad values, and nothing tells which rank they came from
    job = torchrun.standalone("ddp_train.py", "--fault", "after-backward", "--fault-rank", "1", "--fault-step", "5",
                              "--steps", "8", "--hand-sum")
    event = assert_common_stop(job.ok(world=2), step=5)
    assert (event["kind"], event["layer"], event["rank"]) == ("grad", "blocks.1.fc.weight", 0), event
    assert "the one where they were born is not known" in event["message"]


@pytest.mark.timeout(180)
def test_ddp_skip_policy_drops_the_bad_update_and_goes_on(torchrun):
    steps, bad = 10, 5
    job = torchrun.standalone("ddp_train.py", "--fault", "forward", "--fault-rank", "1",
                              "--fault-step", str(bad), "--steps", str(steps), "--on-nan", "skip")
    results = job.ok(world=2)
    for rank, r in results.items():
        assert r["error"] is None, f"rank {rank} raised under on_nan=skip: {r['error']}"
        assert r["steps_done"] == steps
        assert r["guard_step"] == steps
        assert r["skipped_steps"] == 1
        assert r["final_finite"]
        digests = r["step_digests"]
        assert digests[bad + 1] == digests[bad], f"rank {rank}: the bad update at step {bad} was applied"
        assert digests[bad] != digests[bad - 1] and digests[bad + 2] != digests[bad + 1], (
            "training did not move the weights around the skipped step")
        assert len(set(digests)) == steps - 1  # every other step did update
        stops = [e for e in r["events"] if e["kind"] in ("forward", "grad")]
        assert stops and all(e["step"] == bad for e in stops)
    assert results[0]["step_digests"] == results[1]["step_digests"], "ranks diverged"
    assert results[0]["final_weights"] == results[1]["final_weights"]


@pytest.mark.timeout(180)
def test_ddp_gradient_accumulation_names_the_micro_batch(torchrun):
    job = torchrun.standalone("ddp_train.py", "--fault", "forward", "--fault-rank", "0",
                              "--fault-step", "3", "--fault-micro", "2", "--accum", "4",
                              "--steps", "5")
    event = assert_common_stop(job.ok(world=2), step=3)
    assert event["kind"] == "forward"
    assert event["rank"] == 0
    assert event["layer"] == FAULT_LAYER
    assert event["micro_batch"] == 2


@pytest.mark.timeout(180)
def test_ddp_accumulation_without_no_sync_names_the_rank_whose_backward_made_the_nan(torchrun):
    # every micro-batch's backward all-reduces: rank 1's NaN of micro-batch 0 is in every rank's
    # accumulated gradients, and so in rank 0's buckets of micro-batch 1, before their all-reduce
    job = torchrun.standalone("ddp_train.py", "--fault", "backward", "--fault-rank", "1", "--fault-step", "3",
                              "--fault-micro", "0", "--accum", "2", "--sync-every-micro", "--steps", "5")
    results = job.ok(world=2)
    event = assert_common_stop(results, step=3)
    assert (event["kind"], event["rank"], event["layer"]) == ("grad", 1, "blocks.1.fc.weight"), event
    (own,) = [e for e in results[0]["events"] if e["rank"] == 0]
    assert "right after the sum across ranks of backward pass 1 of this step" in own["message"], own["message"]
    assert own["extra"]["born_here"] is False


@pytest.mark.timeout(180)
def test_ddp_accumulation_without_no_sync_names_a_sum_that_overflowed(torchrun):
    # rank 1's gradients of micro-batch 0 are huge but finite: fp16 compression of that pass's sum
    # overflows, and every rank's buckets of micro-batch 1 hold the infinities
    job = torchrun.standalone("ddp_train.py", "--fault", "backward-huge", "--fault-rank", "1", "--fault-step", "3",
                              "--fault-micro", "0", "--accum", "2", "--sync-every-micro", "--fp16-hook-after-init",
                              "--steps", "5")
    event = assert_common_stop(job.ok(world=2), step=3)
    assert (event["kind"], event["extra"]["born_here"]) == ("grad", False), event
    assert "right after the sum across ranks of backward pass 1 of this step" in event["message"], event["message"]


@pytest.mark.timeout(180)
def test_ddp_with_a_hook_registered_before_init_the_receiving_rank_offers_the_sum(torchrun):
    # fp16 compression registered before init: no bucket is watched; rank 0's gradients were finite as
    # its backward pass left them, and the sum across ranks brought rank 1's NaN
    job = torchrun.standalone("ddp_train.py", "--fault", "backward", "--fault-rank", "1", "--fault-step", "3",
                              "--steps", "5", "--fp16-hook")
    results = job.ok(world=2)
    event = assert_common_stop(results, step=3)
    assert (event["kind"], event["rank"]) == ("grad", 1), event
    (own,) = [e for e in results[0]["events"] if e["rank"] == 0]
    assert "by the sum across ranks" in own["message"], own["message"]


@pytest.mark.timeout(180)
def test_ddp_a_batch_every_rank_drops_before_its_backward_pass_stops_nothing(torchrun, guard_mode):
    # the script's own guard, agreed across ranks: rank 1's NaN input makes its loss NaN, and
    # every rank drops that micro-batch; a later real fault still stops before its update
    job = torchrun.standalone("ddp_train.py", "--fault", "input", "--fault-rank", "1", "--fault-step", "3",
                              "--skip-nan-loss", "--steps", "6")
    results = job.ok(world=2)
    assert all(r["error"] is None and r["steps_done"] == 6 for r in results.values()), results
    assert results[0]["final_weights"] == results[1]["final_weights"]
    if guard_mode == "sentinel":  # the dropped forward reached nothing the sentinel reads: not looked at
        assert not results[0]["events"] and not results[1]["events"]
        return
    (event,) = results[1]["events"]
    assert (event["kind"], event["step"], event["rank"]) == ("forward", 3, 1), event
    assert "never backpropagated before the optimizer step" in event["message"]
    assert not results[0]["events"] and results[0]["final_weights"] == results[1]["final_weights"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["forward", "backward", "backward-fp16-hook"])
def test_ddp_made_again_during_training_still_names_where_the_nan_was_born(torchrun, fault):
    # at step 2 every rank wraps the model in a new DDP and lets the old one go: the new wrapper
    # calls the guarded model, whose forwards are the micro-batches, and its buckets are watched,
    # also when the script registers a communication hook on it as soon as it is built (fp16
    # compression, before its first forward: the first wrapper's, registered before init, is not)
    fault, _, hook = fault.partition("-")
    job = torchrun.standalone("ddp_train.py", "--fault", fault, "--fault-rank", "1", "--fault-step", "4",
                              "--rewrap-step", "2", "--steps", "6", *(["--fp16-hook"] if hook else []))
    results = job.ok(world=2)
    event = assert_common_stop(results, step=4)
    assert event["rank"] == 1, event
    if fault == "forward":
        assert (event["kind"], event["layer"], event["input_nonfinite"]) == ("forward", FAULT_LAYER, False), event
    else:
        assert (event["kind"], event["layer"], event["extra"]["born_here"]) == ("grad", "blocks.1.fc.weight", True)
        (own,) = [e for e in results[0]["events"] if e["rank"] == 0]
        assert "by the sum across ranks" in own["message"], own["message"]
    assert "is gone" not in job.output  # the model the old wrapper held is saved
    from nanguard import incident as capture

    incident = capture.read_incident(results[0]["error"]["incident"])
    for rank in (0, 1):
        assert incident.rank_batches(rank) and incident.rank_state(rank)["model"]


@pytest.mark.timeout(180)
def test_zero_redundancy_optimizer_stops_before_the_update_and_each_rank_saves_its_shard(torchrun):
    # ZeroRedundancyOptimizer steps a local AdamW inside its own step: that is not a second
    # optimizer, and the state it holds (this rank's shard) is what an incident saves
    job = torchrun.standalone("ddp_train.py", "--zero", "--fault", "backward", "--fault-rank", "1",
                              "--fault-step", "3", "--steps", "5")
    results = job.ok(world=2)
    event = assert_common_stop(results, step=3, same_weights_across_ranks=False)
    assert (event["kind"], event["rank"], event["layer"]) == ("grad", 1, "blocks.1.fc.weight"), event
    assert "not given to nanguard.init" not in job.output and "could not write" not in job.output
    from nanguard import incident as capture

    incident = capture.read_incident(results[0]["error"]["incident"])
    assert incident.manifest["sharded"].startswith("zero:")
    shards = [incident.rank_state(rank)["optimizer"]["state"] for rank in (0, 1)]
    # every parameter's state is in one rank's shard (the model has no buffers)
    assert all(shards) and sum(len(s) for s in shards) == len(incident.rank_state(0)["model"])
    # each rank's replay loads its own shard into its local optimizer; the script's fault, armed
    # again at the replayed step (its loop's first), brings the NaN back
    _, report = replay_job(torchrun, results[0]["error"]["incident"], "--zero", "--fault", "backward",
                           "--fault-rank", "1", "--fault-step", "0", "--steps", "5")
    assert report["verdict"] == "reproducible", report["message"]
    assert not any("optimizer state" in note and "not loaded" in note for note in report.get("notes", [])), report


@pytest.mark.timeout(180)
def test_three_ranks_clean_run_never_stops(torchrun):
    job = torchrun.standalone("ddp_train.py", "--steps", "30", nproc=3)
    results = job.ok(world=3)
    for rank, r in results.items():
        assert r["error"] is None, f"rank {rank} raised on a clean run: {r['error']}"
        assert r["steps_done"] == 30
        assert r["guard_step"] == 30
        assert r["skipped_steps"] == 0
        assert r["final_finite"]
        assert not [e for e in r["events"] if e["kind"] in ("forward", "loss", "check", "backward", "grad")]
    assert len({r["final_weights"] for r in results.values()}) == 1


@pytest.mark.timeout(180)
def test_two_nodes_c10d_rendezvous_stop_together(torchrun):
    job = torchrun.multi_node("ddp_train.py", "--fault", "forward", "--fault-node", "1",
                              "--fault-step", "4", "--steps", "6")
    results = job.ok(world=2)
    # c10d rendezvous ignores --node-rank: find the rank that node 1's agent got
    (faulty_rank,) = [rank for rank, r in results.items() if r["faulty"]]
    assert results[faulty_rank]["node"] == "1"
    event = assert_common_stop(results, step=4)
    assert event["kind"] == "forward"
    assert event["rank"] == faulty_rank
    assert event["layer"] == FAULT_LAYER


@pytest.mark.timeout(180)
def test_fsdp2_forward_nan_stops_every_rank_before_the_update(torchrun):
    job = torchrun.standalone("fsdp_train.py", "--fault", "forward", "--fault-rank", "1",
                              "--fault-step", "4", "--steps", "6")
    # each rank holds a different shard: compare each rank's before/after, not across ranks
    event = assert_common_stop(job.ok(world=2), step=4, same_weights_across_ranks=False)
    assert event["kind"] == "forward"
    assert event["rank"] == 1
    assert event["layer"] == FAULT_LAYER


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault, kind, rank, layer, said", [
    # every rank sees the NaN after the reduce-scatter; each one's input to it tells them apart
    ("backward", "grad", 1, "blocks.1.fc.weight", "without parameters: blocks.1.fault (Fault)"),
    # one NaN, which the reduce-scatter puts in rank 0's shard: rank 1's own gradients still tell
    ("backward-one", "grad", 1, "blocks.1.fc.weight", "this rank's own gradients of blocks.1 (fully_shard-ed"),
    # the all-gather gives every rank the NaN weight: the rank whose shard holds it names it
    ("weight", "forward", 1, "blocks.1.fc", "parameter(s) weight are non-finite"),
    # a team's own reduce-scatter is left alone: which rank made it cannot be told, and is not
    ("backward --own-reduce-scatter", "grad", 0, "blocks.1.fc.weight", "made them is not known"),
    # one unit of two Linears: rank 1's shard of blocks.1.fc is finite (the NaN row is rank 0's), its
    # shard of blocks.0.fc is not; the unit's first Linear in backward order is named, and hedged
    ("backward-one --blocks-one-unit", "grad", 1, "blocks.1.fc.weight", "do not tell which of its parameters"),
])
def test_fsdp2_nan_of_one_rank_is_named_on_that_rank(torchrun, fault, kind, rank, layer, said):
    job = torchrun.standalone("fsdp_train.py", "--fault", *fault.split(), "--fault-rank", "1",
                              "--fault-step", "3", "--steps", "5")
    event = assert_common_stop(job.ok(world=2), step=3, same_weights_across_ranks=False)
    assert (event["kind"], event["rank"], event["layer"]) == (kind, rank, layer), event
    assert said in event["message"], event["message"]


@pytest.mark.timeout(180)
def test_example_ddp_nan(torchrun):
    """examples/ddp_nan.py under torchrun with 2 processes, no coordinator."""
    job = torchrun.example("examples/ddp_nan.py", nproc=2)
    assert job.returncodes == [0], job.output[-6000:]
    for rank in (0, 1):
        assert re.search(rf"^\[rank {rank}\] stopped at step 25: ", job.output, re.M), job.output
        assert (f"[rank {rank}] first event came from rank 1; weights finite and untouched by the bad"
                " step: True") in job.output
    report = "non-finite output in blocks.1.linear1 (Linear) at step 25, rank 1"
    report_lines = [line for line in job.output.splitlines() if line.startswith(f"nanguard: {report}")]
    assert len(report_lines) == 1, job.output


def _processes_with(marker: str) -> list[int]:
    """Pids of this user's processes whose environment holds ``marker``."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.timeout(200)
def test_nanguard_demo_the_main_job(tmp_path):
    """`make demo` = `nanguard demo`: coordinator, 2-rank job, metrics, incident, replay verdict;
    under two minutes on 2 cores, and nothing left running."""
    import os
    import subprocess

    folder = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-m", "nanguard", "demo", "--dir", str(folder)], env=env,
                         capture_output=True, text=True, timeout=150, cwd=tmp_path)
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-4000:]
    assert re.search(r"^  \[rank 0\] stopped at step 25: ", out, re.M), out
    assert re.search(r"^  \[rank 1\] stopped at step 25: ", out, re.M), out
    assert "non-finite output in blocks.1.linear1 (Linear) at step 25, rank 1" in out
    assert 'nanguard_nonfinite_events_total{kind="forward",rank="1"} 1.0' in out
    assert 'nanguard_stops_total{reason="nonfinite"} 1.0' in out
    assert re.search(r"replay of \S+ \(step 25\): reproducible", out), out
    # a story a newcomer can follow: commands to paste, the replay's report once, plain words
    assert "$ NANGUARD_COORDINATOR=tcp://127.0.0.1:" in out and f" {sys.executable} -m torch.distributed.run " in out
    assert "$ -m" not in out and out.count("the same forward event in blocks.1.linear1 at step 25") == 1, out
    assert "largest gradient norms, step 24: " in out and "top params" not in out, out
    assert not re.search(r"mixing|propagator|\(cap \d+\)", out), out
    (incident,) = (folder / "incidents").iterdir()
    from nanguard import incident as capture

    report = capture.read_incident(str(incident)).replay_report()
    assert report["verdict"] == "reproducible"
    # the operation check agrees with the trace: the demo's own model is user code, not nanguard's
    (first,) = report["operations"]["1"]["forward"][:1]
    assert (first["op"], first["module"]) == ("aten::addmm", "blocks.1.linear1"), first
    assert _processes_with(str(folder)) == [], "the demo left processes behind"


def replay_job(torchrun, incident: str, *args: str, script: str = "ddp_train.py"):
    """Run the unchanged worker again with NANGUARD_REPLAY: every rank must end with exit code 0
    at the replayed step, and the incident then holds the report."""
    from nanguard import incident as capture

    job = torchrun.standalone(script, *args, env={"NANGUARD_REPLAY": incident})
    assert job.returncodes == [0], job.output[-6000:]
    for rank, result in job.results().items():
        assert result["steps_done"] == 0, f"rank {rank} went past the replayed step"
        assert "ReplayFinished" in result["exception"]  # a SystemExit (code 0) by its own name
    report = capture.read_incident(incident).replay_report()
    assert report is not None, job.output[-6000:]
    assert sorted(report["trace"]) == ["0", "1"]  # both ranks' traces reached the report
    return job, report


@pytest.mark.timeout(300)
def test_two_rank_replay_of_a_bad_batch_is_reproducible(torchrun):
    job, event = ddp_fault_on_rank_1(torchrun, "input")
    incident = job.results()[0]["error"]["incident"]
    # the replayed run asks for no fault: the captured batch alone brings the NaN back
    _, report = replay_job(torchrun, incident, "--steps", "8")
    assert report["verdict"] == "reproducible", report["message"]
    assert report["first_event"]["rank"] == 1 and report["first_event"]["step"] == 5
    assert report["first_event"]["layer"] == event["layer"]
    # each rank searched its own batch: rank 1's sample 0 holds the NaN, rank 0's batch is clean
    assert sorted(report["samples"]) == ["0", "1"]
    assert report["samples"]["0"]["micro_batches"][0]["outcome"] == "clean"
    assert report["bad_samples"] == [{"rank": 1, "micro_batch": 0, "index": 0, "id": None}]
    assert report["layout"] == {"incident_world_size": 2, "replayed_ranks": [0, 1], "alone": False}


@pytest.mark.timeout(300)
def test_one_process_replays_one_rank_of_a_two_rank_incident(torchrun):
    """An incident of 2 DDP ranks replayed by one process (a 1-GPU workstation): rank 1's part,
    the first event's, alone."""
    from nanguard import incident as capture

    job, event = ddp_fault_on_rank_1(torchrun, "input")
    incident = job.results()[0]["error"]["incident"]
    alone = torchrun.standalone("ddp_train.py", "--steps", "8", nproc=1, env={"NANGUARD_REPLAY": incident})
    assert alone.returncodes == [0], alone.output[-6000:]
    report = capture.read_incident(incident).replay_report()
    assert report["layout"] == {"incident_world_size": 2, "replayed_ranks": [1], "alone": True}
    assert report["verdict"] == "reproducible", report["message"]
    assert report["first_event"]["rank"] == 1 and report["first_event"]["layer"] == event["layer"]
    assert any("rank 1's part was replayed alone" in note for note in report["notes"])
    assert report["bad_samples"] == [{"rank": 1, "micro_batch": 0, "index": 0, "id": None}]
    assert "nanguard replay of" in alone.output and "reproducible" in alone.output


@pytest.mark.timeout(300)
def test_two_rank_replay_of_a_one_off_fault_is_not_reproducible(torchrun):
    job, event = ddp_fault_on_rank_1(torchrun, "forward")
    incident = job.results()[0]["error"]["incident"]
    # the fault fired at loop step 5 only; the replay's first step is a clean loop step
    _, report = replay_job(torchrun, incident, "--steps", "8", "--fault", "forward",
                           "--fault-rank", "1", "--fault-step", "5")
    assert report["verdict"] == "not_reproducible"
    assert report["first_event"] is None
    assert report["suspects"] == [{"rank": 1, "host": event["host"], "device": "cpu"}]
    # replayed where it ran (rank 1's CPU on this host), and clean there: no device comparison to make
    assert report["devices"]["same_device"] is True and report["devices"]["finding"] == "undecided"
    assert all(not ops["forward"] and not ops["backward"] for ops in report["operations"].values())


@pytest.mark.timeout(300)
def test_fsdp2_replay_loads_each_ranks_shards(torchrun):
    job = torchrun.standalone("fsdp_train.py", "--fault", "input", "--fault-rank", "1",
                              "--fault-step", "3", "--steps", "5")
    event = assert_common_stop(job.ok(world=2), step=3, same_weights_across_ranks=False)
    incident = job.results()[0]["error"]["incident"]
    _, report = replay_job(torchrun, incident, "--steps", "5", script="fsdp_train.py")
    assert report["verdict"] == "reproducible", report["message"]
    assert report["first_event"]["rank"] == 1 and report["first_event"]["layer"] == event["layer"]
