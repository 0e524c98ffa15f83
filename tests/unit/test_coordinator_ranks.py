"""The coordinator's rank table, driven by hand-made clock readings (no sleeping, no socket)."""

import logging

import pytest
from prometheus_client import CollectorRegistry

from nanguard.coordinator.clock import Instant
from nanguard.coordinator.metrics import Metrics
from nanguard.coordinator.ranks import Admission, RankTable

WALL_0 = 1_700_000_000.0
MONO_0 = 5_000.0
HOUR_S = 3600.0


def at(seconds: float, wall_shift_s: float = 0.0) -> Instant:
    """``seconds`` after the test's start on both clocks; the wall clock also set by ``wall_shift_s``."""
    return Instant(WALL_0 + seconds + wall_shift_s, MONO_0 + seconds)


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def table(registry):
    return RankTable(Metrics(registry), dead_after_s=15.0, stall_after_s=300.0)


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO, "nanguard.coordinator")


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def register(table, rank, seconds, job="job1", wall_shift_s=0.0):
    assert table.admit(job) is Admission.ACCEPTED
    state, registered = table.seen(rank, b"id%d" % rank, at(seconds, wall_shift_s))
    assert registered
    return state


def heartbeat(table, state, step, seconds, wall_shift_s=0.0):
    body = {"rank": state.rank, "world_size": 4, "job": "job1", "host": "h", "pid": 100 + state.rank,
            "step": step, "step_time_s": 0.5, "dropped": 0, "grad_norm": 1.0}
    table.seen(state.rank, state.routing_id, at(seconds, wall_shift_s))
    table.heartbeat(state, body, at(seconds, wall_shift_s))


def states(table) -> dict[int, str]:
    return {r["rank"]: "finished" if r["finished"] else "stalled" if r["stalled"] else
            "alive" if r["alive"] else "dead" for r in table.status()}


def test_the_first_job_named_is_served(table):
    assert table.job is None
    register(table, 0, 0, job="first")
    assert table.job == "first" and 0 in table and len(table) == 1


def test_a_rank_silent_longer_than_dead_after_s_is_dead(table, registry, caplog):
    zero, one = register(table, 0, 0), register(table, 1, 0)
    heartbeat(table, one, 1, 10)
    table.tick(at(15))
    assert states(table) == {0: "alive", 1: "alive"}
    table.tick(at(16))
    assert states(table) == {0: "dead", 1: "alive"}
    assert "rank 0 is dead: nothing heard for 16 s" in caplog.text
    assert (value(registry, "nanguard_ranks_alive"), value(registry, "nanguard_ranks_registered")) == (1, 2)
    heartbeat(table, zero, 1, 30)  # it comes back
    table.tick(at(30))
    assert states(table) == {0: "alive", 1: "dead"}
    assert "rank 0 is back after 30 s of silence" in caplog.text


def test_a_rank_whose_step_did_not_move_for_stall_after_s_is_stalled(table, registry):
    zero, one = register(table, 0, 0), register(table, 1, 0)
    for seconds in range(0, 310, 10):  # both keep talking; only rank 1 makes progress
        heartbeat(table, zero, 7, seconds)
        heartbeat(table, one, seconds, seconds)
    table.tick(at(300))
    assert states(table) == {0: "alive", 1: "alive"}
    table.tick(at(301))
    assert states(table) == {0: "stalled", 1: "alive"}
    assert value(registry, "nanguard_ranks_stalled") == 1
    heartbeat(table, zero, 8, 302)
    table.tick(at(302))
    assert states(table) == {0: "alive", 1: "alive"}


@pytest.mark.parametrize("wall_shift_s", [-HOUR_S, HOUR_S])
def test_setting_the_wall_clock_marks_no_rank_dead_or_stalled(table, registry, wall_shift_s):
    zero, one = register(table, 0, 0), register(table, 1, 0)
    heartbeat(table, zero, 3, 1)
    heartbeat(table, one, 3, 1)
    # the wall clock is set an hour away; 5 s pass on the monotonic clock
    heartbeat(table, one, 4, 5, wall_shift_s)
    for seconds in (5, 10, 16):
        table.tick(at(seconds, wall_shift_s))
    assert states(table) == {0: "alive", 1: "alive"}
    table.tick(at(17, wall_shift_s))  # rank 0 silent for 16 s, whatever the wall clock says
    assert states(table) == {0: "dead", 1: "alive"}
    # what people read stays wall-clock time: rank 1's last message after the jump
    rows = {r["rank"]: r for r in table.status()}
    assert rows[1]["last_seen"] == WALL_0 + 5 + wall_shift_s and rows[0]["last_seen"] == WALL_0 + 1
    assert value(registry, "nanguard_rank_last_seen_timestamp_seconds", rank="1") == WALL_0 + 5 + wall_shift_s


def test_finished_ranks_are_neither_alive_nor_dead_and_get_no_stop(table, registry, caplog):
    zero, one = register(table, 0, 0), register(table, 1, 0)
    table.bye(1, b"id1", at(1))
    assert "rank 1 finished" in caplog.text
    table.tick(at(100))
    assert states(table) == {0: "dead", 1: "finished"}
    assert "rank 1 is dead" not in caplog.text
    assert (value(registry, "nanguard_ranks_finished"), value(registry, "nanguard_ranks_alive")) == (1, 0)
    assert [state.rank for state in table.unfinished()] == [0]
    table.hello(one, {"host": "h", "pid": 2, "world_size": 4})  # the rank runs again
    assert [state.rank for state in table.unfinished()] == [0, 1]


def test_bye_of_a_rank_never_heard_changes_nothing(table):
    register(table, 0, 0)
    table.bye(5, b"id5", at(1))
    assert 5 not in table and states(table) == {0: "alive"}


def test_a_new_job_starts_once_every_rank_of_the_last_is_dead_or_finished(table, registry):
    register(table, 0, 0)
    register(table, 1, 0)
    table.bye(0, b"id0", at(1))
    assert table.admit("job2") is Admission.REFUSED  # rank 1 is alive
    table.tick(at(10))
    assert table.admit("job2") is Admission.REFUSED
    table.tick(at(16))  # rank 1 is dead now
    assert table.admit("job2") is Admission.NEW_JOB
    assert table.job == "job2" and len(table) == 0 and table.status() == []
    assert value(registry, "nanguard_rank_last_seen_timestamp_seconds", rank="1") is None
    assert table.admit("job2") is Admission.ACCEPTED


def test_a_pinned_job_never_changes(registry):
    table = RankTable(Metrics(registry), job="pinned", dead_after_s=15.0, stall_after_s=300.0)
    assert table.job == "pinned"
    assert table.admit("other") is Admission.REFUSED  # even with no rank at all
    register(table, 0, 0, job="pinned")
    table.bye(0, b"id0", at(1))
    assert table.admit("other") is Admission.REFUSED
    assert table.job == "pinned" and states(table) == {0: "finished"}


@pytest.mark.parametrize("name", ["dead_after_s", "stall_after_s"])
def test_durations_must_be_positive(registry, name):
    with pytest.raises(ValueError, match=f"{name}=0 must be a positive number of seconds"):
        RankTable(Metrics(registry), **{name: 0})
