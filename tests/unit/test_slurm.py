"""deploy/slurm/nanguard.sbatch run outside Slurm: stub ``scontrol``, ``srun``, ``torchrun`` and
``nanguard`` executables on PATH record their arguments and environment; one test runs the real
coordinator behind the ``nanguard`` stub and asks it for its status with the ranks' token."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "slurm" / "nanguard.sbatch"
NODES = ["gpu-017", "gpu-018"]
SEP = "\x1f"

RECORD = r"""
record() {  # name pid node, then the NANGUARD_* environment, then the arguments
    local IFS=$'\x1f'
    local name=$1 pid=$2 node=$3
    shift 3
    local environ="${NANGUARD_COORDINATOR:-}$IFS${NANGUARD_TOKEN:-}$IFS${NANGUARD_DIR:-}$IFS"
    environ+="${NANGUARD_OPERATOR_TOKEN:-}$IFS${NANGUARD_CURVE_SECRET_KEY:-}$IFS${NANGUARD_CURVE_PUBLIC_KEY:-}"
    printf '%s\n' "$name$IFS$pid$IFS$node$IFS$environ$IFS$*" >>"$STUB_LOG"
}
"""

STUBS = {
    "scontrol": r"""
record scontrol "$$" "${SLURMD_NODENAME:-}" "$@"
[[ $1 == show && $2 == hostnames ]] || exit 1
printf '%s\n' $STUB_NODES
""",
    # single-task steps exec the command (so a signal to srun reaches it, as srun forwards it);
    # others run it once per node, as one task a node
    "srun": r"""
options=()
while [[ $1 == -* ]]; do options+=("$1"); shift; done
record srun "$$" "${SLURMD_NODENAME:-}" "${options[@]}" -- "$@"
for option in "${options[@]}"; do
    if [[ $option == --nodelist=* ]]; then
        SLURMD_NODENAME=${option#--nodelist=} SLURM_NODEID=0 exec "$@"
    fi
done
status=0
index=0
for node in $STUB_NODES; do
    SLURMD_NODENAME=$node SLURM_NODEID=$index "$@" || status=$?
    index=$((index + 1))
done
exit "$status"
""",
    "nanguard": r"""
if [[ $1 == keys ]]; then
    exec "$REAL_NANGUARD" "$@"
fi
record nanguard "$$" "${SLURMD_NODENAME:-}" "$@"
case $STUB_COORDINATOR in
    real) exec "$REAL_NANGUARD" "$@" ;;
    ready) echo "nanguard coordinator ready bind=stub" ;;
    never-ready) echo "nanguard coordinator: starting (and never getting there)" ;;
    exits) echo "nanguard coordinator: cannot bind: Address already in use" >&2; exit 1 ;;
esac
trap 'record nanguard-stopped "$$"; exit 0' TERM
while :; do sleep 0.05; done
""",
    "torchrun": r"""
record torchrun "$$" "${SLURMD_NODENAME:-}" "$@"
if [[ $STUB_COORDINATOR == real && $SLURM_NODEID == 0 ]]; then
    # this rank's environment against the running coordinator: its token must be the right one
    address="tcp://127.0.0.1:${NANGUARD_COORDINATOR##*:}"
    "$REAL_NANGUARD" status --json --timeout-s 10 --coordinator "$address" \
        >"$STUB_DIR/status.json" 2>"$STUB_DIR/status.err"
    echo $? >"$STUB_DIR/status.rc"
    # and what a rank's environment cannot do: stop the job
    "$REAL_NANGUARD" stop --reason rogue --timeout-s 10 --coordinator "$address" 2>"$STUB_DIR/stop.err"
    echo $? >"$STUB_DIR/stop.rc"
fi
if [[ -n ${STUB_TORCHRUN_SLEEP:-} ]]; then
    sleep "$STUB_TORCHRUN_SLEEP"
fi
exit "${STUB_TORCHRUN_RC:-0}"
""",
}


class Call:
    def __init__(self, line: str):
        fields = line.split(SEP)
        self.name, self.pid, self.node = fields[0], int(fields[1]), fields[2]
        self.coordinator, self.token, self.dir = fields[3:6]
        self.operator_token, self.curve_secret_key, self.curve_public_key = fields[6:9]
        self.args = fields[9:] if fields[9:] != [""] else []


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, log: Path):
        self.returncode, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr
        self.calls = [Call(line) for line in log.read_text().splitlines()] if log.exists() else []

    def of(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]


@pytest.fixture
def sbatch(tmp_path):
    """``sbatch(*args, **env)``: run the script under stubs with Slurm's variables; a Run."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in STUBS.items():
        path = stubs / name
        path.write_text("#!/bin/bash\n" + RECORD + body)
        path.chmod(0o755)
    log = tmp_path / "calls"
    real = Path(sys.executable).parent / "nanguard"
    started: list[subprocess.Popen] = []

    def run(*args: str, timeout: float = 60, signal_after: tuple[str, int] | None = None,
            **extra: str | None) -> Run:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM", "NANGUARD_", "GPUS", "RDZV"))}
        env.update(
            PATH=f"{stubs}{os.pathsep}{env['PATH']}", STUB_LOG=str(log), STUB_DIR=str(tmp_path),
            STUB_NODES=" ".join(NODES), STUB_COORDINATOR="ready", REAL_NANGUARD=str(real),
            SLURM_JOB_ID="4242", SLURM_JOB_NAME="nanguard-train", SLURM_JOB_NODELIST="gpu-[017-018]",
            SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2", SLURM_NODELIST="gpu-[017-018]",
            SLURM_SUBMIT_DIR=str(tmp_path), SLURMD_NODENAME=NODES[0], SLURM_GPUS_ON_NODE="4",
            SLURM_CPUS_PER_TASK="8", NANGUARD_DIR=str(tmp_path / "incidents"),
        )
        env.update(extra)
        env = {k: v for k, v in env.items() if v is not None}
        # its own session, so that no stub outlives the test
        proc = subprocess.Popen(["bash", str(SCRIPT), *args], env=env, cwd=tmp_path, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        started.append(proc)
        if signal_after is not None:
            name, sig = signal_after
            deadline = time.monotonic() + timeout
            while not (log.exists() and f"\n{name}{SEP}" in "\n" + log.read_text()):
                assert time.monotonic() < deadline and proc.poll() is None, f"{name} never ran"
                time.sleep(0.05)
            proc.send_signal(sig)
        proc.wait(timeout=timeout)  # a script that outlives its deadline fails the test here
        try:  # as Slurm does when a batch script ends: whatever it left running goes
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate(timeout=timeout)
        return Run(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), log)

    yield run
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_gone(pid: int, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def pairs(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}


def test_shellcheck(tool):
    shellcheck = tool("shellcheck")
    result = subprocess.run([shellcheck, "--shell=bash", str(SCRIPT)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(120)
def test_coordinator_on_the_head_then_torchrun_on_every_node(sbatch, tmp_path):
    port = free_port()
    run = sbatch("train.py", "--lr", "3e-4", STUB_COORDINATOR="real", NANGUARD_PORT=str(port),
                 NANGUARD_METRICS_PORT="0", NANGUARD_METRICS_HOST="127.0.0.1")
    assert run.returncode == 0, run.stderr
    incidents = tmp_path / "incidents"

    (scontrol,) = run.of("scontrol")
    assert scontrol.args == ["show", "hostnames", "gpu-[017-018]"]

    # one coordinator, on the first node, as one overlapping task there
    (coordinator,) = run.of("nanguard")
    assert coordinator.node == "gpu-017"
    assert coordinator.args == ["coordinator", "--bind", f"tcp://0.0.0.0:{port}", "--metrics-host", "127.0.0.1",
                                "--metrics-port", "0", "--log", str(incidents / "coordinator-4242.jsonl")]
    step = [c for c in run.of("srun") if "nanguard" in c.args][0]
    options = step.args[:step.args.index("--")]
    assert "--overlap" in options and "--ntasks=1" in options and "--nodelist=gpu-017" in options

    # torchrun once per node, after the coordinator was up
    torchruns = run.of("torchrun")
    assert [t.node for t in torchruns] == NODES
    assert run.calls.index(coordinator) < run.calls.index(torchruns[0])
    for t in torchruns:
        assert t.args[-3:] == ["train.py", "--lr", "3e-4"]
        assert pairs(t.args[:-3]) == {"--nnodes": "2", "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                                      "--rdzv-endpoint": "gpu-017:29500", "--rdzv-id": "4242"}
    (training,) = [c for c in run.of("srun") if "torchrun" in c.args]
    options = training.args[:training.args.index("--")]
    assert {"--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=8"} <= set(options)

    # the ranks' environment: the head's coordinator, and the coordinator's token, which it accepts
    assert {t.coordinator for t in torchruns} == {f"tcp://gpu-017:{port}"}
    assert {t.token for t in torchruns} == {coordinator.token}
    assert re.fullmatch(r"[0-9a-f]{64}", coordinator.token)
    assert {t.dir for t in torchruns} == {coordinator.dir} == {str(incidents)}
    assert (tmp_path / "status.rc").read_text().strip() == "0", (tmp_path / "status.err").read_text()
    assert "ranks" in json.loads((tmp_path / "status.json").read_text())
    assert not [c for c in run.calls if coordinator.token in SEP.join(c.args)], "the token on a command line"

    # the operators' secret: the coordinator's alone, and a file only this user reads
    assert re.fullmatch(r"[0-9a-f]{64}", coordinator.operator_token)
    assert {t.operator_token for t in torchruns} == {""}
    token_file = incidents / "operator-token-4242"
    assert token_file.read_text().strip() == coordinator.operator_token
    assert token_file.stat().st_mode & 0o777 == 0o600 and str(token_file) in run.stderr
    assert not [c for c in run.calls if coordinator.operator_token in SEP.join(c.args)]
    assert (tmp_path / "stop.rc").read_text().strip() == "1"  # a rank's environment cannot stop the job
    assert "NANGUARD_OPERATOR_TOKEN" in (tmp_path / "stop.err").read_text()

    # ...stopped at the end, its log synced
    assert pid_gone(coordinator.pid)
    assert "stopped; log" in (incidents / "coordinator-4242.out").read_text()
    assert (incidents / "coordinator-4242.jsonl").exists()


def test_metrics_listen_on_the_first_nodes_address_not_every_interface(sbatch):
    run = sbatch()
    assert run.returncode == 0, run.stderr
    (coordinator,) = run.of("nanguard")
    assert pairs(coordinator.args)["--metrics-host"] == "gpu-017"
    assert "metrics: http://gpu-017:9464/metrics" in run.stderr


def test_an_operator_token_given_goes_to_the_coordinator_only(sbatch):
    run = sbatch(NANGUARD_OPERATOR_TOKEN="ops-secret")
    assert run.returncode == 0, run.stderr
    assert [c.operator_token for c in run.of("nanguard")] == ["ops-secret"]
    assert [c.operator_token for c in run.of("torchrun")] == ["", ""]


def test_curve_gives_the_secret_key_to_the_coordinator_and_the_public_one_to_the_ranks(sbatch):
    from nanguard import curve

    run = sbatch(NANGUARD_CURVE="1")
    assert run.returncode == 0, run.stderr
    (coordinator,) = run.of("nanguard")
    torchruns = run.of("torchrun")
    assert coordinator.curve_secret_key and {t.curve_secret_key for t in torchruns} == {""}
    assert {t.curve_public_key for t in torchruns} == {curve.public_key(coordinator.curve_secret_key)}


def test_a_given_token_is_passed_on_not_replaced(sbatch):
    run = sbatch(NANGUARD_TOKEN="s3cret-from-the-submitter")
    assert run.returncode == 0, run.stderr
    assert [c.token for c in run.of("nanguard") + run.of("torchrun")] == ["s3cret-from-the-submitter"] * 3
    assert run.of("torchrun")[0].args[-1] == "train.py"  # the default script
    assert len(run.of("nanguard-stopped")) == 1


def test_a_failed_training_is_the_exit_status_and_the_coordinator_still_stops(sbatch):
    run = sbatch(STUB_TORCHRUN_RC="3")
    assert run.returncode == 3
    assert len(run.of("torchrun")) == 2
    (stopped,) = run.of("nanguard-stopped")
    assert stopped.pid == run.of("nanguard")[0].pid
    assert "coordinator stopped" in run.stderr


def test_a_coordinator_that_never_gets_ready_fails_the_job_within_its_timeout(sbatch):
    # the stub never gets ready: only the script's own 2 s timeout ends it before the deadline
    run = sbatch(STUB_COORDINATOR="never-ready", NANGUARD_READY_TIMEOUT_S="2", timeout=20)
    assert run.returncode == 1
    assert "the coordinator on gpu-017 did not report ready within 2 s" in run.stderr
    assert "never getting there" in run.stderr  # its output, for the diagnosis
    assert not run.of("torchrun")
    assert len(run.of("nanguard-stopped")) == 1


def test_a_coordinator_that_exits_fails_the_job_at_once_with_its_output(sbatch):
    # deadline below the 30 s ready timeout: the script must not wait for it
    run = sbatch(STUB_COORDINATOR="exits", NANGUARD_READY_TIMEOUT_S="30", timeout=20)
    assert run.returncode == 1
    assert "exited before it was ready" in run.stderr and "Address already in use" in run.stderr
    assert not run.of("torchrun")


def test_scancel_during_training_stops_the_coordinator(sbatch):
    # deadline below the stub's 30 s of training: SIGTERM must end the job
    run = sbatch(STUB_TORCHRUN_SLEEP="30", signal_after=("torchrun", signal.SIGTERM), timeout=20)
    assert run.returncode == 143
    assert len(run.of("nanguard-stopped")) == 1


def test_outside_slurm_it_says_so(sbatch):
    run = sbatch(SLURM_JOB_ID=None)
    assert run.returncode == 2
    assert "SLURM_JOB_ID is not set: submit this script with sbatch" in run.stderr
    assert not run.calls
