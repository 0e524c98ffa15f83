"""On a GPU: nanguard's cost on a >= 100M-parameter bf16 GPT, and the host synchronisations it adds.

The claim to check: a guarded training step synchronises with the host exactly once more than a
plain one (the read of the step's probe vector), whatever the number of modules. CUDA counts
synchronising calls itself when ``torch.cuda.set_sync_debug_mode("warn")`` is on: each one warns,
and the warnings of a step are counted. Times are CUDA-event medians of alternating rounds, plain
and guarded in one process, as paired ratios (the same method as overhead.py).

    python benchmarks/gpu_sync.py                    # GPT-2 small shape (124M), bf16 autocast, AdamW
    python benchmarks/gpu_sync.py --layers 24 --width 1024   # GPT-2 medium shape (350M)
    python benchmarks/gpu_sync.py --device cpu --tiny        # the code path on a CPU, no counts

CI has no GPU: this script is run by hand where one is (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import nanguard  # noqa: E402
from overhead import TinyGPT  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=10, help="steps per round and variant")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (guard installed first)")
    p.add_argument("--tiny", action="store_true", help="a small model: checks the script, not the GPU")
    args = p.parse_args()
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq, args.batch = 2, 64, 2, 256, 64, 2
        args.rounds, args.steps = 2, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here (use --device cpu --tiny to check the script)")
    return args


class Run:
    """A model, its AdamW and a fixed batch; ``guarded`` installs nanguard first."""

    def __init__(self, args: argparse.Namespace, guarded: bool):
        torch.manual_seed(0)
        self.device = torch.device(args.device)
        self.model = TinyGPT(vocab=args.vocab, seq=args.seq, d_model=args.width, n_heads=args.heads,
                             n_layers=args.layers).to(self.device)
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused)
        self.guard = nanguard.init(self.model, self.optimizer) if guarded else None
        self.forward = torch.compile(self.model) if args.compile else self.model
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=self.device)
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]

    def step(self) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.forward(self.x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), self.y.reshape(-1))
        if self.guard is not None:
            self.guard.check(loss)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed(self, steps: int) -> float:
        """Milliseconds per step over ``steps`` steps."""
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(steps):
                self.step()
            return (time.perf_counter() - start) * 1e3 / steps
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for _ in range(steps):
            self.step()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / steps

    def syncs_per_step(self, steps: int) -> float:
        """Synchronising CUDA calls per step, as CUDA's own debug mode counts them."""
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    self.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught) / steps


def main() -> int:
    args = parse_args()
    plain, guarded = Run(args, guarded=False), Run(args, guarded=True)
    params = sum(p.numel() for p in plain.model.parameters())
    print(f"torch {torch.__version__}, {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f", GPT {args.layers} layers d{args.width}, {params / 1e6:.0f}M parameters, bf16 autocast,"
          f" batch {args.batch}x{args.seq}" + (", compiled" if args.compile else ""))
    for run in (plain, guarded):
        run.timed(3)  # warm-up: allocator, autotuning, compilation
    ratios, times = [], {"plain": [], "nanguard": []}
    for r in range(args.rounds):
        order = (plain, guarded) if r % 2 == 0 else (guarded, plain)
        measured = {run: run.timed(args.steps) for run in order}
        times["plain"].append(measured[plain])
        times["nanguard"].append(measured[guarded])
        ratios.append(measured[guarded] / measured[plain])
    print(f"ms/step: plain {statistics.median(times['plain']):.2f}, nanguard {statistics.median(times['nanguard']):.2f};"
          f" paired ratio {statistics.median(ratios):.3f} (rounds: {min(ratios):.3f}-{max(ratios):.3f})")
    if args.device == "cuda":
        base, with_guard = plain.syncs_per_step(args.steps), guarded.syncs_per_step(args.steps)
        verdict = "as claimed" if round(with_guard - base) == 1 else "NOT as claimed"
        print(f"host synchronisations per step: plain {base:.2f}, nanguard {with_guard:.2f}"
              f" ({with_guard - base:+.2f} per optimizer step: {verdict})")
    guarded.guard.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
