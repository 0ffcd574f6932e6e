"""`tpla` as a real process, as a user runs it: the one helper every CLI test goes through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_tpla(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`tpla ARGS` from the repository root, one torch thread; `env` goes over os.environ."""
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def tpla_json(*args: str, env: Mapping[str, str] | None = None, timeout: float = 120) -> Any:
    """`tpla ARGS` that must succeed; its JSON contract, the last stdout line."""
    proc = run_tpla(*args, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def generate_ids(*args: str, env: Mapping[str, str] | None = None, timeout: float = 300) -> list:
    """`tpla generate ARGS --json`'s token ids (a named kernel that cannot run here stops it,
    exit 2, which fails the test)."""
    proc = run_tpla("generate", *args, "--json", env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"]


def run_bench(*args: str, timeout: float = 300) -> Any:
    """`tpla bench ARGS` that must succeed; its JSON contract line."""
    return tpla_json("bench", *args, timeout=timeout)
