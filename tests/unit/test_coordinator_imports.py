"""The operator's CLI never imports torch when it starts: ``nanguard status`` / ``stop`` /
``coordinator`` must start fast and run where torch is not installed. Its commands that need torch
(``inspect``, ``demo``) import it when they run, so this is checked at import, in a fresh interpreter;
the coordinator itself, and the wire, client and protocol it shares, are checked by a contract of
.importlinter (every import they make, in functions too: tests/unit/test_imports.py)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_cli_and_the_package_root_never_import_torch():
    code = ("import contextlib, io, sys\n"
            "import nanguard\n"
            "assert 'torch' not in sys.modules, 'importing nanguard imported torch'\n"
            "import nanguard.cli\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    nanguard.cli.main(['--version'])  # (builds every command's parser)\n"
            "assert 'torch' not in sys.modules, 'nanguard --version imported torch'\n"
            "assert 'nanguard.coordinator.main' in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
