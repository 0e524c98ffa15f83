"""A stop that ends a torchrun job reads as a stop, not a crash: torchrun's own summary names
nanguard's finding (a NaN's from the rank where it was born, or an operator's stop and its reason),
and no rank prints a traceback."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow


def _root_cause(output: str) -> str:
    assert "Root Cause (first observed failure):" in output, output[-4000:]
    return output.split("Root Cause (first observed failure):", 1)[1]


REASON = "trying the operator stop"
TOKENS = {"NANGUARD_TOKEN": "ranks-secret", "NANGUARD_OPERATOR_TOKEN": "operators-secret"}


def nan_born_on_rank_1(torchrun, coordinator):
    return torchrun.standalone("uncaught.py", "--fault-rank", "1")


def stopped_by_an_operator(torchrun, coordinator):
    """A job with no NaN, reporting to a real coordinator, stopped by ``nanguard stop`` with the
    operator's token (which the ranks do not hold)."""
    coordinator.start(env=TOKENS)
    job = torchrun.spawn("uncaught.py", "--fault-rank", "-1", "--steps", "3000", "--step-sleep", "0.05",
                         env={"NANGUARD_COORDINATOR": coordinator.address, "NANGUARD_TOKEN": TOKENS["NANGUARD_TOKEN"]})
    coordinator.wait_for("nanguard_ranks_alive", at_least=2, timeout=120)
    stop = coordinator.cli("stop", "--coordinator", coordinator.address, "--reason", REASON,
                           env={"NANGUARD_OPERATOR_TOKEN": TOKENS["NANGUARD_OPERATOR_TOKEN"]})
    assert stop.returncode == 0, stop.stdout + stop.stderr
    return job.wait(120)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run, rank, finding, said", [
    (nan_born_on_rank_1, 1,
     r"non-finite input to 0 \(Linear\) at step 2, rank 1, micro-batch 0; every rank stopped before the update; "
     r"state saved in \S+step2",
     "nanguard: NonFiniteError ended the job at step 2, before the update"),
    # a stop names no rank: whichever rank torchrun names, its line is the stop's
    (stopped_by_an_operator, None,
     rf"stop requested \({REASON}\) at step \d+; every rank stopped before the update$",
     f"nanguard: StopRequested ended the job: stop requested ({REASON}) at step"),
], ids=["nan", "operator-stop"])
def test_torchrun_names_the_finding_not_a_traceback(torchrun, coordinator, run, rank, finding, said):
    """torchrun's Root Cause is nanguard's one line (for a NaN, from the rank where it was born); one
    console line per job says what ended it; no rank prints a traceback."""
    job = run(torchrun, coordinator)
    tail = job.output[-4000:]
    assert job.returncodes != [0], tail
    cause = _root_cause(job.output)
    if rank is not None:
        assert re.search(rf"rank\s+: {rank} \(local_rank: {rank}\)", cause), tail
    assert re.search(rf"^  traceback : nanguard: {finding}", cause, flags=re.MULTILINE), tail
    assert "error_file: <N/A>" not in job.output, tail
    # no rank's traceback (through the script or nanguard); what to do next is said once
    assert 'uncaught.py", line' not in job.output and "nanguard/rank/" not in job.output, tail
    assert job.output.count(said) == 1, tail


@pytest.mark.timeout(300)
def test_another_exception_keeps_its_traceback(torchrun):
    job = torchrun.standalone("uncaught.py", "--fault-rank", "1", "--other")
    assert job.returncodes != [0], job.output[-4000:]
    assert "ValueError: the script's own error on rank 1" in job.output, job.output[-4000:]
    assert "Traceback (most recent call last)" in job.output, job.output[-4000:]
    assert "NonFiniteError ended the job" not in job.output, job.output[-4000:]
