"""The coordinator's JSON-lines event log, with a recording fsync in place of the disk's."""

import json
import os
import threading

import pytest

from nanguard.coordinator.eventlog import BATCH_BYTES, EventLog

HOUR_S = 3600.0
WAIT_S = 10.0
PAYLOAD = b'{"v":1,"type":"hello","sender":"rank0","seq":1,"time":1.5,"body":{"rank":0}}'


class Fsyncs:
    """The fsync function: counts calls and really syncs, after failing the first ``failures``."""

    def __init__(self, failures: int = 0):
        self.calls = 0
        self.called = threading.Event()
        self._failures = failures

    def __call__(self, fileno: int) -> None:
        self.calls += 1
        self.called.set()
        if self.calls <= self._failures:
            raise OSError(5, "Input/output error")
        os.fsync(fileno)


@pytest.fixture
def path(tmp_path):
    return tmp_path / "coordinator.jsonl"


@pytest.fixture
def opened(path):
    made = []

    def open_log(**kwargs) -> EventLog:
        made.append(EventLog(str(path), **kwargs))
        return made[-1]

    yield open_log
    for log in made:
        log.close()


def test_lines_are_appended_as_received_and_flushed_per_batch(opened, path):
    log = opened(fsync=Fsyncs())
    log.append(1_700_000_000.25, PAYLOAD)
    log.append(1_700_000_001.0, PAYLOAD.replace(b"hello", b"bye"))
    assert path.read_bytes() == b""  # buffered until the batch ends
    log.end_batch()
    lines = path.read_bytes().split(b"\n")
    assert lines[0] == b'{"received":1700000000.250000,"msg":' + PAYLOAD + b"}"
    assert lines[-1] == b""
    records = [json.loads(line) for line in lines[:-1]]
    assert [(r["received"], r["msg"]["type"]) for r in records] == [(1_700_000_000.25, "hello"),
                                                                   (1_700_000_001.0, "bye")]


def test_an_existing_log_is_appended_to(opened, path):
    path.write_bytes(b'{"earlier":1}\n')
    log = opened(fsync=Fsyncs())
    log.append(2.0, PAYLOAD)
    log.end_batch()
    assert path.read_bytes().startswith(b'{"earlier":1}\n{"received":2.000000,')


def test_synced_at_once_after_a_stop_decision(opened):
    fsyncs = Fsyncs()
    log = opened(sync_every_s=HOUR_S, fsync=fsyncs)
    log.append(1.0, PAYLOAD)
    log.end_batch()
    assert not fsyncs.called.wait(0.2)  # no stop: waits for the (hour-long) period
    log.sync_soon()
    log.append(2.0, PAYLOAD)
    log.end_batch()
    assert fsyncs.called.wait(WAIT_S)


def test_synced_each_period_while_lines_are_written(opened):
    fsyncs = Fsyncs()
    log = opened(sync_every_s=0.01, fsync=fsyncs)
    log.append(1.0, PAYLOAD)
    log.end_batch()
    assert fsyncs.called.wait(WAIT_S)


def test_a_batch_is_written_as_it_reaches_batch_bytes(opened, path):
    """A loop pass of large messages holds at most BATCH_BYTES of lines, not all of them."""
    log = opened(sync_every_s=HOUR_S, fsync=Fsyncs())
    big = PAYLOAD[:-1] + b',"pad":"' + b"x" * (BATCH_BYTES // 4) + b'"}'
    for i in range(3):
        log.append(float(i), big)
    assert path.read_bytes() == b""  # under BATCH_BYTES: held for the end of the batch
    log.append(3.0, big)
    assert [json.loads(line)["received"] for line in path.read_bytes().splitlines()] == [0, 1, 2, 3]
    log.append(4.0, PAYLOAD)
    log.end_batch()
    assert len(path.read_bytes().splitlines()) == 5


def test_close_flushes_and_syncs_and_ends_the_sync_thread(opened, path):
    fsyncs = Fsyncs()
    log = opened(sync_every_s=HOUR_S, fsync=fsyncs)
    log.append(3.0, PAYLOAD)  # no end_batch: still in the buffer
    log.close()
    assert path.read_bytes() == b'{"received":3.000000,"msg":' + PAYLOAD + b"}\n"
    assert fsyncs.calls == 1
    assert not any(t.name == "nanguard-coordinator-fsync" for t in threading.enumerate())
    log.close()  # idempotent
    assert fsyncs.calls == 1


def test_an_fsync_error_is_logged_and_the_log_goes_on(opened, path, caplog):
    fsyncs = Fsyncs(failures=1)
    log = opened(sync_every_s=HOUR_S, fsync=fsyncs)
    log.sync_soon()
    log.append(1.0, PAYLOAD)
    log.end_batch()
    assert fsyncs.called.wait(WAIT_S)
    log.append(2.0, PAYLOAD)
    log.end_batch()
    log.close()  # joins the sync thread: its log line is out
    assert len(path.read_bytes().splitlines()) == 2
    assert "cannot fsync the log" in caplog.text


def test_a_log_that_cannot_be_opened_says_so(tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "log.jsonl"
    with pytest.raises(OSError, match=f"cannot open its log {missing}: .*nothing was started"):
        EventLog(str(missing))


def test_past_max_bytes_the_log_rotates_and_keeps_the_last_files(opened, path):
    log = opened(fsync=Fsyncs(), max_bytes=1000, keep=2)
    for i in range(40):  # ~110 bytes a line: ~4 files' worth
        log.append(float(i), PAYLOAD)
        log.end_batch()
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["coordinator.jsonl", "coordinator.jsonl.1", "coordinator.jsonl.2"]
    for name in names:
        data = (path.parent / name).read_bytes()
        assert 0 < len(data) <= 1000
        assert all(json.loads(line)["msg"]["type"] == "hello" for line in data.splitlines())
    received = [json.loads(line)["received"] for name in reversed(names)
                for line in (path.parent / name).read_bytes().splitlines()]
    assert received == sorted(received) and received[-1] == 39.0  # oldest first, the newest last


def test_a_log_that_cannot_be_written_costs_its_lines_counted_and_said_once(tmp_path, caplog):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (a device every write to fails with ENOSPC)")
    errors = []
    log = EventLog("/dev/full", fsync=lambda fd: None, count_error=lambda: errors.append(1))
    try:
        for i in range(5):
            log.append(float(i), PAYLOAD)
            log.end_batch()  # never raises for the disk
    finally:
        log.close()
    assert len(errors) == 5
    assert caplog.text.count("cannot write the log /dev/full") == 1
    assert "No space left on device" in caplog.text


def test_rotation_settings_are_checked(path):
    with pytest.raises(ValueError, match="max_bytes=0 must be positive"):
        EventLog(str(path), max_bytes=0)
