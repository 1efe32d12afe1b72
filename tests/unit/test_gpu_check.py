"""bench/gpu_check.py: the device check runs as a script; without CUDA it must say so and succeed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_gpu_check_script() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    if torch.cuda.is_available():
        # On a GPU the whole check runs: every line PASS, none FAIL.
        assert "FAIL" not in proc.stdout and " 0 failed" in proc.stdout, proc.stdout
    else:
        assert "skipped: no CUDA device is present" in proc.stdout
