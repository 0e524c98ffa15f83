"""``nanguard.integrations.<framework>`` works after a plain ``import nanguard``, and imports the
framework only then (in a fresh interpreter: this one has imported everything already)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _fresh(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.realworld  # (the framework is imported by the interpreter it starts: tests/tiers.py cannot see it)
@pytest.mark.timeout(150)
@pytest.mark.parametrize("framework, modules", [("lightning", ("lightning", "pytorch_lightning")),
                                                ("transformers", ("transformers",))])
def test_an_adapter_is_an_attribute_after_a_plain_import(framework, modules):
    pytest.importorskip(modules[0])
    done = _fresh(f"""
        import sys
        import nanguard

        before = [m for m in {modules!r} if m in sys.modules] + [m for m in sys.modules if m.startswith("nanguard.integrations")]
        callback = nanguard.integrations.{framework}.NanguardCallback
        after = any(m in sys.modules for m in {modules!r})
        print(before, callback.__module__, after)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", f"nanguard.integrations.{framework}", "True"]


def test_an_unknown_adapter_says_which_there_are():
    done = _fresh("""
        import nanguard

        try:
            nanguard.integrations.keras
        except AttributeError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("module 'nanguard.integrations' has no attribute 'keras'; its adapters are "
                                   "lightning, transformers")
