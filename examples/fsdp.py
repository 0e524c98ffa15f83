"""FSDP2 (fully_shard) training guarded by nanguard:
torchrun --standalone --nproc-per-node 2 examples/fsdp.py

Each rank's incident part holds its own shards; `nanguard inspect` says how to load them.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import nanguard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bad-step", type=int, default=-1)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda" if cuda else "cpu")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)), nn.Linear(64, 4))
    model.to(device)
    for block in model[:4]:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = nanguard.init(model, optimizer)
    try:
        for step in range(args.steps):
            x = torch.randn(8, 64, device=device)
            y = torch.randint(0, 4, (8,), device=device)
            if step == args.bad_step and rank == 0:
                x[1] = float("inf")
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"[rank {rank}] {args.steps} steps, no non-finite value")
    except nanguard.NonFiniteError as err:
        print(f"[rank {rank}] stopped before step {err.event.step}'s update: {err.event.where()}")
    finally:
        guard.close()


if __name__ == "__main__":
    main()  # the model is freed when main() returns; end the process group after it (README)
    nanguard.destroy_process_group()
