"""Gradient accumulation under DDP (no_sync on all but the last micro-batch), guarded by
nanguard: torchrun --standalone --nproc-per-node 2 examples/grad_accum.py

A report names the micro-batch a non-finite value came from; `--bad-micro M` puts it there.
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import nanguard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--bad-step", type=int, default=-1)
    parser.add_argument("--bad-micro", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nanguard.init(model, optimizer)
    try:
        for step in range(args.steps):
            for micro in range(args.accumulate):
                x, y = torch.randn(8, 16), torch.randn(8, 2)
                if (step, micro) == (args.bad_step, args.bad_micro) and rank == 0:
                    x[0, 3] = float("nan")  # a corrupt sample in one micro-batch
                last = micro == args.accumulate - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = nn.functional.mse_loss(model(x), y) / args.accumulate
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"[rank {rank}] {args.steps} steps of {args.accumulate} micro-batches, no non-finite value")
    except nanguard.NonFiniteError as err:
        print(f"[rank {rank}] stopped: {err.event.where()}")
    finally:
        guard.close()


if __name__ == "__main__":
    main()  # the model is freed when main() returns; end the process group after it (README)
    nanguard.destroy_process_group()
