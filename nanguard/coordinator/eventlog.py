"""The coordinator's event log: every accepted message, as received, one JSON line each.

    {"received": <wall-clock time>, "msg": <the envelope, byte for byte as it came>}

Lines are appended by the loop thread and flushed to the file once per batch of messages. A
thread of its own fsyncs them, so that the loop never waits on the disk (20 MB a second of
events take ~40 ms to sync here): each ``sync_every_s`` while lines are written, and at once
after a stop decision, the moment when losing the log would hurt most.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("nanguard.coordinator")

Fsync = Callable[[int], None]


class EventLog:
    """The open log file at ``path``; used by one thread (the coordinator's loop).

    ``fsync``: how a file descriptor is synced (``os.fsync``; tests pass a recorder).
    """

    def __init__(self, path: str, *, sync_every_s: float = 1.0, fsync: Fsync = os.fsync):
        try:
            self._file = open(path, "ab", buffering=1 << 20)
        except OSError as exc:
            raise OSError(f"coordinator cannot open its log {path}: {exc.strerror}; "
                          "nothing was started") from exc
        self.path = path
        self._fsync = fsync
        self._written = False
        """lines written since the last flush"""
        self._sync_now = False
        self._syncer = _LogSyncer(self._file.fileno(), path, fsync, sync_every_s)

    def append(self, received: float, payload: bytes) -> None:
        """One message, ``received`` at that wall-clock time; on disk after ``end_batch``."""
        self._file.write(b'{"received":%.6f,"msg":%s}\n' % (received, payload))
        self._written = True

    def sync_soon(self) -> None:
        """A stop was decided: have the log on disk right after this batch."""
        self._sync_now = True

    def end_batch(self) -> None:
        """Flush what this batch wrote and let the sync thread know."""
        if not self._written:
            return
        self._file.flush()
        self._written = False
        self._syncer.written(now=self._sync_now)
        self._sync_now = False

    def close(self) -> None:
        """Stop the sync thread, then flush, fsync and close the file. Idempotent."""
        if self._file.closed:
            return
        self._syncer.close()
        self._file.flush()
        self._fsync(self._file.fileno())
        self._file.close()


class _LogSyncer:
    """fsyncs one file descriptor from its own thread: each ``every_s`` while lines are written,
    and at once when asked."""

    def __init__(self, fileno: int, path: str, fsync: Fsync, every_s: float):
        self._fileno = fileno
        self._path = path
        self._fsync = fsync
        self._every_s = every_s
        self._dirty = False
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanguard-coordinator-fsync", daemon=True)
        self._thread.start()

    def written(self, now: bool = False) -> None:
        """Lines were flushed to the file; ``now``: sync them without waiting for the period."""
        self._dirty = True
        if now:
            self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("log fsync thread did not stop within %.1f s (a slow disk?)", timeout_s)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self._every_s)
            self._wake.clear()
            if self._dirty:
                self._dirty = False  # before the sync: lines written during it count again
                try:
                    self._fsync(self._fileno)
                except OSError as exc:
                    log.error("cannot fsync the log %s: %s; the coordinator goes on, and lines since "
                              "the last sync may be lost if the machine crashes", self._path, exc)
