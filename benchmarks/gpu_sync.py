"""On a GPU: nanguard's cost on a >= 100M-parameter bf16 GPT in both modes, the host synchronisations
it adds, and one bad step caught and explained on the device.

The claims to check (issue 29): a guarded training step synchronises with the host exactly once more
than a plain one per optimizer step (the read of the step's probe vector), whatever the number of
modules and micro-batches, in either mode; the sentinel costs at most 1 % of a step. CUDA counts
synchronising calls itself when ``torch.cuda.set_sync_debug_mode("warn")`` is on: each one warns,
and the warnings of a step are counted. Times are CUDA-event medians of rounds in rotating order,
plain and each mode in one process, as paired ratios (the same method as overhead.py).

Then the CUDA paths of a bad step: a NaN made in one layer's output, on every call of one step (the
microscope's re-run on the device, its CUDA random states restored, must make it again: reproduced,
named at its producer) and on its first call only (clean when re-run: a transient, blamed on no
module); the weights untouched by either stop, the device named with its UUID.

    python benchmarks/gpu_sync.py                    # GPT-2 small shape (124M), bf16 autocast, AdamW
    python benchmarks/gpu_sync.py --accum 4          # 4 micro-batches per optimizer step
    python benchmarks/gpu_sync.py --layers 24 --width 1024   # GPT-2 medium shape (350M)
    python benchmarks/gpu_sync.py --device cpu --tiny        # the code path on a CPU, no counts

Exits 1 when a claim does not hold (a sync count, a bad step not stopped or misnamed), 0 otherwise;
the cost is printed, not judged. CI has no GPU: tests/unit/test_gpu_sync_script.py runs the tiny
form on the CPU, and benchmarks/gpu_check.sh's dry run, so that both work the first time a GPU is lent.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import nanguard  # noqa: E402
from overhead import TinyGPT  # noqa: E402


MODES = ("sentinel", "full")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--modes", default=",".join(MODES), help="nanguard modes timed beside plain (comma-separated)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per round and variant")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (guard installed first)")
    p.add_argument("--tiny", action="store_true", help="a small model: checks the script, not the GPU")
    p.add_argument("--no-fault", action="store_true", help="time and count only: no bad step")
    args = p.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes takes {', '.join(MODES)} (comma-separated), not {args.modes}")
    if args.accum < 1 or args.rounds < 1 or args.steps < 1:
        p.error("--accum, --rounds and --steps must be at least 1")
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq, args.batch = 2, 64, 2, 256, 64, 2
        args.rounds, args.steps = 2, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here (use --device cpu --tiny to check the script)")
    return args


class Run:
    """A model, its AdamW and a fixed batch; ``mode``: nanguard installed first in that mode (None: plain)."""

    def __init__(self, args: argparse.Namespace, mode: str | None):
        torch.manual_seed(0)
        self.name = mode or "plain"
        self.device = torch.device(args.device)
        self.model = TinyGPT(vocab=args.vocab, seq=args.seq, d_model=args.width, n_heads=args.heads,
                             n_layers=args.layers).to(self.device)
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused)
        self.guard = nanguard.init(self.model, self.optimizer, mode=mode) if mode else None
        self.forward = torch.compile(self.model) if args.compile else self.model
        self.accum = args.accum
        # each micro-batch its own tokens, as a loader feeds them
        tokens = torch.randint(0, args.vocab, (args.accum, args.batch, args.seq + 1), device=self.device)
        self.batches = [(t[:, :-1], t[:, 1:]) for t in tokens]

    def step(self) -> None:
        for x, y in self.batches:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                logits = self.forward(x)
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            if self.guard is not None:
                self.guard.check(loss)
            (loss / self.accum).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed(self, steps: int) -> float:
        """Milliseconds per optimizer step over ``steps`` steps."""
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
        """Synchronising CUDA calls per optimizer step, as CUDA's own debug mode counts them."""
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

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()


def timing(args: argparse.Namespace) -> bool:
    """Each mode's paired ratio to plain and, on a GPU, its host syncs per optimizer step; False
    where a count is not plain's plus one."""
    runs = [Run(args, None)] + [Run(args, mode) for mode in args.modes]
    plain = runs[0]
    params = sum(p.numel() for p in plain.model.parameters())
    print(f"torch {torch.__version__}, {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f", GPT {args.layers} layers d{args.width}, {params / 1e6:.0f}M parameters, bf16 autocast,"
          f" batch {args.batch}x{args.seq}, {args.accum} micro-batch(es) a step" + (", compiled" if args.compile else ""))
    for run in runs:
        run.timed(3)  # warm-up: allocator, autotuning, compilation
    times: dict[str, list[float]] = {run.name: [] for run in runs}
    for r in range(args.rounds):
        for run in runs[r % len(runs):] + runs[:r % len(runs)]:
            times[run.name].append(run.timed(args.steps))
    print(f"ms/step: plain {statistics.median(times['plain']):.2f}")
    for run in runs[1:]:
        ratios = [a / b for a, b in zip(times[run.name], times["plain"])]
        print(f"  {run.name:9s} {statistics.median(times[run.name]):.2f} ms, paired ratio {statistics.median(ratios):.3f}"
              f" (rounds: {min(ratios):.3f}-{max(ratios):.3f})")
    held = True
    if args.device == "cuda":
        base = plain.syncs_per_step(args.steps)
        print(f"host synchronisations per optimizer step: plain {base:.2f}")
        for run in runs[1:]:
            count = run.syncs_per_step(args.steps)
            ok = abs(count - base - 1) < 0.01  # exactly one more, on every step
            held = held and ok
            print(f"  {run.name:9s} {count:.2f} ({count - base:+.2f}: {'as claimed' if ok else 'NOT as claimed'})")
    for run in runs:
        run.close()
    return held


class Faulty(nn.Module):
    """A Linear whose output gets a NaN while ``armed``: on every call ("every") or on the first
    call since it was armed only ("first")."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        self.armed: str | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        if self.armed == "every" or (self.armed == "first" and self.calls == 0):
            out = out.clone()
            out.view(-1)[7] = float("nan")
        self.calls += self.armed is not None
        return out


def bad_step(args: argparse.Namespace, mode: str, transient: bool) -> bool:
    """One step whose last block's second MLP Linear makes a NaN (on every call of that step, or on
    its first call only: ``transient``): stopped before the update with the weights untouched, an
    incident written, named as claimed (a transient at no module in the sentinel mode, whose probes
    did not see it born; at its producer in the full mode, whose did), on the device with its UUID."""
    torch.manual_seed(0)
    run = Run(args, None)
    block = len(run.model.blocks) - 1
    faulty = run.model.blocks[block].mlp[2] = Faulty(run.model.blocks[block].mlp[2])
    with tempfile.TemporaryDirectory() as incidents:
        run.guard = nanguard.init(run.model, run.optimizer, mode=mode, dir=incidents)
        run.timed(2)
        before = [p.detach().clone() for p in run.model.parameters()]
        faulty.armed = "first" if transient else "every"
        try:
            run.step()
            stop = None
        except nanguard.NonFiniteError as error:
            stop = error
        finally:
            faulty.armed = None
        untouched = all(torch.equal(a, p.detach()) for a, p in zip(before, run.model.parameters()))
        written = stop is not None and stop.incident is not None and Path(stop.incident, "manifest.json").is_file()
        run.close()
    case = f"bad step, {mode}, {'first call only' if transient else 'every call'}"
    if stop is None:
        print(f"{case}: NOT stopped")
        return False
    event = stop.event
    producer = f"blocks.{block}.mlp.2"
    named = event.layer == ("" if transient and mode == "sentinel" else producer)
    expected = ("transient", False) if transient else ("reproducible", True)
    on_device = args.device != "cuda" or "GPU-" in event.device
    ok = untouched and written and named and (event.verdict, event.reproduced) == expected and on_device
    print(f"{case}: {event.kind} at {event.layer or '(no module)'}, micro-batch {event.micro_batch},"
          f" reproduced {event.reproduced}, verdict {event.verdict}, device {event.device!r}, weights untouched"
          f" {untouched}, incident written {written}: {'as claimed' if ok else 'NOT as claimed'}")
    return ok


def main() -> int:
    args = parse_args()
    held = timing(args)
    if not args.no_fault:
        for mode in args.modes:
            for transient in (False, True):
                held = bad_step(args, mode, transient) and held
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
