"""Collectives' object exchange over a real (one-rank, gloo) process group: what a rank sends is
what the group reads back, tensors and nested containers included, in bytes nanguard moves itself
(torch's object collectives need numpy; tests/integration/test_without_numpy.py runs a job without)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from nanguard._dist import Collectives
from nanguard.events import Event

SENT = [None, True, "", "rank 0 \N{CHECK MARK}", 2**70, float("nan"), b"\x00" * 3,
        {"args": (torch.arange(6.0).view(2, 3), [torch.tensor([1, 2], dtype=torch.int8)]),
         "rng": torch.get_rng_state(), "autocast": ("cpu", torch.bfloat16, False), "slot": 0},
        (Event(kind="forward", rank=1, step=3, layer="blocks.1.fc").to_dict(), True, (0, 1), False, 0)]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("obj", SENT, ids=range(len(SENT)))
def test_what_a_rank_sends_is_what_the_group_reads(gloo, obj):
    collectives = Collectives()
    gathered = collectives.all_gather_object(obj)
    assert len(gathered) == 1 and same(gathered[0], obj)
    assert same(collectives.broadcast_object(obj, src=0), obj)


def test_bytes_come_back_exactly_whatever_their_length(gloo):
    collectives = Collectives()
    for data in (b"x", bytes(range(256)) * 1000):
        assert collectives._exchange_bytes(dist, data) == [data]
        assert collectives._exchange_bytes(dist, data, src=0) == [data]


def test_without_a_group_an_object_stays_in_this_process():
    obj = {"t": torch.ones(2)}
    assert Collectives().all_gather_object(obj)[0] is obj
    assert Collectives().broadcast_object(obj) is obj
