"""`tpla bench ... --json`: stdout is the JSON result alone (the whole stream parses), the
table goes to stderr; the cheap benches in their quick forms (a few seconds each)."""

from __future__ import annotations

import json

import pytest

from tests.cli import run_tpla

QUICK = {
    "capacity": ("--budget-mb", "64"),
    "roofline": ("--gemm-size", "64", "--stream-mb", "1", "--repeats", "1"),
    "prefill": ("--prompt", "16", "--repeats", "1", "--shapes", "demo"),
    "decode-attn": ("--quick", "--shapes", "demo"),
}


@pytest.mark.parametrize("bench", sorted(QUICK))
def test_json_stdout_is_only_json(bench: str) -> None:
    proc = run_tpla("bench", bench, *QUICK[bench], "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert isinstance(json.loads(proc.stdout), dict), proc.stdout[:500]
