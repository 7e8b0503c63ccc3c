"""Pyflakes' checks (ruff's F rules: undefined names, unused imports and variables) over every
Python file of the repository but the generated protobuf modules (pyproject.toml [tool.ruff])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_undefined_or_unused_names():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
