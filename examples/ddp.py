"""DDP training guarded by nanguard: torchrun --standalone --nproc-per-node 2 examples/ddp.py

Set NANGUARD_COORDINATOR=tcp://host:port to report to a running `nanguard coordinator`.
`--bad-step K` makes the last rank's batch non-finite at step K, to see a stop.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import nanguard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bad-step", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = nanguard.init(model, optimizer)
    try:
        for step in range(args.steps):
            x = torch.randn(16, 32, device=device)
            y = torch.randint(0, 8, (16,), device=device)
            if step == args.bad_step and rank == world - 1:
                x[0, 0] = float("nan")
            loss = nn.functional.cross_entropy(model(x), y)
            guard.check(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"[rank {rank}] {args.steps} steps, no non-finite value")
    except nanguard.NonFiniteError as err:
        print(f"[rank {rank}] stopped before step {err.event.step}'s update; incident {err.incident}")
    finally:
        guard.close()


if __name__ == "__main__":
    main()  # the model is freed when main() returns; end the process group after it (README)
    nanguard.destroy_process_group()
