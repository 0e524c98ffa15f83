"""benchmarks/compare.py runs: two copies of this checkout, side by side with the plain loop."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compare_times_each_checkout_against_plain_in_the_same_rounds():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--model", "mlp",
                             "--rounds", "2", "--repo", f"one={ROOT}", "--repo", f"two={ROOT},mode=sentinel", "--floor"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ratios = dict(re.findall(r"^\s+(one|two|probe-floor|sentinel-floor)\s+median (\d+\.\d+)", result.stdout,
                             re.MULTILINE))
    assert set(ratios) == {"one", "two", "probe-floor", "sentinel-floor"}
    assert all(0.5 < float(r) < 5 for r in ratios.values()), ratios


def test_compare_refuses_a_path_without_a_package():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--repo", f"x={ROOT / 'docs'}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "expected NAME=PATH" in result.stderr


def test_compare_refuses_a_setting_without_a_value():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--repo", f"x={ROOT},mode"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "SETTING=VALUE" in result.stderr
