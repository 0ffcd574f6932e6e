"""`tpla bench moe` as a real process: stdout is only its JSON, one row per kernel; `--fp8`
without CUDA says so."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli import run_tpla


def test_moe_bench_prints_only_json() -> None:
    args = ("--shapes", "demo", "--batch", "1", "4", "--repeats", "1", "--json")
    proc = run_tpla("bench", "moe", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # the whole of stdout, the table is on stderr
    assert "loop" in proc.stderr
    kernels = {(r["batch"], r["kernel"]) for r in result["rows"]}
    assert {(1, "loop"), (1, "grouped"), (4, "loop"), (4, "grouped")} <= kernels
    assert all(r["ms"] > 0 for r in result["rows"])


def test_the_fp8_rows_say_so_without_cuda() -> None:
    """`--fp8` times FP8 experts on CUDA only: without it, the reason and no rows (no file)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA here: the rows are timed (tests/gpu, benchmarks/moe_fp8_cuda.json)")
    proc = run_tpla("bench", "moe", "--fp8", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["rows"] == [] and "no CUDA" in result["skipped"]
    assert "no CUDA" in proc.stderr
