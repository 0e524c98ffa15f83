"""Every script in examples/ runs on the CPU for a few steps: clean, and with a bad step."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

# script, processes (0: plain python), what a clean run prints, the stop line's pattern
EXAMPLES = [
    ("examples/ddp.py", 2, "no non-finite value", r"stopped before step 2's update; incident \S+step2"),
    ("examples/fsdp.py", 2, "no non-finite value",
     r"stopped before step 2's update: non-finite input to 0\.0 \(Linear\) at step 2, rank 0"),
    ("examples/grad_accum.py", 2, "no non-finite value",
     r"stopped: non-finite input to 0 \(Linear\) at step 2, rank 0, micro-batch 2"),
    ("examples/amp.py", 0, "no non-finite value", r"stopped before step 2's update: non-finite input to 0"),
    ("examples/lightning_train.py", 0, "no non-finite value",
     r"stopped before step 2's update: non-finite input to net\.0 \(Linear\) at step 2"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,nproc,clean,stopped", EXAMPLES, ids=[e[0].split("/")[1] for e in EXAMPLES])
def test_example_runs_clean_and_stops_on_a_bad_step(torchrun, script, nproc, clean, stopped):
    if "lightning" in script:
        pytest.importorskip("lightning")
    job = torchrun.example(script, "--steps", "3", nproc=nproc)
    assert job.returncodes == [0], job.output[-4000:]
    assert job.output.count(clean) == max(nproc, 1), job.output[-4000:]
    job = torchrun.example(script, "--steps", "5", "--bad-step", "2", nproc=nproc)
    assert job.returncodes == [0], job.output[-4000:]
    assert len(re.findall(stopped, job.output)) == max(nproc, 1), job.output[-4000:]


@pytest.mark.timeout(300)
def test_lightning_ddp_on_two_cpu_processes(torchrun):
    pytest.importorskip("lightning")
    job = torchrun.example("examples/lightning_train.py", "--steps", "5", "--bad-step", "2",
                           "--devices", "2", nproc=0)
    assert job.returncodes == [0], job.output[-4000:]
    # both ranks stop at the same step, before its update
    assert len(re.findall(r"stopped before step 2's update: non-finite input to net\.0", job.output)) == 2, \
        job.output[-4000:]
