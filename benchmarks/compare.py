"""Two or more checkouts of nanguard side by side in one process: which one costs less per step.

Runs of ``overhead.py`` a few minutes apart differ by 5-10 % on a shared machine, as much as most
changes to the hot path. Here each checkout's ``nanguard`` package is copied under its own name
(``ng_<name>``; the package imports itself relatively) and every checkout guards its own copy of
the same model, timed in the same rounds as the plain loop, in rotating order:

    python benchmarks/compare.py --model hf-gpt2 --repo before=/tmp/old --repo after=.
    python benchmarks/compare.py --repo full=.,mode=full --repo sentinel=.,mode=sentinel   # init settings

Prints, per checkout, the median over rounds of (its step time / plain's) and the quartiles.
``--floor`` adds overhead.py's two floors: ``probe-floor`` (hooks that only probe every module, the full
mode's floor) and ``sentinel-floor`` (the root's hooks, the gradients' norms and one read: the sentinel's).

Variants in one process share one heap, and a variant that keeps memory alive changes what the
allocator does for the others. ``--isolated`` runs each variant in a process of its own instead, one
after the other each round, as a job runs: it prints each one's CPU time per step over plain's (the
thread's own time, which a loaded machine's other work does not count) and the minor page faults a
step makes (glibc mapping fresh pages where memory it could have reused is still held).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import overhead  # noqa: E402  (this folder's benchmark: models, runner, variants)


def load(name: str, checkout: Path, into: Path):
    """Checkout's nanguard package, imported as ``ng_<name>``."""
    package = into / f"ng_{name}"
    shutil.copytree(checkout / "nanguard", package, ignore=shutil.ignore_patterns("__pycache__"))
    return importlib.import_module(package.name)


def variant(name: str, module, settings: dict[str, str]) -> overhead.Variant:
    def attach(model, opt, **workload):
        return module.init(model, opt, **workload, **settings).close
    return overhead.Variant(name, attach)


def _literal(text: str) -> object:
    """A setting's value as init takes it: a number or a boolean where it reads as one (detail_mb=0), else text."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, (int, float, bool)) else text


def _variants(parser: argparse.ArgumentParser, args: argparse.Namespace, folder: str) -> dict[str, overhead.Variant]:
    """plain, each ``--repo`` (its package copied into ``folder``), the floors and ``--variant``s asked for."""
    variants = {"plain": overhead.Variant("plain")}
    for item in args.repo:
        name, _, rest = item.partition("=")
        path, *pairs = rest.split(",")
        settings = {key: _literal(value) for key, value in (pair.partition("=")[::2] for pair in pairs)}
        if not name.isidentifier() or not (Path(path) / "nanguard").is_dir() or "" in settings.values():
            parser.error(f"--repo {item!r}: expected NAME=PATH[,SETTING=VALUE...], PATH a checkout with a"
                         " nanguard/ folder")
        variants[name] = variant(name, load(name, Path(path).resolve(), Path(folder)), settings)
    for name in (["probe-floor", "sentinel-floor"] if args.floor else []) + args.variant:
        variants[name] = overhead.VARIANTS[name]
    return variants


def _print(title: str, ratios: dict[str, list[float]]) -> None:
    print(title)
    for name, values in ratios.items():
        values.sort()
        quarter = len(values) // 4
        print(f"  {name:29s} median {statistics.median(values):.3f}  quartiles {values[quarter]:.3f}-"
              f"{values[-quarter - 1]:.3f}")


def interleaved(spec: overhead.ModelSpec, variants: dict[str, overhead.Variant], rounds: int) -> dict[str, list[float]]:
    """Every variant in this process, in rotating order each round: each round's median step time over plain's."""
    runners = {k: overhead.Runner(spec, v, torch.device("cpu")) for k, v in variants.items()}
    for runner in runners.values():
        runner.timed_steps(spec.warmup)
    ratios: dict[str, list[float]] = {k: [] for k in runners if k != "plain"}
    order = list(runners)
    for _ in range(rounds):
        order = order[1:] + order[:1]
        medians = {k: statistics.median(runners[k].timed_steps(spec.steps)) for k in order}
        for k in ratios:
            ratios[k].append(medians[k] / medians["plain"])
    for runner in runners.values():
        runner.close()
    return ratios


def alone(spec: overhead.ModelSpec, variant_: overhead.Variant, steps: int) -> tuple[float, float]:
    """(minor page faults, CPU seconds of this thread) per step of ``variant_`` after its warm-up."""
    runner = overhead.Runner(spec, variant_, torch.device("cpu"))
    runner.timed_steps(spec.warmup)
    faults, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
    for _ in range(steps):
        runner.step()
    faults, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, time.thread_time() - cpu
    runner.close()
    return faults / steps, cpu / steps


def isolated(args: argparse.Namespace, names: list[str]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each variant in a process of its own each round, as a job runs it: what the allocator does with what a
    variant keeps alive shows there (page faults), where variants sharing one heap hide it from each other.
    Returns each round's (CPU time over plain's) and (page faults a step) by variant."""
    ratios: dict[str, list[float]] = {k: [] for k in names if k != "plain"}
    faults: dict[str, list[float]] = {k: [] for k in names}
    steps = 10 * overhead.MODELS[args.model].steps
    for _ in range(args.rounds):
        cpu = {}
        for name in names:
            command = [sys.executable, __file__, *sys.argv[1:], "--alone", name, "--alone-steps", str(steps)]
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            faults[name].append(json.loads(out.stdout.strip().splitlines()[-1])["faults"])
            cpu[name] = json.loads(out.stdout.strip().splitlines()[-1])["cpu_s"]
        for name in ratios:
            ratios[name].append(cpu[name] / cpu["plain"])
    return ratios, faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=sorted(overhead.MODELS))
    parser.add_argument("--repo", action="append", required=True, metavar="NAME=PATH[,SETTING=VALUE...]",
                        help="a checkout to compare, with init settings of its own (repeat)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--floor", action="store_true",
                        help="time overhead.py's two floors too: probe-floor (hooks that only probe every"
                             " module) and sentinel-floor (the root's hooks, the norms and one read)")
    others = sorted(set(overhead.VARIANTS) - {"plain"})
    parser.add_argument("--variant", action="append", default=[], choices=others, metavar="NAME",
                        help="time one of overhead.py's variants too (repeat): " + ", ".join(others))
    parser.add_argument("--isolated", action="store_true",
                        help="each variant in a process of its own each round: CPU time per step over plain's,"
                             " and minor page faults per step (what a variant keeps alive does to the allocator)")
    parser.add_argument("--alone", help=argparse.SUPPRESS)  # (--isolated's child: one variant, by name)
    parser.add_argument("--alone-steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = overhead.MODELS[args.model]
    with tempfile.TemporaryDirectory() as folder:
        sys.path.insert(0, folder)
        variants = _variants(parser, args, folder)
        if args.alone is not None:
            faults, cpu = alone(spec, variants[args.alone], args.alone_steps)
            print(json.dumps({"faults": faults, "cpu_s": cpu}))
            return
        if args.isolated:
            ratios, faults = isolated(args, list(variants))
            _print(f"{args.model}: {args.rounds} rounds, each variant in a process of its own, CPU time per step"
                   " over plain's", ratios)
            print("  minor page faults per step, median over rounds: " + ", ".join(
                f"{name} {statistics.median(values):.1f}" for name, values in faults.items()))
            return
        ratios = interleaved(spec, variants, args.rounds)
    _print(f"{args.model}: {args.rounds} rounds x {spec.steps} steps, paired ratio to plain", ratios)


if __name__ == "__main__":
    main()
