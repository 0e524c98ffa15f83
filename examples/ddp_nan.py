"""Run with: torchrun --standalone --nproc-per-node 2 examples/ddp_nan.py

A DDP job (gloo on CPU) training a small transformer in which only the last rank's feed-forward
layer overflows at step 25. Every rank stops at that step, before the optimizer applies the bad
update, and the report names the layer, the rank and the step. `nanguard demo` runs this job
beside a coordinator and replays the incident.
"""

import sys

from nanguard.demo import run_worker

sys.exit(run_worker())
