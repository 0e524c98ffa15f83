"""A script as a user first writes it: DDP (gloo) with ``nanguard.init(model, optimizer)`` and no
``except``, so the NonFiniteError of a NaN born on ``--fault-rank`` ends every rank; torchrun's
summary then says what happened. ``--other`` raises a ValueError on that rank instead;
``--fault-rank -1 --steps N --step-sleep S``: no NaN, a run long enough for an operator's stop,
whose StopRequested ends every rank alike; ``--fault-restart N``: the NaN only in torchrun's restart N
(TORCHELASTIC_RESTART_COUNT), a fault the restart does not meet again; ``--no-numpy`` first checks that numpy cannot be
imported here (a test's shim hides it)."""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import nanguard


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="steps to run (default: 3 past the fault's)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--fault-restart", type=int, default=None, help="the fault only in this torchrun restart")
    parser.add_argument("--other", action="store_true", help="a ValueError of the script's own instead")
    parser.add_argument("--no-numpy", action="store_true", help="fail unless numpy is hidden from this process")
    args = parser.parse_args()
    if args.no_numpy:
        try:
            import numpy  # noqa: F401
        except ImportError:
            print(f"worker {sys.argv[0]}: numpy cannot be imported here, torch {torch.__version__} can", flush=True)
        else:
            raise SystemExit("numpy imports: the test's shim did not hide it")
    restart, timeout = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), datetime.timedelta(seconds=60)
    if restart:
        # torchrun's agent keeps one store across restarts, and gloo then reads the last attempt's
        # addresses (connectFullMesh: connection refused): each attempt's keys under a prefix of its own
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"restart{restart}", store), timeout=timeout,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    nanguard.init(model, optimizer)
    for step in range(args.fault_step + 3 if args.steps is None else args.steps):
        x = torch.randn(4, 8)
        if step == args.fault_step and rank == args.fault_rank and args.fault_restart in (None, restart):
            if args.other:
                raise ValueError(f"the script's own error on rank {rank}")
            x[0, 0] = float("nan")
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.step_sleep)
    nanguard.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
