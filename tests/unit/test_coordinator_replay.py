"""The coordinator's replay memory: tables that a flood of one kind of sender cannot flush."""

import time

import pytest

from nanguard.coordinator.replay import GUEST, OPERATOR, RANK, ReplayMemory
from nanguard.errors import ProtocolError
from nanguard.wire import Message


def message(sender: str, seq: int, now: float, type_: str = "handshake") -> Message:
    return Message(type_, sender, seq, now, "coordinator", {}, b"")


def refused(memory: ReplayMemory, msg: Message, now: float) -> str:
    with pytest.raises(ProtocolError) as info:
        memory.check(msg, now)
    return info.value.reason


def test_a_message_seen_before_or_out_of_the_window_is_refused():
    memory, now = ReplayMemory(window_s=300), time.time()
    memory.check(message("a", 1, now), now)
    memory.check(message("a", 2, now), now)
    assert refused(memory, message("a", 2, now), now) == "replayed"
    assert refused(memory, message("a", 1, now), now) == "replayed"
    assert refused(memory, message("b", 1, now - 301), now) == "stale"
    assert refused(memory, message("b", 1, now + 301), now) == "stale"


def test_guests_push_out_only_guests():
    memory, now = ReplayMemory(sizes={GUEST: 3, RANK: 2, OPERATOR: 2}), time.time()
    operator, rank = message("operator", 5, now, "stop_request"), message("rank0", 7, now, "hello")
    for accepted, kind in ((operator, OPERATOR), (rank, RANK)):
        memory.check(accepted, now)
        memory.trust(accepted, kind)
    for i in range(10_000):
        memory.check(message(f"flood-{i}", 1, now), now)
    assert (memory.kind_of("operator"), memory.kind_of("rank0"), memory.kind_of("flood-0")) == (OPERATOR, RANK, None)
    assert len(memory) == 3 + 2
    assert refused(memory, operator, now) == "replayed"
    assert refused(memory, rank, now) == "replayed"


def test_trust_keeps_the_last_seq_and_an_operator_stays_one():
    memory, now = ReplayMemory(), time.time()
    memory.check(message("s", 3, now), now)
    memory.trust(message("s", 3, now), OPERATOR)
    memory.trust(message("s", 3, now, "hello"), RANK)  # an operator session is not demoted
    assert memory.kind_of("s") == OPERATOR
    assert refused(memory, message("s", 3, now), now) == "replayed"
    memory.check(message("s", 4, now), now)
    with pytest.raises(ValueError, match="is not operator or rank"):
        memory.trust(message("s", 4, now), GUEST)


def test_each_table_forgets_its_least_recently_heard():
    memory, now = ReplayMemory(sizes={RANK: 2}), time.time()
    for name in ("r1", "r2", "r3"):
        memory.check(message(name, 1, now, "hello"), now)
        memory.trust(message(name, 1, now, "hello"), RANK)
    assert [memory.kind_of(name) for name in ("r1", "r2", "r3")] == [None, RANK, RANK]


def test_bad_sizes_are_refused_with_their_names():
    with pytest.raises(ValueError, match="one positive size for each of operator, rank, guest"):
        ReplayMemory(sizes={GUEST: 0})
