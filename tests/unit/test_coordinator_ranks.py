"""The coordinator's rank table, driven by hand-made clock readings (no sleeping, no socket)."""

import json
import logging

import pytest
from prometheus_client import CollectorRegistry

from nanguard import ProtocolError
from nanguard.coordinator.clock import Instant
from nanguard.coordinator.metrics import Metrics
from nanguard.coordinator.ranks import QUIET_ABOVE_RANKS, Admission, RankTable

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


def hello_body(rank, job="job1", world_size=4, pid=None):
    return {"rank": rank, "local_rank": rank, "world_size": world_size, "host": "h",
            "pid": 100 + rank if pid is None else pid, "job": job, "device": "cpu", "version": "t"}


def hello(table, rank, seconds, job="job1", world_size=4, sender=None, wall_shift_s=0.0):
    return table.hello(sender or f"rank{rank}-session", b"id%d" % rank, hello_body(rank, job, world_size),
                       at(seconds, wall_shift_s))


def register(table, rank, seconds, job="job1", wall_shift_s=0.0):
    result = hello(table, rank, seconds, job, wall_shift_s=wall_shift_s)
    assert result.new_session and result.admission is Admission.ACCEPTED
    return result.state


def refused(reason, call, *args, **kwargs):
    with pytest.raises(ProtocolError) as info:
        call(*args, **kwargs)
    assert info.value.reason == reason, info.value
    return info.value


def heartbeat(table, state, step, seconds, wall_shift_s=0.0, dropped=0):
    body = {"rank": state.rank, "world_size": 4, "job": "job1", "host": "h", "pid": 100 + state.rank,
            "step": step, "step_time_s": 0.5, "dropped": dropped, "grad_norm": 1.0}
    table.seen(table.speaker(state.rank, state.sender), state.routing_id, at(seconds, wall_shift_s))
    table.heartbeat(state, body, at(seconds, wall_shift_s))


def states(table) -> dict[int, str]:
    return {r["rank"]: "finished" if r["finished"] else "failed" if r["failed"] else
            "stalled" if r["stalled"] else "alive" if r["alive"] else "dead" for r in table.status()}


def test_the_first_job_named_is_served(table):
    assert table.job is None and table.world_size is None
    register(table, 0, 0, job="first")
    assert (table.job, table.world_size) == ("first", 4) and 0 in table and len(table) == 1


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


def test_the_per_rank_gauges_are_the_tables(table, registry):
    zero = register(table, 0, 0)
    assert value(registry, "nanguard_rank_last_seen_timestamp_seconds", rank="0") == WALL_0
    assert value(registry, "nanguard_rank_step", rank="0") is None  # no heartbeat yet
    heartbeat(table, zero, 41, 2)
    assert value(registry, "nanguard_rank_last_seen_timestamp_seconds", rank="0") == WALL_0 + 2
    assert (value(registry, "nanguard_rank_step", rank="0"), value(registry, "nanguard_rank_step_time_seconds",
            rank="0"), value(registry, "nanguard_rank_grad_norm", rank="0")) == (41, 0.5, 1.0)


def test_dropped_events_count_the_increase_of_each_processs_running_count(table, registry):
    zero = register(table, 0, 0)
    for seconds, cumulative in enumerate((0, 5, 5, 12), start=1):
        heartbeat(table, zero, seconds, seconds, dropped=cumulative)
    assert value(registry, "nanguard_events_dropped_total", rank="0") == 12
    heartbeat(table, zero, 5, 5, dropped=2)  # a count below the last: a process counting from zero again
    assert value(registry, "nanguard_events_dropped_total", rank="0") == 14
    new = hello(table, 0, 6, sender="rank0-new-process").state  # its count starts from zero, even above the last
    heartbeat(table, new, 1, 7, dropped=20)
    assert value(registry, "nanguard_events_dropped_total", rank="0") == 34
    assert [r["dropped"] for r in table.status()] == [20]


def test_the_status_as_json_is_the_status(table):
    assert json.loads(table.status_json('{"ranks":', "}")) == {"ranks": []}
    heartbeat(table, register(table, 2, 0), 7, 3)
    assert json.loads(table.status_json()) == table.status()
    for rank in (0, 1):
        heartbeat(table, register(table, rank, rank), 7, 3)
    table.speaker(1, "rank1-session").grad_norm = float("inf")
    assert json.loads(table.status_json()) == table.status()
    assert json.loads(table.status_json('{"a":1,"ranks":', ',"b":2}')) == {"a": 1, "ranks": table.status(), "b": 2}
    assert [r["rank"] for r in table.status()] == [0, 1, 2] and table.status()[1]["grad_norm"] == "inf"


def test_finished_ranks_are_neither_alive_nor_dead_and_get_no_stop(table, registry, caplog):
    register(table, 0, 0)
    one = register(table, 1, 0)
    table.bye(one, True, at(1))
    assert "rank 1 finished" in caplog.text
    table.tick(at(100))
    assert states(table) == {0: "dead", 1: "finished"}
    assert "rank 1 is dead" not in caplog.text
    assert (value(registry, "nanguard_ranks_finished"), value(registry, "nanguard_ranks_alive")) == (1, 0)
    assert [state.rank for state in table.unfinished()] == [0]
    hello(table, 1, 101, sender="rank1-again")  # the rank runs again
    assert [state.rank for state in table.unfinished()] == [0, 1]


def test_an_unclean_bye_is_failed_at_once_never_finished(table, registry, caplog):
    register(table, 0, 0)
    one = register(table, 1, 0)
    table.bye(one, False, at(1))
    assert "rank 1 ended without a clean exit" in caplog.text
    table.tick(at(1.5))  # well before dead_after_s
    assert states(table) == {0: "alive", 1: "failed"}
    assert [value(registry, f"nanguard_ranks_{name}") for name in ("alive", "finished", "failed")] == [1, 0, 1]
    assert [state.rank for state in table.unfinished()] == [0]
    # what its session still sends (its last heartbeat came before the bye) does not revive it
    table.seen(one, b"id1", at(2))
    table.tick(at(2))
    assert states(table) == {0: "alive", 1: "failed"}
    hello(table, 1, 3, sender="rank1-restarted")  # a new process for rank 1
    table.tick(at(3))
    assert states(table) == {0: "alive", 1: "alive"}


def test_only_the_session_that_said_hello_speaks_for_its_rank(table):
    state = register(table, 0, 0)
    assert table.speaker(0, "rank0-session") is state
    refused("unregistered", table.speaker, 0, "someone-else")
    refused("unregistered", table.speaker, 3, "rank3-session")  # never said hello
    # a new process of rank 0 takes it over; the old session is no longer heard
    again = hello(table, 0, 1, sender="rank0-new-process")
    assert again.new_session and again.state is state
    refused("unregistered", table.speaker, 0, "rank0-session")
    assert not hello(table, 0, 2, sender="rank0-new-process").new_session  # a reconnect of the same one


def test_ranks_are_bounded_by_the_world_size_and_the_coordinator_limit(registry):
    table = RankTable(Metrics(registry), max_world_size=8)
    refused("out_of_range", hello, table, 0, 0, world_size=9)
    refused("out_of_range", hello, table, 4, 0, world_size=4)
    assert table.job is None and len(table) == 0
    register(table, 3, 0)
    assert table.world_size == 4
    refused("out_of_range", hello, table, 4, 1)
    # a new world size of the same job is another incarnation: not while this one lives
    error = refused("wrong_job", hello, table, 5, 1, world_size=8)
    assert "world size 4" in str(error) and len(table) == 1


def test_a_new_job_starts_once_every_rank_of_the_last_is_dead_failed_or_finished(table, registry):
    zero, one, two = (register(table, rank, 0) for rank in range(3))
    table.bye(zero, True, at(1))
    table.bye(two, False, at(1))
    refused("wrong_job", hello, table, 0, 1, job="job2")  # rank 1 is alive
    table.tick(at(10))
    refused("wrong_job", hello, table, 0, 10, job="job2")
    table.tick(at(16))  # rank 1 is dead now
    result = hello(table, 0, 16, job="job2", world_size=2)
    assert result.admission is Admission.NEW_JOB and (table.job, table.world_size) == ("job2", 2)
    assert len(table) == 1 and [r["rank"] for r in table.status()] == [0]
    assert value(registry, "nanguard_rank_last_seen_timestamp_seconds", rank="1") is None
    assert hello(table, 1, 17, job="job2", world_size=2).admission is Admission.ACCEPTED


def test_the_same_job_with_another_world_size_is_a_new_incarnation_once_the_last_is_over(table):
    (zero,) = (register(table, 0, 0),)
    table.bye(zero, False, at(1))
    result = hello(table, 0, 2, world_size=2, sender="new")
    assert result.admission is Admission.NEW_JOB and table.world_size == 2


def test_a_pinned_job_never_changes(registry):
    table = RankTable(Metrics(registry), job="pinned", dead_after_s=15.0, stall_after_s=300.0)
    assert table.job == "pinned"
    refused("wrong_job", hello, table, 0, 0, job="other")  # even with no rank at all
    state = register(table, 0, 0, job="pinned")
    table.bye(state, True, at(1))
    refused("wrong_job", hello, table, 0, 2, job="other")
    assert table.job == "pinned" and states(table) == {0: "finished"}


def test_a_paused_coordinator_does_not_count_its_pause_as_silence(table, registry):
    from nanguard.coordinator.clock import LoopClock

    now = {"mono": MONO_0}
    clock = LoopClock(mono=lambda: now["mono"], wall=lambda: WALL_0 + now["mono"] - MONO_0)
    zero, one = (table.hello(f"s{rank}", b"id", hello_body(rank), clock.now()).state for rank in (0, 1))
    for _ in range(20):  # the loop reads the clock every half second
        now["mono"] += 0.5
        table.tick(clock.now())
    now["mono"] += 30.0  # SIGSTOP for 30 s, then SIGCONT: the loop reads one rank's queued heartbeat
    table.seen(zero, b"id", clock.now())
    table.tick(clock.now())  # the other rank's heartbeats are not read yet
    assert states(table) == {0: "alive", 1: "alive"} and value(registry, "nanguard_ranks_alive") == 2
    assert clock.paused_s == pytest.approx(30.0)
    for _ in range(31):  # 15.5 s of listening without a word from rank 1: now it is dead
        now["mono"] += 0.5
        table.seen(zero, b"id", clock.now())
        table.tick(clock.now())
    assert states(table) == {0: "alive", 1: "dead"}


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True])
@pytest.mark.parametrize("name", ["dead_after_s", "stall_after_s"])
def test_durations_must_be_positive_and_finite(registry, name, value):
    # an infinite one would never count a silent rank as dead
    with pytest.raises(ValueError, match=rf"{name}={value!r} must be a positive number of seconds"):
        RankTable(Metrics(registry), **{name: value})


def test_a_large_job_logs_counts_not_a_line_per_rank(caplog):
    world = 4 * QUIET_ABOVE_RANKS + 3
    table = RankTable(Metrics(CollectorRegistry()))
    caplog.set_level(logging.INFO, logger="nanguard.coordinator")
    for rank in range(world):
        table.hello(f"s{rank}", b"r", {"rank": rank, "local_rank": 0, "world_size": world, "host": "h", "pid": 1,
                                       "job": "big", "device": "cpu", "version": "t"}, Instant(1.0, 1.0))
    registered = [r.getMessage() for r in caplog.records if "registered" in r.getMessage()]
    assert registered[-1] == f"rank {world - 1} registered ({world} of {world} known)"
    assert len(registered) == world.bit_length() + 1  # 1, 2, 4, ..., 256 and the last
    for rank in range(world):
        table.bye(table.speaker(rank, f"s{rank}"), True, Instant(2.0, 2.0))
    table.tick(Instant(2.0, 2.0))
    finished = [r.getMessage() for r in caplog.records if "finished" in r.getMessage()]
    assert finished == [f"{world} of {world} ranks finished"]


def launch(table, restart, seconds, ranks=(0, 1), session="a"):
    """Hellos of ``ranks`` of a launch's processes that say ``restart``; each one's Admission."""
    return [table.hello(f"rank{rank}-{session}", b"id%d" % rank, {**hello_body(rank, world_size=2), "restart": restart},
                        at(seconds)).admission for rank in ranks]


def test_a_higher_restart_count_is_a_torchrun_restart_of_the_launch(table, caplog):
    assert launch(table, 0, 0) == [Admission.ACCEPTED] * 2
    # torchrun restarts every worker: the first hello of restart 1 says so, while the others of
    # restart 0 may still look alive (killed without a bye)
    assert launch(table, 1, 1, session="b") == [Admission.RESTARTED, Admission.ACCEPTED]
    assert table.restart == 1 and len(table) == 2
    assert "job job1: torchrun restarted its workers (restart 1, was 0)" in caplog.text


def test_a_restart_count_back_to_0_is_a_new_launch_once_every_rank_ended(table, caplog):
    launch(table, 0, 0)
    launch(table, 1, 1, session="b")
    # as for another job: a rank's word does not end a launch whose ranks are alive
    refused("wrong_job", launch, table, 0, 2, ranks=(0,), session="c")
    for rank in (0, 1):
        table.bye(table.speaker(rank, f"rank{rank}-b"), False, at(3))
    assert launch(table, 0, 4, ranks=(0,), session="c") == [Admission.NEW_JOB]
    assert table.restart == 0 and [row["rank"] for row in table.status()] == [0]
    assert "job job1: a new launch (restart 0) replaces the one served (restart 1), every rank of which ended" \
        in caplog.text


def test_the_same_restart_count_is_a_new_launch_only_from_new_processes_once_every_rank_ended(table, caplog):
    states = [table.hello(f"rank{r}-a", b"id%d" % r, {**hello_body(r, world_size=2), "restart": 0}, at(0)).state
              for r in (0, 1)]
    assert launch(table, 0, 1, ranks=(0,)) == [Admission.ACCEPTED]  # a process reconnecting
    table.bye(states[0], False, at(2))
    assert launch(table, 0, 3, ranks=(0,), session="b") == [Admission.ACCEPTED]  # rank 1 is alive
    table.bye(states[1], False, at(4))
    table.bye(table.speaker(0, "rank0-b"), False, at(4))
    assert launch(table, 0, 6, ranks=(1,), session="c") == [Admission.NEW_JOB]  # a new launch of run id 'none'
    assert "a new launch (restart 0) replaces the one served (restart 0), every rank of which ended" in caplog.text


def test_ranks_that_do_not_say_their_restart_count_stay_one_incarnation(table):
    states = register(table, 0, 0), register(table, 1, 0)
    for state in states:
        table.bye(state, False, at(1))
    assert hello(table, 0, 2, sender="rank0-new").admission is Admission.ACCEPTED  # as before this field
    assert table.restart is None


def test_a_restored_incarnation_is_not_ended_before_its_ranks_reconnect(table):
    assert table.restore("job1", 2, 0)
    assert launch(table, 0, 0, ranks=(0,)) == [Admission.ACCEPTED]  # the stopped launch reconnects
    assert launch(table, 1, 1, ranks=(0,), session="b") == [Admission.RESTARTED]


def test_a_lower_restart_count_after_a_restore_is_a_new_launch(table):
    assert table.restore("job1", 2, 1)
    assert launch(table, 0, 0, ranks=(0,)) == [Admission.NEW_JOB]
