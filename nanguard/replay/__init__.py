"""NANGUARD_REPLAY: run a captured step again, slowly and exactly, and say whether it reproduces.

The unchanged training script runs with ``NANGUARD_REPLAY=DIR``; ``nanguard.init`` then
- loads this rank's captured model, optimizer, GradScaler and LR-scheduler state (all checked
  against the script's objects before anything is copied, so nothing is loaded half-way);
- feeds the captured micro-batches to the root module in place of the loader's, and puts
  every RNG back as it was when the step began (so a dropout mask is drawn again the same);
- guards the step in forensic mode: every checked tensor is kept for an exact report, every
  module's output and every gradient that flows back into a module's output or reaches a
  parameter is checked synchronously, in the order it happens (the *trace*);
- runs the step under a dispatch mode (``replay_ops``): the first ATen operations that made a
  non-finite value from finite inputs, forward and backward, with the user's line, the module,
  the autograd node and the forward line that made it, and the inputs' ranges;
- at the optimizer step (before any update) runs the model again on parts of the captured batch
  to find the samples that make the step bad (``samples.py``, bounded), compares the job's first
  event with the original one and the device with the original device, writes ``replay.json``
  (and ``skip.json`` for the user's sampler) into the incident, prints the report and raises
  ``ReplayFinished`` (a ``SystemExit`` with code 0), which ends the unchanged script there.

One process may replay one rank's part of a larger incident alone when the model is not sharded
(``layout.py``), and ``NANGUARD_REPLAY_DEVICE`` runs the model on another device (``devices.py``).

The guard calls a ``StepObserver`` (``nanguard.rank.observer``) at its few decision points whether
or not a replay runs; ``Replay`` is the one that does something, and ``nanguard.init``
(``nanguard/api.py``) chooses it. The replay builds on the rank side, never the other way round.

    observer.py  Replay, the StepObserver that replays: load, feed, end
    layout.py    which rank's part this process replays
    trace.py     the synchronous trace: every module output and gradient, checked as it happens
    ops.py       the dispatch mode: the first operations to make a non-finite value
    operands.py  an operation's inputs: their ranges, and what explains the result
    frames.py    the user's source lines of a stack (torch's, nanguard's, Python's left out)
    samples.py   the search for the bad samples of the batch (bisection, within a cap)
    quiet.py     runs of the model that leave nothing behind (hooks, buffers, RNG)
    devices.py   the replay's device, the original one, and what comparing them says
    skipfile.py  skip.json and ``nanguard.skip_list``
    report.py    the verdict and its report (replay.json)
    (the report as readable lines, the replay's output and ``nanguard inspect``'s, is
    ``nanguard.incident.replay_lines``: the incident holds the report)

The verdict is ``reproducible`` when the same kind of event happens again in the same layer
at the same step: a deterministic bug in the model, the data or the code. Otherwise it is
``not_reproducible``, which points at the hardware that ran the original step (host and
device are named) or at non-determinism, as Megatron-LM's rerun machine reasons.
"""

from ..rank.observer import StepObserver
from .observer import Replay, watch_exit
from ..incident.replay_lines import detail_lines, render, trace_lines
from .skipfile import skip_list

__all__ = ["Replay", "StepObserver", "detail_lines", "render", "skip_list", "trace_lines", "watch_exit"]
