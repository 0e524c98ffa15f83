"""Run with: torchrun --standalone --nproc-per-node 2 examples/ddp_nan.py

A DDP job (gloo on CPU) in which only the last rank's second block overflows at step 25.
Every rank stops at that step, before the optimizer applies the bad update, and the report
names the layer, the rank and the step.
"""

import sys

from nanguard.demo import run

sys.exit(run())
