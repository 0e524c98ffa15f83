"""Instructions per training step, counted by callgrind: repeatable where wall time is not.

On a shared 2-core machine two runs of identical code differ by about 5% in wall time, which is
as large as the differences worth knowing here. valgrind's callgrind counts the instructions a
process executes instead, the same for the same binary and inputs whatever else the machine does.
Each variant runs twice under callgrind, with K and with K+N training steps after the same
warm-up; the difference divided by N is what one step costs, import and set-up cancelling out.

    python benchmarks/step_instructions.py                       # this checkout, MLP, plain vs nanguard
    python benchmarks/step_instructions.py --repo /path/to/other/checkout --repo .   # side by side

Needs valgrind (Debian package ``valgrind``). A run takes a minute or two per variant: the import
of torch alone is about five billion instructions.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

STEPS_SCRIPT = r'''
import sys
sys.path.insert(0, sys.argv[1])
import torch
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(1)
variant, steps = sys.argv[2], int(sys.argv[3])
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
guard = None
if variant == "nanguard":
    import nanguard
    guard = nanguard.init(model, optimizer)
x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

def step():
    loss = nn.functional.cross_entropy(model(x), y)
    if guard is not None:
        guard.check(loss)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

for _ in range(10 + steps):  # 10 warm-up steps: lazy initialisation must not be counted
    step()
'''


def instructions(repo: Path, variant: str, steps: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "steps.py"
        script.write_text(STEPS_SCRIPT)
        out = Path(tmp) / "callgrind.out"
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "NANGUARD_DIR": tmp}
        run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                              sys.executable, str(script), str(repo), variant, str(steps)],
                             capture_output=True, text=True, env=env, check=False)
        found = re.search(r"Collected : (\d+)", run.stderr)
        if run.returncode != 0 or found is None:
            raise SystemExit(f"callgrind run failed ({repo}, {variant}, {steps} steps):\n{run.stderr[-3000:]}")
        return int(found.group(1))


def per_step(repo: Path, variant: str, base: int, steps: int) -> float:
    return (instructions(repo, variant, base + steps) - instructions(repo, variant, base)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", action="append", type=Path,
                        help="a checkout to measure (repeat to compare); default: this one")
    parser.add_argument("--steps", type=int, default=40, help="N: the steps counted (default 40)")
    args = parser.parse_args()
    repos = [r.resolve() for r in args.repo] if args.repo else [HERE.parent]
    plain = per_step(repos[0], "plain", 0, args.steps)
    print(f"MLP 64-256-256-10, batch 64, SGD, 1 thread: instructions per step (callgrind, N={args.steps})")
    print("| checkout | plain | nanguard | nanguard / plain |\n|---|---:|---:|---:|")
    for repo in repos:
        guarded = per_step(repo, "nanguard", 0, args.steps)
        print(f"| {repo} | {plain:,.0f} | {guarded:,.0f} | {guarded / plain:.3f} |", flush=True)


if __name__ == "__main__":
    main()
