"""nanguard needs no numpy on the rank side (a plain ``pip install nanguard`` brings none): a DDP job
whose ranks cannot import numpy still stops every rank at the bad step and writes its incident.

torch's own ``all_gather_object`` reads its bytes back through numpy, so nanguard exchanges what
the ranks agree on (the finding, the incident folder, the peer's re-run) without it (``_dist.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# Run first in every process of the job (a sitecustomize on PYTHONPATH): numpy is missing, as in a
# fresh venv without it. None in sys.modules is Python's own "no such module": ``import numpy`` meets
# ModuleNotFoundError, ``importlib.util.find_spec("numpy")`` None (torch asks both ways).
SHIM = '''\
import sys

sys.modules["numpy"] = None
'''
# torch imports, numpy does not
PROBE = """\
import torch
try:
    import numpy
except ImportError:
    print("hidden")
else:
    print("imports")
"""


@pytest.fixture
def no_numpy(tmp_path) -> dict[str, str]:
    """The environment variables that hide numpy from a process and its children."""
    shim = tmp_path / "no_numpy"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM)
    repo = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), str(repo), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=120, check=False)
    assert probe.returncode == 0 and probe.stdout.strip() == "hidden", probe.stdout + probe.stderr
    return env


@pytest.mark.timeout(300)
def test_a_ddp_job_without_numpy_stops_every_rank_and_writes_its_incident(torchrun, no_numpy):
    job = torchrun.standalone("uncaught.py", "--fault-rank", "1", "--no-numpy", env=no_numpy)
    tail = job.output[-6000:]
    assert job.output.count("numpy cannot be imported here, torch") == 2, tail
    assert "Numpy is not available" not in job.output, tail
    # the peer's re-run got rank 1's micro-batch, tensors and RNG, and sent its verdict back
    assert "bad again when re-run on rank 0's device" in job.output, tail
    # torchrun's summary names the finding, which every rank agreed on, and the folder it was saved in
    found = re.search(r"traceback : nanguard: non-finite input to 0 \(Linear\) at step 2, rank 1, micro-batch 0; "
                      r"every rank stopped before the update; state saved in (\S+step2)", job.output)
    assert found, tail
    from nanguard import incident as capture

    incident = capture.read_incident(found.group(1))
    assert (incident.step, incident.world_size) == (2, 2)
    assert incident.first_event.rank == 1 and incident.first_event.kind == "forward"
    for rank in (0, 1):
        assert incident.rank_batches(rank) and incident.rank_state(rank)["model"]
