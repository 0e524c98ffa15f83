"""nanguard.destroy_process_group: gloo's worker threads end before Python finalizes, and nothing
nanguard holds keeps a DDP model (or its process group) alive past the user's own cleanup.

A one-rank gloo group in this process (file store): the same worker threads as a torchrun rank.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nanguard
from nanguard import _dist

from conftest import make_mlp, train_step

GLOO_WORKER = "pt_gloo_runloop"


def ddp_model_after_a_step(close: bool, fault: bool = False) -> tuple[weakref.ref, weakref.ref]:
    """Train a DDP model under a guard, then drop every reference the test holds; returns
    weak references to the model and the guard."""
    model = nn.parallel.DistributedDataParallel(make_mlp())
    optimizer = torch.optim.AdamW(model.parameters())
    guard = nanguard.init(model, optimizer)
    train_step(model, optimizer, guard)
    if fault:
        model.module[2].armed = True
        try:
            train_step(model, optimizer, guard)
        except nanguard.NonFiniteError as err:
            assert err.incident is not None
        else:
            raise AssertionError("the armed fault did not stop the step")
    if close:
        guard.close()
    return weakref.ref(model), weakref.ref(guard)


@pytest.mark.modes("sentinel", "full")  # (the microscope's re-run leaves graphs whose hooks hold the guard)
@pytest.mark.parametrize("close, fault", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["closed", "never-closed", "closed-after-stop", "never-closed-after-stop"])
def test_nanguard_keeps_no_ddp_model_alive(gloo, close, fault):
    # hooks, the DDP communication hook, the step's kept batch and tensors, the error: none of
    # them may hold the model (and through it the process group) once the user lets it go
    model, guard = ddp_model_after_a_step(close, fault)
    while gc.collect():  # finalizers of one pass can free more for the next
        pass
    assert model() is None
    if close:
        assert guard() is None


def test_destroy_process_group_ends_gloos_threads_once_the_model_is_freed(gloo):
    ddp_model_after_a_step(close=True)
    assert _dist._tasks(GLOO_WORKER), "a gloo group runs worker threads"
    # torch's own destroy leaves them running: torch.distributed.nn.functional's default
    # arguments still hold the default group
    assert nanguard.destroy_process_group() is True
    assert not dist.is_initialized()
    assert _dist._tasks(GLOO_WORKER) == []
    assert nanguard.destroy_process_group() is True  # again: nothing to do


def test_a_model_still_referenced_is_named_and_the_workers_are_waited_for(gloo, caplog):
    model = nn.parallel.DistributedDataParallel(make_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        assert nanguard.destroy_process_group(timeout_s=5.0) is True  # the workers are idle
    assert "DistributedDataParallel" in caplog.text and "free the model" in caplog.text
    assert _dist._tasks(GLOO_WORKER)  # still there: the model holds the group
    del model, optimizer
    assert nanguard.destroy_process_group() is True
    assert _dist._tasks(GLOO_WORKER) == []


def test_settle_returns_at_once_without_gloo():
    assert _dist.settle_gloo_workers(timeout_s=0.0) is True


def test_without_torch_distributed_state_there_is_nothing_to_do():
    assert not dist.is_initialized()
    assert nanguard.destroy_process_group() is True
