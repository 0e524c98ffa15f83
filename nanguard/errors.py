"""Exceptions raised by nanguard.

    NanguardError
     ├── ConfigError        (also a ValueError)  a setting or an argument is invalid
     ├── GuardClosedError                          a closed guard was used
     ├── NonFiniteError     (also a RuntimeError) a NaN/Inf stopped the step on every rank
     ├── StopRequested      (also a RuntimeError) the coordinator or an operator stopped the job
     ├── ProtocolError      (also a ValueError)   a malformed or unauthenticated wire message
     ├── IncidentError      (also a ValueError)   an incident folder cannot be written or read
     ├── CoordinatorUnreachable                   an operator request got no valid reply
     └── RequestRefused                           the coordinator refused an operator request
    SystemExit
     └── ReplayFinished                           a replay ran its step and wrote its report

``ReplayFinished`` is a ``SystemExit`` (exit code 0) on purpose: the unchanged training script
that a replay runs ends quietly at the replayed step, unless it catches this exception.

Catch ``RuntimeError`` to treat a nanguard stop like any other training failure, or
``nanguard.NonFiniteError`` to handle it on purpose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .events import Event


class NanguardError(Exception):
    """Base of every exception nanguard raises."""


class ConfigError(NanguardError, ValueError):
    """A setting (keyword argument or NANGUARD_* variable) has an invalid value."""


class GuardClosedError(NanguardError):
    """A guard was used after ``close()``."""


class NonFiniteError(NanguardError, RuntimeError):
    """A non-finite value stopped training before the optimizer applied the bad update.

    Raised on every rank at the same step. ``event`` is the job's first event (the same on
    every rank), ``incident`` the directory the state was saved in, or None.
    """

    def __init__(self, message: str, event: Event, incident: str | None = None):
        super().__init__(message)
        self.event = event
        self.incident = incident


class StopRequested(NanguardError, RuntimeError):
    """The coordinator or an operator asked the job to stop; raised on every rank at one step."""

    def __init__(self, message: str, step: int, reason: str = "operator"):
        super().__init__(message)
        self.step = step
        self.reason = reason


class ProtocolError(NanguardError, ValueError):
    """A wire message was malformed, too large, of an unknown version, unauthenticated, or refused.

    ``reason`` is a short machine-readable word (a metric label): one of
    ``nanguard.protocol.WIRE_REASONS`` when the codec refused the message, one of
    ``nanguard.protocol.BAD_MESSAGE_REASONS`` when the coordinator did (another job, a rank that
    did not say hello, a stop without the operator credential...).
    """

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


class IncidentError(NanguardError, ValueError):
    """An incident folder could not be written, or is missing, partial, tampered or incompatible.

    ``path`` is the file or folder at fault, ``reason`` says what is wrong and what to do.
    """

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class CoordinatorUnreachable(NanguardError):
    """No valid reply from the coordinator within the timeout."""


class RequestRefused(NanguardError):
    """The coordinator answered an operator request with a refusal (a stop without the operator
    credential); the message says why and what to set."""


class ReplayFinished(SystemExit):
    """``NANGUARD_REPLAY``: the replayed step ran to its optimizer step, before any update, and
    its report was written (``report``: the replay.json content, ``path``: where, or None)."""

    def __init__(self, report: dict | None = None, path: str | None = None):
        super().__init__(0)
        self.report = report
        self.path = path
