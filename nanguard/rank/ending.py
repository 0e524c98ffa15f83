"""How a nanguard stop ends a rank: one short line on the console, and torchrun's error file.

A ``NonFiniteError`` or ``StopRequested`` that the script does not catch ends the process. Left to
Python, every rank would print a traceback through nanguard's internals, and torchrun, finding no
error file, would name rank 0 as the root cause with "error_file: <N/A>". ``hold()`` (called by
``init``; its guard's ``close()`` undoes it) chains a ``sys.excepthook`` that, for these two exceptions only:

- writes the TorchElastic error file (``TORCHELASTIC_ERROR_FILE``, set by torchrun for each worker)
  in the layout torch's own ``ErrorHandler`` uses, with nanguard's finding where torchrun shows the
  traceback, so that torchrun's summary names the step, the rank where the value was born, the
  layer and the incident folder;
- prints what to do next once per job: on the rank where the value was born (whose log already
  holds the full report), on rank 0 for a stop;
- logs the traceback at DEBUG on the ``nanguard`` logger.

Every other exception goes to the hook that was there before, untouched.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._dist import Collectives
from ..errors import NonFiniteError, StopRequested
from ..incident.fsio import atomic_write

log = logging.getLogger("nanguard")

ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"
REPORTER_FIRST_S = 1.0
"""how long a rank under torchrun that does not report waits before it exits (see ``_hook``)"""

class _Hold:
    """One open guard's hold on the hook: its ``close()`` keeps it alive, so a guard that is collected
    without being closed lets go of the hook with it."""


_holds: weakref.WeakSet[_Hold] = weakref.WeakSet()
"""the holds of the guards of ``init`` still open: the hook goes when the last one closes"""
_previous: Any = None


def hold() -> Callable[[], None]:
    """A guard starts: make sure the hook is installed (once, whatever the number of guards).
    Returns what its ``close()`` calls."""
    global _previous
    token = _Hold()
    _holds.add(token)
    if sys.excepthook is not _hook:
        _previous, sys.excepthook = sys.excepthook, _hook
    return lambda: _release(token)


def _release(token: _Hold) -> None:
    """A guard closes; the last one takes the hook away, unless an exception is on its way out (a
    ``with`` block or a ``finally`` closed the guard): that exception is the one the hook is for."""
    _holds.discard(token)
    if not _holds and sys.exc_info()[1] is None and sys.excepthook is _hook:
        sys.excepthook = _previous


def finding(error: NonFiniteError | StopRequested) -> str:
    """The one line torchrun's summary shows: what, at which step, born on which rank, in which
    layer, and where the state was saved."""
    if isinstance(error, NonFiniteError):
        line = f"{error.event.where()}; every rank stopped before the update"
        return line + (f"; state saved in {error.incident}" if error.incident else "; no incident was saved")
    return f"stop requested ({error.reason}) at step {error.step}; every rank stopped before the update"


def next_steps(error: NonFiniteError | StopRequested) -> str:
    """The console's line: what ended the job, and what to do next (the finding itself is on the
    log of the rank where it was born, the incident's folder on rank 0's)."""
    debug = "traceback: DEBUG on the 'nanguard' logger"
    name = type(error).__name__
    if isinstance(error, NonFiniteError) and error.incident:
        return (f"nanguard: {name} ended the job at step {error.event.step}, before the update, on every "
                f"rank; to replay that step, run the same command with NANGUARD_REPLAY={error.incident} ({debug})")
    return f"nanguard: {name} ended the job: {finding(error)} ({debug})"


def error_record(error: NonFiniteError | StopRequested, rank: int, now: float) -> dict[str, Any]:
    """The error file's content. torchrun names as root cause the failure with the smallest
    timestamp, in whole seconds, the lowest rank on a tie: a rank that only heard of a value born
    elsewhere says it failed a second after the event, so the rank where it was born is named."""
    timestamp = int(now)
    if isinstance(error, NonFiniteError) and error.event.time > 0:
        born = int(error.event.time)
        timestamp = born if error.event.rank == rank else max(timestamp, born + 1)
    line = finding(error)
    return {"message": {"message": f"{type(error).__name__}: {line}",
                        "extraInfo": {"py_callstack": f"nanguard: {line}", "timestamp": str(timestamp)}}}


def write_error_file(path: str, record: dict[str, Any]) -> bool:
    """Write ``record`` to ``path`` whole or not at all; False (said once, on the log) if it cannot."""
    text = json.dumps(record)
    try:
        atomic_write(path, lambda f: f.write(text.encode()))
    except OSError as exc:
        log.warning("nanguard: could not write torchrun's error file %s (%s); torchrun's summary will "
                    "not name the finding", path, exc)
        return False
    return True


def _hook(exc_type: type[BaseException], error: BaseException, traceback: Any) -> None:
    if not isinstance(error, (NonFiniteError, StopRequested)):
        (_previous or sys.__excepthook__)(exc_type, error, traceback)
        return
    rank = Collectives().rank
    log.debug("nanguard: the stop's traceback on rank %d", rank, exc_info=(exc_type, error, traceback))
    path = os.environ.get(ERROR_FILE_VARIABLE)
    if path:
        write_error_file(path, error_record(error, rank, time.time()))
    reporter = error.event.rank if isinstance(error, NonFiniteError) else 0
    if rank == reporter:
        print(next_steps(error), file=sys.stderr, flush=True)
    elif path:
        # torchrun ends every other worker as soon as one exits: the rank that says what happened
        # (and whose error file names the root cause) exits first, not killed before it could
        time.sleep(REPORTER_FIRST_S)
