"""Whether this process ends cleanly: what a rank's goodbye tells the coordinator (finished or failed).

Only a clean end reads as finished. What says otherwise is seen in one of three places:

- an exception on its way out while ``guard.close()`` runs (a ``finally:`` or an ``except`` block
  around the loop, a failed collective after a peer died): ``sys.exc_info()`` there holds it;
- an exception nobody caught: the interpreter keeps it in ``sys.last_value`` (``last_exc`` from
  3.12) before it runs the atexit handlers, where an unclosed guard says goodbye;
- an exit code: ``sys.exit(3)`` (from a signal handler, say) raises ``SystemExit``, which is never
  an uncaught exception, and by the time atexit runs CPython holds its code in a C variable that
  Python cannot read. So while a coordinator link is open (``hold``), ``sys.exit`` is wrapped to note
  the code the main thread asks for (a thread's ``sys.exit`` ends that thread only, not the process).
  A wrapper is the one place every ``sys.exit(code)`` passes through; ``raise SystemExit(3)`` and the
  ``exit()`` builtin do not, and are seen only by a ``close()`` on their way out. An ``os._exit``
  says no goodbye at all: the coordinator finds the rank dead by its silence, never finished.

nanguard's own stops (``NonFiniteError``, ``StopRequested``) on their way through a ``finally:`` end
as they always did: finished (the rank stopped as asked, and its ``stopped`` message says why);
uncaught, or leaving a ``with guard:`` block, they read failed, as before.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..errors import NonFiniteError, StopRequested

_holders: set[object] = set()
"""one token per open coordinator link: the wrapper goes when the last one is released"""
_original: Callable[..., Any] | None = None
_asked: Any = None
"""the argument of the main thread's last ``sys.exit`` (None: never called, or called with nothing)"""


def hold() -> Callable[[], None]:
    """A coordinator link opens: wrap ``sys.exit`` (once, whatever the number of links). Returns
    what its close calls (once or more: only the first call counts)."""
    global _original
    if sys.exit is not _exit:
        _original, sys.exit = sys.exit, _exit
    token = object()
    _holders.add(token)
    return functools.partial(_release, token)


def _release(token: object) -> None:
    _holders.discard(token)
    if sys.exit is _exit and not _holders:
        sys.exit = _original


def _exit(status: Any = None) -> None:
    global _asked
    if threading.current_thread() is threading.main_thread():
        _asked = status
    (_original or _raise)(status)


def _raise(status: Any = None) -> None:
    raise SystemExit(status)


def exit_code(status: Any) -> int:
    """The process's exit code for ``sys.exit(status)``: None is 0, an integer itself, anything else
    (a message) 1."""
    if status is None:
        return 0
    return int(status) if isinstance(status, int) else 1


def clean(error: BaseException | None, *, stops: bool) -> bool:
    """Whether ending by ``error`` (None: none) is a clean end: no error, ``SystemExit`` with code 0,
    a generator closed; with ``stops``, nanguard's own stop exceptions too."""
    if error is None or isinstance(error, GeneratorExit):
        return True
    if isinstance(error, SystemExit):
        return exit_code(error.code) == 0
    return stops and isinstance(error, (NonFiniteError, StopRequested))


def closing_cleanly() -> bool:
    """For a ``close()`` that was not told: False while an error is on its way out."""
    return clean(sys.exc_info()[1], stops=True)


def exiting_cleanly() -> bool:
    """At exit (atexit): no uncaught exception, and no non-zero code asked of ``sys.exit``."""
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return uncaught is None and exit_code(_asked) == 0
