"""Run a check script under Triton's CPU interpreter: ``TRITON_INTERPRET`` must be set before Triton is first
imported, so each script runs in a fresh process (with the repository on its path, so a script imports the
library)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(script: str, timeout: int = 600) -> str:
    """The script's stdout; skips without Triton, fails with the script's output if it fails."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout
