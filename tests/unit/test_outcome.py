"""What a rank's goodbye says about how its process ends (nanguard/rank/outcome.py); the real
endings, against a real coordinator, are in tests/integration/test_coordinated.py."""

from __future__ import annotations

import sys
import threading

import pytest

import nanguard
from nanguard.events import Event
from nanguard.rank import outcome


def _stop() -> nanguard.NonFiniteError:
    event = Event(kind="grad", rank=0, step=3, layer="w")
    return nanguard.NonFiniteError(str(event), event, None)


@pytest.mark.parametrize("error, stops, clean", [
    (None, False, True), (SystemExit(0), False, True), (SystemExit(None), False, True),
    (SystemExit(3), True, False), (SystemExit("bye"), True, False), (GeneratorExit(), False, True),
    (RuntimeError("collective failed"), True, False), (KeyboardInterrupt(), True, False),
    (_stop(), True, True), (_stop(), False, False)])
def test_what_is_a_clean_end(error, stops, clean):
    assert outcome.clean(error, stops=stops) is clean


def test_a_close_in_a_finally_sees_the_error_on_its_way_out():
    seen = []
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("Connection closed by peer")
        finally:
            seen.append(outcome.closing_cleanly())
    seen.append(outcome.closing_cleanly())
    assert seen == [False, True]


def test_sys_exit_is_noted_from_the_main_thread_only_and_unwrapped_with_the_last_link(monkeypatch):
    monkeypatch.setattr(outcome, "_asked", None)
    original = sys.exit
    releases = [outcome.hold(), outcome.hold()]
    try:
        assert sys.exit is not original
        def thread_exits() -> None:
            with pytest.raises(SystemExit):
                sys.exit(5)  # ends this thread only

        thread = threading.Thread(target=thread_exits)
        thread.start()
        thread.join(10)
        assert outcome.exiting_cleanly()
        with pytest.raises(SystemExit) as raised:
            sys.exit(3)
        assert raised.value.code == 3 and not outcome.exiting_cleanly()
    finally:
        for release in [*releases, releases[0]]:  # (a second release of one link counts once)
            release()
    assert sys.exit is original
