"""The coordinator's event log: every accepted message, as received, one JSON line each.

    {"received": <wall-clock time>, "msg": <the envelope, byte for byte as it came>}

Lines are kept by the loop thread and written to the file once per batch of messages, in one
``write``. A thread of its own fsyncs them, so that the loop never waits on the disk (20 MB a second
of events take ~40 ms to sync here): each ``sync_every_s`` while lines are written, and at once
after a stop decision, the moment when losing the log would hurt most.

The log is a record, not the coordinator's reason to be: a disk that is full or failing costs the
lines of the batches it refuses, never the loop. Each failed write, sync or rotation is counted
(``nanguard_log_errors_total``) and the first one of a run of failures is said once; a batch that
was half written is cut back off (no broken line), and the next batch tries again, so logging goes
on by itself once there is space again. Past ``max_bytes`` the file is rotated: ``PATH`` becomes
``PATH.1``, ``PATH.1`` becomes ``PATH.2``, and so on up to ``keep`` old files.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("nanguard.coordinator")

Fsync = Callable[[int], None]
RECOVERED_AFTER_S = 5.0
"""a file written this long without a failure has recovered (said once)"""
BATCH_BYTES = 1 << 20
"""lines held before they are written, even mid-batch: a loop pass reads up to 256 messages of up to
64 KiB, and 16 MB of lines joined into 16 MB more stayed in the process as memory"""
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)


class LogTrouble:
    """Counts the failures of a file the coordinator keeps (``count``: the counter's ``inc``), says
    the first of a run of them, and once the file has been written for ``quiet_s`` without a
    failure, that it works again: a nearly full disk that takes small batches and refuses large
    ones is one run of failures, said once. Safe from two threads."""

    def __init__(self, path: str, count: Callable[[], None], quiet_s: float = RECOVERED_AFTER_S,
                 clock: Callable[[], float] = time.monotonic):
        self.path = path
        self._count = count
        self._quiet_s, self._clock = quiet_s, clock
        self._lock = threading.Lock()
        self._failing = 0
        """failures of the current run (0: none)"""
        self._last_failure = 0.0

    def failed(self, doing: str, exc: OSError) -> None:
        self._count()
        with self._lock:
            self._failing += 1
            self._last_failure = self._clock()
            first = self._failing == 1
        if first:
            log.error("cannot %s %s: %s; the coordinator goes on, counts each failure in "
                      "nanguard_log_errors_total and tries again with the next batch (said once, until it has "
                      "worked for %g s again)", doing, self.path, exc.strerror or exc, self._quiet_s)

    def worked(self) -> None:
        if not self._failing:
            return
        with self._lock:
            if not self._failing or self._clock() - self._last_failure < self._quiet_s:
                return
            failures, self._failing = self._failing, 0
        log.warning("%s is written again, after %d failed attempt(s); what those held is not in it",
                    self.path, failures)


class EventLog:
    """The log file at ``path``; used by one thread (the coordinator's loop).

    ``fsync``: how a file descriptor is synced (``os.fsync``; tests pass a recorder). ``max_bytes``:
    the size past which the file is rotated (None: never); ``keep``: rotated files kept. ``count_error``:
    called once per failed write, sync or rotation (the ``nanguard_log_errors_total`` counter).
    """

    def __init__(self, path: str, *, sync_every_s: float = 1.0, fsync: Fsync = os.fsync,
                 max_bytes: int | None = None, keep: int = 4, count_error: Callable[[], None] = lambda: None):
        if max_bytes is not None and max_bytes < 1 or keep < 0:
            raise ValueError(f"max_bytes={max_bytes!r} must be positive (or None) and keep={keep!r} not negative")
        self.path = path
        self.max_bytes, self.keep = max_bytes, keep
        self.trouble = LogTrouble(path, count_error)
        self._fsync = fsync
        self._lock = threading.Lock()
        """held while the descriptor is synced or replaced"""
        try:
            self._fd: int | None = os.open(path, _FLAGS, 0o644)
        except OSError as exc:
            raise OSError(f"coordinator cannot open its log {path}: {exc.strerror}; "
                          "nothing was started") from exc
        self._lines: list[bytes] = []
        self._held_bytes = 0
        self._sync_now = False
        self._closed = False
        self._syncer = _LogSyncer(self.sync, sync_every_s)

    def append(self, received: float, payload: bytes) -> None:
        """One message, ``received`` at that wall-clock time; on disk after ``end_batch``, or at once
        when the lines held reach ``BATCH_BYTES``."""
        line = b'{"received":%.6f,"msg":%s}\n' % (received, payload)
        self._lines.append(line)
        self._held_bytes += len(line)
        if self._held_bytes >= BATCH_BYTES:
            self.end_batch()

    def sync_soon(self) -> None:
        """A stop was decided: have the log on disk right after this batch."""
        self._sync_now = True

    def end_batch(self) -> None:
        """Write what this batch appended and let the sync thread know; never raises for the disk."""
        if not self._lines:
            return
        data = b"".join(self._lines)
        self._lines.clear()
        self._held_bytes = 0
        if self._write(data):
            self._syncer.written(now=self._sync_now)
            self._sync_now = False

    def sync(self) -> None:
        """fsync what was written (the sync thread's work); a failure is counted and said."""
        with self._lock:
            if self._fd is None:
                return
            try:
                self._fsync(self._fd)
            except OSError as exc:
                self.trouble.failed("fsync the log", exc)

    def close(self) -> None:
        """Write what is left, stop the sync thread, then fsync and close the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._syncer.close()
        self.end_batch()
        self.sync()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _write(self, data: bytes) -> bool:
        start = None
        try:
            if self._fd is None:
                self._fd = os.open(self.path, _FLAGS, 0o644)
            start = os.fstat(self._fd).st_size
            if self.max_bytes is not None and start and start + len(data) > self.max_bytes:
                self._rotate()
                start = 0
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            self.trouble.failed("write the log", exc)
            if start is not None and self._fd is not None:
                self._cut(start)
            return False
        self.trouble.worked()
        return True

    def _cut(self, size: int) -> None:
        """Take a half-written batch back off the end of the file (a broken line would follow)."""
        try:
            if os.fstat(self._fd).st_size > size:
                os.ftruncate(self._fd, size)
        except OSError:
            pass  # not a regular file (/dev/full), or the disk refuses even this: the next line starts anew

    def _rotate(self) -> None:
        """PATH -> PATH.1 -> ... -> PATH.keep (the oldest dropped), then a new PATH."""
        self.sync()
        with self._lock:
            fd, self._fd = self._fd, None
            os.close(fd)
        names = [self.path] + [f"{self.path}.{i}" for i in range(1, self.keep + 1)]
        if self.keep == 0:
            os.unlink(self.path)
        for older, newer in reversed(list(zip(names, names[1:]))):
            if os.path.exists(older):
                os.replace(older, newer)
        fd = os.open(self.path, _FLAGS, 0o644)
        with self._lock:
            self._fd = fd
        log.info("event log rotated: %s (the last %d kept as %s.1 ...)", self.path, self.keep, self.path)


class _LogSyncer:
    """Calls ``sync`` from its own thread: each ``every_s`` while lines are written, and at once when
    asked."""

    def __init__(self, sync: Callable[[], None], every_s: float):
        self._sync = sync
        self._every_s = every_s
        self._dirty = False
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanguard-coordinator-fsync", daemon=True)
        self._thread.start()

    def written(self, now: bool = False) -> None:
        """Lines were written to the file; ``now``: sync them without waiting for the period."""
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
                self._sync()
