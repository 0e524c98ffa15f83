"""A process group made of threads: N ranks of one test process exchanging through a barrier.

The cluster is the edge a unit test cannot run; everything above it (the decision, the agreement,
the capture's collectives) runs for real against this stand-in for ``nanguard._dist.Collectives``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class ThreadGroup:
    def __init__(self, world_size: int, timeout_s: float = 60.0):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._slots: list[Any] = [None] * world_size

    def member(self, rank: int) -> FakeCollectives:
        return FakeCollectives(self, rank)

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return values

    def run(self, body: Callable[[FakeCollectives], Any]) -> list[Any]:
        """``body(collectives)`` on every rank, each in its own thread; its results (or the
        exception it raised), by rank. A rank that hangs breaks the barrier's timeout."""
        results: list[Any] = [None] * self.world_size

        def rank_main(rank: int) -> None:
            try:
                results[rank] = body(self.member(rank))
            except BaseException as exc:  # noqa: BLE001 - handed to the test, which asserts on it
                results[rank] = exc

        threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}") for r in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
            assert not thread.is_alive(), f"{thread.name} hung"
        return results


class FakeCollectives:
    active = True

    def __init__(self, group: ThreadGroup, rank: int):
        self._group = group
        self.rank = rank
        self.world_size = group.world_size

    def device(self) -> torch.device:
        return torch.device("cpu")

    def all_reduce(self, tensor: torch.Tensor) -> None:
        values = self._group.exchange(self.rank, tensor.clone())
        tensor.copy_(torch.stack(values).sum(dim=0))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self._group.exchange(self.rank, obj)[src]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._group.exchange(self.rank, obj)

    def barrier(self) -> None:
        self._group.exchange(self.rank, None)
