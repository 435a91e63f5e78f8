"""service/ and prefix_store/ stay mypy-clean (STYLE.md, rule 7)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", "service", "prefix_store"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
