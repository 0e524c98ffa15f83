"""A rank whose coordinator never answers says so early, once, with the likely causes, and says
so again when it answers: against a real ``nanguard coordinator`` process and a dead port."""

from __future__ import annotations

import contextlib
import logging

import pytest

from nanguard.client import Client

from conftest import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

IDENTITY = {"rank": 0, "local_rank": 0, "world_size": 2, "host": "testhost", "pid": 4242, "job": "job1",
            "device": "cpu", "version": "test"}


def _said(caplog, fragment: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "nanguard.client" and fragment in r.getMessage()]


@pytest.fixture
def client():
    with contextlib.ExitStack() as stack:
        yield lambda address, token: stack.enter_context(
            Client(address, token=token, identity=IDENTITY, heartbeat_s=0.05))


def test_a_dead_port_is_said_early_and_the_coordinator_coming_up_too(coordinator, client, caplog):
    caplog.set_level(logging.WARNING, logger="nanguard.client")
    client(coordinator.address, None)  # nothing listens there yet
    down = until(lambda: _said(caplog, f"no coordinator has answered at {coordinator.address}"),
                 "the warning that nothing answers")
    assert "is nanguard coordinator running there" in down[0] and "NANGUARD_CURVE_PUBLIC_KEY" in down[0]
    assert "Training goes on, guarded locally" in down[0]
    coordinator.start()
    up = until(lambda: _said(caplog, f"the coordinator at {coordinator.address} answers again"),
               "the notice that the link is up")
    assert len(up) == 1
    assert len(_said(caplog, "no coordinator has answered")) == 1  # said once


def test_a_coordinator_with_another_token_is_said_to_be_one(coordinator, client, caplog):
    caplog.set_level(logging.WARNING, logger="nanguard.client")
    coordinator.start(env={"NANGUARD_TOKEN": "right"})
    client(coordinator.address, "wrong")
    said = until(lambda: _said(caplog, f"the coordinator at {coordinator.address} accepts the connection "
                                       "but has not welcomed this rank"), "the warning of a refused rank")
    assert "does NANGUARD_TOKEN differ from the coordinator's" in said[0]
    assert not _said(caplog, "answers again")
