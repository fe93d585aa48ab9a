"""The project's lint rules (``[tool.ruff.lint]`` in ``pyproject.toml``) hold everywhere."""

import subprocess
import sys
from pathlib import Path


def test_ruff_is_clean():
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", str(root)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
