"""Launch real ``torchrun`` jobs (gloo on CPU) for the integration tests.

Every job runs in its own session (process group), with its output in a file, under a
deadline; on timeout or test teardown the whole group is killed, so no worker survives a test.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
DEFAULT_TIMEOUT = 150  # seconds for one job; tests carry a larger pytest timeout


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(condition, what: str, timeout_s: float = 30.0, every_s: float = 0.1):
    """Poll ``condition`` until it returns something true (returned); fail naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)
    return value


def base_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # (but the guard mode: a test of one mode, or a run of the suite in the other, sets it for its workers too)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANGUARD_") or k == "NANGUARD_MODE"}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        NANGUARD_DIR=str(tmp_path / "incidents"),
    )
    env.update(extra)
    return env


@dataclass
class Job:
    returncodes: list[int]
    output: str
    """stdout and stderr of every launched agent, combined"""
    out_dir: Path

    def results(self) -> dict[int, dict]:
        """The per-rank JSON files the workers wrote, by rank."""
        found = {}
        for path in sorted(self.out_dir.glob("rank*.json")):
            data = json.loads(path.read_text())
            found[data["rank"]] = data
        return found

    def ok(self, world: int) -> dict[int, dict]:
        """Assert a clean exit and one result per rank; return the results."""
        tail = self.output[-6000:]
        assert self.returncodes == [0] * len(self.returncodes), f"exit codes {self.returncodes}:\n{tail}"
        results = self.results()
        assert sorted(results) == list(range(world)), f"results for ranks {sorted(results)}:\n{tail}"
        for rank, data in results.items():
            assert data["exception"] is None, f"rank {rank} failed:\n{data['exception']}"
            # nanguard.destroy_process_group() ended (or parked) gloo's threads before Python finalized
            assert data["exit_safe"] is True, f"rank {rank}: gloo's threads still busy at exit:\n{tail}"
        return results


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Running:
    """A job started by ``Launcher.spawn``: ``wait(timeout)`` gives its Job."""

    launcher: Launcher
    procs: list[subprocess.Popen]
    logs: list[Path]
    out_dir: Path

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> Job:
        in_time = self.launcher._finish(self.procs, timeout)
        output = "".join(log.read_text(errors="replace") for log in self.logs)
        if not in_time:
            pytest.fail(f"torchrun job did not finish within {timeout}s (killed):\n{output[-6000:]}")
        return Job([p.returncode for p in self.procs], output, self.out_dir)


class Launcher:
    """Starts torchrun agents in fresh sessions and guarantees that they are all gone after."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self._procs: list[subprocess.Popen] = []
        self._count = 0

    def _start(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.tmp_path, start_new_session=True)
        self._procs.append(proc)
        return proc

    def _kill(self, proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # pgid == pid: start_new_session made it a group leader
        except ProcessLookupError:
            pass

    def _finish(self, procs: list[subprocess.Popen], timeout: float) -> bool:
        """Wait for every proc under one deadline; kill every group. True if all ended in time."""
        deadline = time.monotonic() + timeout
        in_time = True
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                in_time = False
                break
        for proc in procs:
            self._reap(proc, graceful=not in_time)
        return in_time

    def _reap(self, proc: subprocess.Popen, graceful: bool) -> None:
        if graceful and proc.poll() is None:
            self._kill(proc, signal.SIGTERM)  # lets torchrun take its workers down
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._kill(proc, signal.SIGKILL)  # stragglers of the group, if any
        proc.wait()
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _job(self, commands: list[tuple[list[str], dict[str, str]]], out_dir: Path,
             timeout: float) -> Job:
        return self._spawn(commands, out_dir).wait(timeout)

    def _spawn(self, commands: list[tuple[list[str], dict[str, str]]], out_dir: Path) -> Running:
        self._count += 1
        logs = [self.tmp_path / f"job{self._count}-agent{i}.log" for i in range(len(commands))]
        procs = [self._start(argv, env, log) for (argv, env), log in zip(commands, logs)]
        return Running(self, procs, logs, out_dir)

    def standalone(self, script: str | Path, *args: str, nproc: int = 2,
                   timeout: float = DEFAULT_TIMEOUT, out_dir: Path | None = None,
                   env: dict[str, str] | None = None) -> Job:
        """``torchrun --standalone --nproc-per-node N script out_dir args...`` (it picks its port).

        ``script`` is a file of tests/integration/workers/; it gets ``out_dir`` (a fresh folder
        under tmp_path unless given) as its first argument and writes rank{RANK}.json there;
        ``env`` adds environment variables.
        """
        return self.spawn(script, *args, nproc=nproc, out_dir=out_dir, env=env).wait(timeout)

    def spawn(self, script: str | Path, *args: str, nproc: int = 2, out_dir: Path | None = None,
              env: dict[str, str] | None = None, max_restarts: int = 0, run_id: bool = True) -> Running:
        """``standalone`` without waiting for the job; ``max_restarts``: torchrun's; ``run_id=False``:
        torchrun's default rendezvous (static, on a free port) and run id, ``none`` (where --standalone
        picks a new one per launch)."""
        out_dir = out_dir or self.tmp_path / f"out{self._count + 1}"
        rendezvous = ["--standalone"] if run_id else [
            "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        argv = [sys.executable, "-m", "torch.distributed.run", *rendezvous,
                "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                str(WORKERS / script), str(out_dir), *args]
        return self._spawn([(argv, base_env(self.tmp_path, **(env or {})))], out_dir)

    def example(self, path: str | Path, *args: str, nproc: int = 2,
                timeout: float = DEFAULT_TIMEOUT) -> Job:
        """Run a script of the repository (no out_dir argument) under torchrun --standalone;
        ``nproc=0``: with plain python, one process."""
        return self.spawn_example(path, *args, nproc=nproc).wait(timeout)

    def spawn_example(self, path: str | Path, *args: str, nproc: int = 2) -> Running:
        """``example`` without waiting for the job."""
        launch = [sys.executable] if nproc == 0 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", "0"]
        argv = [*launch, str(REPO / path), *args]
        return self._spawn([(argv, base_env(self.tmp_path))], self.tmp_path)

    def multi_node(self, script: str, *args: str, nnodes: int = 2, nproc: int = 1,
                   timeout: float = DEFAULT_TIMEOUT, env: dict[str, str] | None = None) -> Job:
        """``nnodes`` torchrun agents (``nproc`` processes each) meeting through c10d rendezvous on
        localhost, as on ``nnodes`` machines; agent i runs with ``NG_TEST_NODE=i``."""
        out_dir = self.tmp_path / f"out{self._count + 1}"
        endpoint = f"127.0.0.1:{free_port()}"
        commands = []
        for node in range(nnodes):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                    "--nproc-per-node", str(nproc), "--node-rank", str(node), "--max-restarts", "0",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", f"nanguard-test-{os.getpid()}-{self._count}",
                    str(WORKERS / script), str(out_dir), *args]
            commands.append((argv, base_env(self.tmp_path, NG_TEST_NODE=str(node), **(env or {}))))
        return self._job(commands, out_dir, timeout)

    def close(self) -> None:
        for proc in self._procs:
            self._reap(proc, graceful=True)


@pytest.fixture
def torchrun(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        yield launcher
    finally:
        launcher.close()


class CoordinatorProcess:
    """A real ``python -m nanguard coordinator`` on a fixed loopback port (so that it can be
    killed and started again where the ranks look for it), in its own session."""

    def __init__(self, tmp_path: Path, port: int | None = None):
        self.tmp_path = tmp_path
        self.port = port or free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.metrics_url: str | None = None
        self._starts = 0

    def start(self, *extra: str, env: dict[str, str] | None = None, timeout: float = 30) -> None:
        self._starts += 1
        self.log = self.tmp_path / f"coordinator{self._starts}.jsonl"
        argv = [sys.executable, "-m", "nanguard", "coordinator", "--bind", self.address,
                "--metrics-port", "0", "--log", str(self.log), *extra]
        stderr = open(self.tmp_path / f"coordinator{self._starts}.err", "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     env=self.env(**(env or {})), cwd=self.tmp_path,
                                     start_new_session=True)
        stderr.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline() if ready else ""
            if line.startswith("nanguard coordinator ready"):
                fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
                self.metrics_url = fields["metrics"]
                return
            if not line and self.proc.poll() is not None:
                break
        self.kill()
        pytest.fail(f"the coordinator did not report ready within {timeout}s:\n"
                    + (self.tmp_path / f"coordinator{self._starts}.err").read_text(errors="replace"))

    def kill(self, sig: int = signal.SIGKILL) -> int | None:
        if self.proc is None:
            return None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        self.proc.stdout.close()
        self.proc = None
        return code

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process of the test (no NANGUARD_* of the caller's)."""
        return base_env(self.tmp_path, **extra)

    def cli(self, *args: str, timeout: float = 30, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """``python -m nanguard ARGS`` (an operator's command), with its output captured."""
        return subprocess.run([sys.executable, "-m", "nanguard", *args], env=self.env(**(env or {})),
                              capture_output=True, text=True, timeout=timeout, cwd=self.tmp_path)

    def samples(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics: {(name, sorted label pairs): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            text = response.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples().get((name, tuple(sorted(labels.items()))))

    def wait_for(self, name: str, at_least: float = 1, timeout: float = 15, **labels: str) -> float:
        """Poll /metrics until ``name{labels}`` reaches ``at_least``; fail with what it was."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.value(name, **labels)
            if value is not None and value >= at_least:
                return value
            time.sleep(0.2)
        pytest.fail(f"{name}{labels} was {value} after {timeout}s, expected >= {at_least}")


@pytest.fixture
def coordinator(tmp_path):
    process = CoordinatorProcess(tmp_path)
    try:
        yield process
    finally:
        process.kill()
