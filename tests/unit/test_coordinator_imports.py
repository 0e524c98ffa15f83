"""The coordinator side never imports torch: a daemon beside the job, and the operator's CLI,
must start fast and run where torch is not installed."""

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import nanguard.coordinator

REPO = Path(__file__).resolve().parents[2]
COORDINATOR_MODULES = sorted(f"nanguard.coordinator.{module.name}"
                             for module in pkgutil.iter_modules(nanguard.coordinator.__path__))
COORDINATOR_SIDE = ["nanguard.coordinator", *COORDINATOR_MODULES, "nanguard.cli", "nanguard.wire",
                    "nanguard.client", "nanguard.protocol"]


def test_the_coordinator_side_never_imports_torch():
    # one fresh interpreter, checked after each import, so a failure names the culprit
    code = ("import importlib, sys\n"
            f"for name in {COORDINATOR_SIDE!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert 'torch' not in sys.modules, f'importing {name} imported torch'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert {"nanguard.coordinator.ranks", "nanguard.coordinator.stop",
            "nanguard.coordinator.eventlog", "nanguard.coordinator.server"} <= set(COORDINATOR_MODULES)
