"""benchmarks/gpu_sync.py in its tiny form on the CPU: the script a lent GPU runs works the first time.

What only a GPU can show (the host synchronisations CUDA counts, the device's UUID in the event, the
cost on a >= 100M-parameter model) is not checked here; the rest of its code path is: both modes
beside plain with gradient accumulation, and the four bad steps, each judged by the script itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_sync.py"


def test_the_tiny_run_times_both_modes_and_stops_every_bad_step_as_claimed(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--accum", "2"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 micro-batch(es) a step" in result.stdout
    ratios = dict(re.findall(r"^\s+(sentinel|full)\s+[\d.]+ ms, paired ratio (\d+\.\d+)", result.stdout, re.MULTILINE))
    assert set(ratios) == {"sentinel", "full"} and all(0.3 < float(r) < 10 for r in ratios.values()), result.stdout
    verdicts = re.findall(r"^bad step, (sentinel|full), (every call|first call only): .*: as claimed$",
                          result.stdout, re.MULTILINE)
    assert sorted(verdicts) == sorted((mode, case) for mode in ("sentinel", "full")
                                      for case in ("every call", "first call only")), result.stdout
    assert "NOT" not in result.stdout
    assert not list(tmp_path.iterdir()), "incidents belong in a folder of the script's own, removed after"


def test_a_mode_it_does_not_know_is_refused_with_what_it_takes():
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--modes", "sentinel,fast"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--modes takes sentinel, full" in result.stderr


def test_the_prepared_gpu_check_runs_through_on_a_cpu(tmp_path):
    # gpu_check.sh's dry run: both runs of gpu_sync.py (tiny, on the CPU) and the unit tests with a CUDA
    # path, with this interpreter as the python3 it calls; its log lands in $OUT, as the device returns it
    env = dict(os.environ, GPU_CHECK_ARGS="--device cpu --tiny", OUT=str(tmp_path),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                            timeout=900, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "gpu_check.txt").read_text()
    assert log.count("as claimed") == 4 and "NOT" not in log and "4 micro-batch(es) a step" in log, log
    assert re.search(r"^\d+ passed", log, re.MULTILINE) and log.rstrip().endswith("== exit 0"), log


def test_the_prepared_gpu_check_passes_shellcheck(tool):
    result = subprocess.run([tool("shellcheck"), str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
