"""A stop that ends a torchrun job reads as a stop, not a crash: torchrun's own summary names
nanguard's finding, from the rank where the NaN was born, and no rank prints a traceback."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow


def _root_cause(output: str) -> str:
    assert "Root Cause (first observed failure):" in output, output[-4000:]
    return output.split("Root Cause (first observed failure):", 1)[1]


@pytest.mark.timeout(300)
def test_torchrun_names_the_finding_of_the_rank_where_the_nan_was_born(torchrun):
    job = torchrun.standalone("uncaught.py", "--fault-rank", "1")
    assert job.returncodes != [0], job.output[-4000:]
    cause = _root_cause(job.output)
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", cause), job.output[-4000:]
    assert re.search(r"traceback : nanguard: non-finite input to 0 \(Linear\) at step 2, rank 1, micro-batch 0; "
                     r"every rank stopped before the update; state saved in \S+step2", cause), job.output[-4000:]
    assert "error_file: <N/A>" not in job.output, job.output[-4000:]
    # no rank's traceback through nanguard; the next step is said once, by the rank where it was born
    assert "nanguard/rank/" not in job.output, job.output[-4000:]
    assert job.output.count("nanguard: NonFiniteError ended the job at step 2, before the update") == 1, job.output[-4000:]


@pytest.mark.timeout(300)
def test_another_exception_keeps_its_traceback(torchrun):
    job = torchrun.standalone("uncaught.py", "--fault-rank", "1", "--other")
    assert job.returncodes != [0], job.output[-4000:]
    assert "ValueError: the script's own error on rank 1" in job.output, job.output[-4000:]
    assert "Traceback (most recent call last)" in job.output, job.output[-4000:]
    assert "NonFiniteError ended the job" not in job.output, job.output[-4000:]
