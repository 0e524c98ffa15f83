"""Multi-rank programs end cleanly: gloo on torch 2.13 can abort a rank (SIGABRT, "terminate
called without an active exception") while Python finalizes, unless the process group is ended
first (nanguard/_dist.py says why). The examples end with ``nanguard.destroy_process_group()``.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

ROUNDS = 20
ABORT = re.compile(r"terminate called|SIGABRT|exitcode\s*:\s*-6|Fatal Python error")


@pytest.mark.timeout(ROUNDS * 90)
def test_ddp_example_runs_forty_times_two_at_a_time_without_an_abort(torchrun):
    # each round: a clean job and one that stops on a bad step, at the same time (a loaded machine
    # makes gloo's late worker threads, and so the abort, more likely)
    for round_ in range(ROUNDS):
        clean = torchrun.spawn_example("examples/ddp.py", "--steps", "5")
        stopped = torchrun.spawn_example("examples/ddp.py", "--steps", "5", "--bad-step", "2")
        for name, running, expected in (("clean", clean, "no non-finite value"),
                                        ("stopping", stopped, "stopped before step 2's update")):
            job = running.wait()
            where = f"round {round_ + 1} of {ROUNDS}, the {name} job"
            assert not ABORT.search(job.output), f"{where} aborted:\n{job.output[-4000:]}"
            assert job.returncodes == [0], f"{where} failed:\n{job.output[-4000:]}"
            assert job.output.count(expected) == 2, f"{where}:\n{job.output[-4000:]}"
