"""``nanguard demo``: a coordinator, a 2-rank torchrun job that goes non-finite, and its replay.

``main()`` is the whole show on one machine (gloo on CPU), told in five stages that each fit a
screen: it starts ``nanguard coordinator``, launches ``torchrun --nproc-per-node 2 -m nanguard.demo``
(``worker()``: a small transformer in which the last rank's feed-forward layer overflows at a chosen
step), prints what the coordinator's ``/metrics`` saw, replays the incident with ``NANGUARD_REPLAY``
and shows what ``nanguard inspect`` adds to the replay's report. Every command is printed as it can
be pasted into a shell. Every process it starts runs in its own session and is killed, whatever happens,
before it returns.
"""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

_JOB_TIMEOUT_S = 100.0
_READY_TIMEOUT_S = 20.0
_STAGES = 5
_SAID_BY_THE_REPLAY = ("replay", "trace", "operation", "samples", "device")
"""labels of ``nanguard inspect``'s summary that repeat the replay's report"""
_SHOWN_METRICS = ("nanguard_nonfinite_events_total", "nanguard_stops_total", "nanguard_ranks_alive",
                  "nanguard_rank_step", "nanguard_incidents_total", "nanguard_events_dropped_total")


# --------------------------------------------------------------------------- the training job
def _model():
    """A small transformer classifier (torch is imported here: the CLI must not need it)."""
    from torch import nn

    class Model(nn.Module):
        def __init__(self, vocab: int = 64, width: int = 32, depth: int = 2, classes: int = 4):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=64, dropout=0.1,
                                           batch_first=True) for _ in range(depth))
            self.head = nn.Linear(width, classes)

        def forward(self, tokens):
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return self.head(h.mean(dim=1))

    return Model()


def worker(steps: int = 40, bad_step: int = 25) -> int:
    """One rank of the demo job (or a one-process run): train until the bad step stops it."""
    import torch
    from torch import nn

    import nanguard

    dist = torch.distributed
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)
    net = _model()
    model = nn.parallel.DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = nanguard.init(model, optimizer)
    generator = torch.Generator().manual_seed(1 + rank)
    try:
        for step in range(steps):
            tokens = torch.randint(0, 64, (8, 16), generator=generator)
            labels = torch.randint(0, 4, (8,), generator=generator)
            if step == bad_step and rank == world - 1:
                # a weight row gone huge (finite): the feed-forward layer's output overflows to Inf
                with torch.no_grad():
                    net.blocks[1].linear1.weight[3].fill_(3e38)
            loss = nn.functional.cross_entropy(model(tokens), labels)
            guard.check(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"[rank {rank}] finished {steps} steps without a non-finite value", flush=True)
    except nanguard.NonFiniteError as err:
        finite = all(torch.isfinite(p).all() for p in model.parameters())
        # one write per report: the ranks share the terminal
        sys.stdout.write(f"[rank {rank}] stopped at step {err.event.step}: {err.event.where()}\n"
                         f"[rank {rank}] first event came from rank {err.event.rank}; weights finite and"
                         f" untouched by the bad step: {finite}; incident: {err.incident}\n")
        sys.stdout.flush()
    finally:
        guard.close()
    return 0


def run_worker(steps: int = 40, bad_step: int = 25) -> int:
    """``worker()``, then the process group's end, once the model is freed (nanguard/_dist.py)."""
    from ._dist import destroy_process_group

    code = worker(steps, bad_step)
    destroy_process_group()
    return code


# --------------------------------------------------------------------------- the show
def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # pgid == pid: start_new_session made it a group leader
    except ProcessLookupError:
        pass


class _Processes:
    """Children in their own sessions, each killed with its whole group when the show ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, env=env, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, grace_s: float = 5.0) -> None:
        """SIGTERM to the process's group, SIGKILL to whatever of it is left after ``grace_s``."""
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(proc, signal.SIGKILL)
        proc.wait()

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


class _Lines:
    """A child's output lines, read by a thread, so that waiting on them has a deadline."""

    def __init__(self, proc: subprocess.Popen):
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True,
                                        name="nanguard-demo-output")
        self._thread.start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def next(self, deadline: float) -> str | None:
        """The next line, or None at the end of the output or at the deadline."""
        try:
            line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if line is not None:
            self.seen.append(line)
        return line


def _ready(lines: _Lines, timeout_s: float) -> dict[str, str]:
    """The coordinator's readiness line, as key=value pairs; raises if it does not come."""
    deadline = time.monotonic() + timeout_s
    while (line := lines.next(deadline)) is not None:
        if line.startswith("nanguard coordinator ready"):
            return dict(part.split("=", 1) for part in line.split() if "=" in part)
    raise RuntimeError(f"the coordinator did not report ready within {timeout_s:.0f}s; its output:\n"
                       + "".join(lines.seen))


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def _metrics_after_stop(url: str, wait_s: float = 10.0) -> list[str]:
    """The demo's metric lines, once the stop has reached the coordinator."""
    deadline = time.monotonic() + wait_s
    while True:
        lines = [line for line in _scrape(url).splitlines()
                 if line.startswith(_SHOWN_METRICS) and not line.startswith("#")]
        if any(line.startswith("nanguard_stops_total{") for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def _torchrun(steps: int, bad_step: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "0", "-m", "nanguard.demo", "--worker", "--steps", str(steps),
            "--bad-step", str(bad_step)]


def _command(argv: list[str], env: dict[str, str]) -> str:
    """``argv`` as a line to paste into a shell, with the nanguard variables it runs with."""
    variables = [f"{name}={shlex.quote(value)}" for name, value in sorted(env.items()) if name.startswith("NANGUARD_")]
    return " ".join([*variables, shlex.join(argv)])


def _stage(number: int, title: str, *sentences: str) -> None:
    print(f"\n== {number}/{_STAGES} {title}", flush=True)
    for sentence in sentences:
        print(f"  {sentence}", flush=True)


def _run_job(procs: _Processes, argv: list[str], env: dict[str, str], leave_out: tuple[str, ...] = ()) -> str:
    """Run a job to its end, showing its output but lines that start with ``leave_out``; its output."""
    print(f"  $ {_command(argv, env)}", flush=True)
    job = procs.start(argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = _Lines(job)
    deadline = time.monotonic() + _JOB_TIMEOUT_S
    while (line := lines.next(deadline)) is not None:
        if line.startswith(("[rank", "nanguard", "  ")) and not line.strip().startswith(leave_out):
            print("  " + line.rstrip(), flush=True)
    if time.monotonic() >= deadline:
        procs.stop(job, grace_s=1.0)
        raise RuntimeError(f"{argv[-6:]} did not finish within {_JOB_TIMEOUT_S:.0f}s (stopped):\n"
                           + "".join(lines.seen[-40:]))
    job.wait()
    if job.returncode != 0:
        raise RuntimeError(f"the job failed (exit code {job.returncode}):\n" + "".join(lines.seen[-40:]))
    return "".join(lines.seen)


def _inspect_lines(summary: str) -> list[str]:
    """``nanguard inspect``'s summary without what the replay stage has shown already."""
    shown, keep = [], True
    for line in summary.splitlines():
        if not line.startswith(" "):
            keep = line.split(None, 1)[0] not in _SAID_BY_THE_REPLAY
        if keep:
            shown.append("  " + line)
    return shown


def _coordinator(procs: _Processes, folder: Path, env: dict[str, str]) -> dict[str, str]:
    argv = [sys.executable, "-m", "nanguard", "coordinator", "--bind", "tcp://127.0.0.1:0",
            "--metrics-port", "0", "--log", str(folder / "coordinator.jsonl")]
    _stage(1, "the coordinator",
           "A small process beside the job: every rank reports to it, and it counts what they report for Prometheus.",
           f"$ {_command(argv, {})}")
    coordinator = procs.start(argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = _ready(_Lines(coordinator), _READY_TIMEOUT_S)
    print(f"  It listens for the ranks at {ready['bind']}; its metrics are at {ready['metrics']}", flush=True)
    return ready


def _show(procs: _Processes, folder: Path, env: dict[str, str], steps: int, bad_step: int) -> None:
    from .incident import read_incident
    from .incident.inspection import summary

    incidents = folder / "incidents"
    ready = _coordinator(procs, folder, env)
    _stage(2, "the training job",
           f"Two ranks train a small transformer on the CPU. At step {bad_step}, rank 1 sets one of its weights to "
           "3e38,", "so its feed-forward layer overflows to Inf. nanguard stops both ranks before that step's update.")
    output = _run_job(procs, _torchrun(steps, bad_step), {**env, "NANGUARD_COORDINATOR": ready["bind"]})
    found = sorted(p for p in incidents.iterdir() if p.is_dir()) if incidents.is_dir() else []
    if not found or "stopped at step" not in output:
        raise RuntimeError("the job did not stop with an incident:\n" + output[-3000:])
    incident = str(found[-1])
    _stage(3, "what the coordinator counted",
           "What Prometheus would scrape from it (an alert rule on the first line would page someone):")
    for line in _metrics_after_stop(ready["metrics"]):
        print("  " + line, flush=True)
    _stage(4, "the replay",
           "The same command, with NANGUARD_REPLAY naming the incident folder: it loads the saved state and "
           f"runs step {bad_step}", "again, checking every layer, and says whether the fault comes back (a "
           "bug in the code or data) or not (the hardware).")
    _run_job(procs, _torchrun(steps, bad_step), {**env, "NANGUARD_REPLAY": incident},
             leave_out=("samples:", "note:", "rank 0 backward", "rank 1 backward"))
    _stage(5, "the incident folder",
           f"What nanguard inspect {incident} says besides the replay above: the first event, and",
           "the loss and gradient norm of the steps before it, as the flight recorder kept them (--json: all of it).")
    print("\n".join(_inspect_lines(summary(read_incident(incident)))), flush=True)


def main(steps: int = 40, bad_step: int = 25, workdir: str = "nanguard-demo") -> int:
    from .incident import IncidentError

    started = time.monotonic()
    folder = Path(workdir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANGUARD_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NANGUARD_DIR=str(folder / "incidents"))
    procs = _Processes()
    print(f"nanguard demo: a 2-rank training job goes non-finite at step {bad_step}; what nanguard does about it,"
          f" in {_STAGES} stages.", flush=True)
    try:
        _show(procs, folder, env, steps, bad_step)
    except (RuntimeError, OSError, IncidentError, KeyError) as exc:
        print(f"nanguard demo failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        procs.close()
    print(f"\ndemo finished in {time.monotonic() - started:.0f}s; everything it wrote is under {folder}")
    return 0


def _worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanguard.demo")
    parser.add_argument("--worker", action="store_true", help="run one rank of the training job")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bad-step", type=int, default=25)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args.steps, args.bad_step)
    return main(args.steps, args.bad_step)


if __name__ == "__main__":
    sys.exit(_worker_main())
