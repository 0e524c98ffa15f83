"""Mixed precision guarded by nanguard: python examples/amp.py (one process; any device).

On a GPU: float16 autocast with a GradScaler. The scaler skips steps whose scaled gradients
overflow, which is normal and does not stop training; passing `scaler=` to `nanguard.init` lets
nanguard still stop a step whose forward went non-finite, at `scaler.update()`. On the CPU:
bfloat16 autocast, which needs no scaler.
"""

import argparse

import torch
from torch import nn

import nanguard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bad-step", type=int, default=-1)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 4)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    guard = nanguard.init(model, optimizer, scaler=scaler)
    try:
        for step in range(args.steps):
            x = torch.randn(16, 32, device=device)
            y = torch.randint(0, 4, (16,), device=device)
            if step == args.bad_step:
                x[0, 0] = float("inf")
            with torch.autocast(device, dtype=dtype):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        print(f"{args.steps} steps in {dtype}, no non-finite value")
    except nanguard.NonFiniteError as err:
        print(f"stopped before step {err.event.step}'s update: {err.event.where()}")
    finally:
        guard.close()


if __name__ == "__main__":
    main()
