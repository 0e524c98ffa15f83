"""NANGUARD_REPLAY: run a captured step again, slowly and exactly, and say whether it reproduces.

The unchanged training script runs with ``NANGUARD_REPLAY=DIR``; ``nanguard.init`` then
- loads this rank's captured model, optimizer, GradScaler and LR-scheduler state (all checked
  against the script's objects before anything is copied, so nothing is loaded half-way);
- feeds the captured micro-batches to the root module in place of the loader's, and puts
  every RNG back as it was when the step began (so a dropout mask is drawn again the same);
- guards the step in forensic mode: every checked tensor is kept for an exact report, every
  module's output and every gradient that flows back into a module's output or reaches a
  parameter is checked synchronously, in the order it happens (the *trace*);
- at the optimizer step (before any update) compares the job's first event with the
  original one, writes ``replay.json`` into the incident, prints the report and raises
  ``ReplayFinished`` (a ``SystemExit`` with code 0), which ends the unchanged script there.

The guard calls a ``StepObserver`` at its few decision points whether or not a replay runs;
``Replay`` is the one that does something.

    observer.py  StepObserver (what a guard tells of its steps) and Replay: load, feed, end
    trace.py     the synchronous trace: every module output and gradient, checked as it happens
    report.py    the verdict and its report (replay.json), rendered as a few lines

The verdict is ``reproducible`` when the same kind of event happens again in the same layer
at the same step: a deterministic bug in the model, the data or the code. Otherwise it is
``not_reproducible``, which points at the hardware that ran the original step (host and
device are named) or at non-determinism, as Megatron-LM's rerun machine reasons.
"""

from .observer import Replay, StepObserver
from .report import render, trace_lines

__all__ = ["Replay", "StepObserver", "render", "trace_lines"]
