"""``nanguard demo``: a small training run whose attention scores overflow at a chosen step.

Runs on one process or under ``torchrun`` (gloo on CPU); only the last rank's data goes bad,
and every rank stops at the same step with its weights as they were before that step.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import nanguard


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.proj(h) * torch.sigmoid(self.gate(h))


class Model(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def run(steps: int = 40, bad_step: int = 25) -> int:
    dist = torch.distributed
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)
    model = Model()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = nanguard.init(model, optimizer)
    generator = torch.Generator().manual_seed(1 + rank)
    try:
        for step in range(steps):
            x = torch.randn(16, 8, generator=generator)
            y = torch.randint(0, 4, (16,), generator=generator)
            if step == bad_step and rank == world - 1:
                # one feature blows up: finite in the batch, Inf after the second block's gate
                inner = model.module if distributed else model
                with torch.no_grad():
                    inner.blocks[1].gate.weight[3].fill_(3e38)
            loss = nn.functional.cross_entropy(model(x), y)
            guard.check(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"[rank {rank}] finished {steps} steps without a non-finite value")
    except nanguard.NonFiniteError as err:
        finite = all(torch.isfinite(p).all() for n, p in model.named_parameters() if "gate" not in n)
        print(f"[rank {rank}] stopped at step {guard.step - 1}: {err.event.where()}"
              f"\n[rank {rank}] first event came from rank {err.event.rank}; weights untouched by"
              f" the bad step: {finite}")
    finally:
        guard.close()
        if distributed:
            dist.destroy_process_group()
    return 0
