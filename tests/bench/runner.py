"""Runs `tpla bench …` as a subprocess (as a user would) and returns its JSON contract line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str, timeout: float = 300) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
