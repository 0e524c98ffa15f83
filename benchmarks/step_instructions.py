"""Instructions per training step, counted by callgrind: repeatable where wall time is not.

On a shared 2-core machine two runs of identical code differ by about 5% in wall time, which is
as large as the differences worth knowing here. valgrind's callgrind counts the instructions a
process executes instead, which the rest of the machine does not change; what does move the count,
by about 2% per step, is where garbage collection and lazy initialisation fall. The warm-up takes
the second; for the first, the objects made before the counted steps are frozen (``gc.freeze``),
so that a full collection over torch's heap, whose place depends on how many objects a checkout's
imports made, no longer lands in one checkout's counted steps and not in another's (it moved the
per-step count of identical hot paths by up to 3%).
Each variant runs twice under callgrind, with K and with K+N training steps after the same
warm-up; the difference divided by N is what one step costs, import and set-up cancelling out.

    python benchmarks/step_instructions.py                       # this checkout, MLP, plain vs nanguard
    python benchmarks/step_instructions.py --model hf-gpt2       # any workload of overhead.py
    python benchmarks/step_instructions.py --repo /path/to/other/checkout --repo .   # side by side

The workloads are overhead.py's, run by its Runner (the third-party ones need the realworld
extra). Needs valgrind (Debian package ``valgrind``). A run takes a few minutes per variant: the
import of torch alone is about five billion instructions, of transformers as many again.
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
import gc
benchmarks, repo, variant, model, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
sys.path.insert(0, benchmarks)
import torch
torch.set_num_threads(1)
import overhead
# the checkout under test, not the one overhead.py imported from beside itself
for name in [m for m in sys.modules if m == "nanguard" or m.startswith("nanguard.")]:
    del sys.modules[name]
sys.path.insert(0, repo)
import nanguard
assert nanguard.__file__.startswith(repo), nanguard.__file__
overhead.nanguard = nanguard
runner = overhead.Runner(overhead.MODELS[model], overhead.VARIANTS[variant], torch.device("cpu"))
for _ in range(3):  # warm-up steps: lazy initialisation is in both runs and cancels
    runner.step()
# the objects made so far (torch's, the imports') leave the collector's generations: otherwise a
# full collection, whose cost grows with them, falls inside the counted steps in one checkout and
# outside them in another, as the imports happened to leave the collector's counters
gc.collect()
gc.freeze()
for _ in range(steps):
    runner.step()
'''


def instructions(repo: Path, variant: str, model: str, steps: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "steps.py"
        script.write_text(STEPS_SCRIPT)
        out = Path(tmp) / "callgrind.out"
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "NANGUARD_DIR": tmp}
        run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                              sys.executable, str(script), str(HERE), str(repo), variant, model, str(steps)],
                             capture_output=True, text=True, env=env, check=False)
        found = re.search(r"Collected : (\d+)", run.stderr)
        if run.returncode != 0 or found is None:
            raise SystemExit(f"callgrind run failed ({repo}, {variant}, {model}, {steps} steps):\n{run.stderr[-3000:]}")
        return int(found.group(1))


def per_step(repo: Path, variant: str, model: str, steps: int) -> float:
    return (instructions(repo, variant, model, steps) - instructions(repo, variant, model, 0)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", action="append", type=Path,
                        help="a checkout to measure (repeat to compare); default: this one")
    parser.add_argument("--model", default="mlp",
                        help="a workload of overhead.py (mlp, hf-gpt2, resnet-bn, ...; default mlp)")
    parser.add_argument("--steps", type=int, default=20, help="N: the steps counted (default 20)")
    parser.add_argument("--variant", action="append",
                        help="an overhead.py variant to count (repeat: 'nanguard full'); default: nanguard")
    args = parser.parse_args()
    if args.model not in overhead_models():
        parser.error(f"--model {args.model!r}: not a workload of overhead.py ({', '.join(overhead_models())})")
    repos = [r.resolve() for r in args.repo] if args.repo else [HERE.parent]
    plain = per_step(repos[0], "plain", args.model, args.steps)
    print(f"{args.model}, 1 thread: instructions per step (callgrind, N={args.steps})")
    print("| checkout | variant | plain | guarded | guarded / plain |\n|---|---|---:|---:|---:|")
    for repo in repos:
        for variant in args.variant or ["nanguard"]:
            guarded = per_step(repo, variant, args.model, args.steps)
            print(f"| {repo} | {variant} | {plain:,.0f} | {guarded:,.0f} | {guarded / plain:.3f} |", flush=True)


def overhead_models() -> list[str]:
    sys.path.insert(0, str(HERE))
    import overhead
    return list(overhead.MODELS)


if __name__ == "__main__":
    main()
