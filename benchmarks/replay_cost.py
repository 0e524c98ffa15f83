"""What a replay costs, with and without the operation check (the dispatch mode).

Makes one incident per model (two poisoned samples in a batch), then replays it in this process
``--rounds`` times with ``replay_ops`` on and off, interleaved, and prints the median wall time of
the whole replay (read and verify the incident, load, the step, the sample search, the report) and
of its sample search alone. The difference of the totals is what the dispatch mode costs.

    python benchmarks/replay_cost.py                 # mlp and gpt, 5 rounds each
    python benchmarks/replay_cost.py --models mlp --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanguard  # noqa: E402
from nanguard.incident import read_incident  # noqa: E402
from nanguard.replay import samples  # noqa: E402
from overhead import TinyGPT  # noqa: E402


def mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    x[[5, 40], 0] = float("nan")
    return model, x, y


def gpt() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = TinyGPT()
    x, y = torch.randint(0, 1024, (8, 128)), torch.randint(0, 1024, (8 * 128,))
    model.tok.weight.data[x[3, 7]] = float("nan")  # one token's embedding is bad: sample 3
    return model, x, y


MODELS = {"mlp": mlp, "gpt": gpt}


def script(build) -> None:
    """The user's script: one step of the model on its batch (the step goes non-finite)."""
    torch.manual_seed(0)
    model, x, y = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.init(model, optimizer):
        out = model(x)
        nn.functional.cross_entropy(out.reshape(len(y), -1), y).backward()
        optimizer.step()


def replay_once(build, incident: str, ops: bool) -> tuple[float, float, int]:
    """(whole replay s, sample search s, operations checked)."""
    searched = []
    real = samples.search

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            searched.append(time.perf_counter() - start)

    samples.search = timed
    os.environ.update(NANGUARD_REPLAY=incident, NANGUARD_REPLAY_OPS="1" if ops else "0")
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            script(build)
    finally:
        samples.search = real
        del os.environ["NANGUARD_REPLAY"], os.environ["NANGUARD_REPLAY_OPS"]
    total = time.perf_counter() - start
    report = read_incident(incident).replay_report()
    checked = (report["operations"]["0"] or {}).get("operations_checked", 0)
    return total, searched[0], checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mlp", "gpt"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds, median seconds")
    print(f"{'model':<6} {'replay, ops off':>16} {'replay, ops on':>15} {'ops cost':>9} {'search':>7} {'ops checked':>12}")
    for name in args.models:
        with tempfile.TemporaryDirectory() as root:
            os.environ["NANGUARD_DIR"] = root
            with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(nanguard.NonFiniteError):
                script(MODELS[name])
            (incident,) = [str(p) for p in Path(root).iterdir()]
            times: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
            for _ in range(args.rounds):
                for ops in (False, True):
                    times[ops].append(replay_once(MODELS[name], incident, ops))
        off, on = (statistics.median(t[0] for t in times[k]) for k in (False, True))
        search = statistics.median(t[1] for t in times[True])
        print(f"{name:<6} {off:>16.3f} {on:>15.3f} {on - off:>9.3f} {search:>7.3f} {times[True][0][2]:>12}")


if __name__ == "__main__":
    main()
