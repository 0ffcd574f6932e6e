"""The profile `tpla bench serve --profile` writes: the test data's profile is exactly what
the recorded serving bench gives, and a sweep with a hole in its grid is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.autoscaler.profile import load_profile
from tools.bench.profile import profile_from_report, profile_from_rows

ROOT = Path(__file__).resolve().parents[4]


def test_the_test_data_is_the_recorded_bench() -> None:
    report = json.loads((ROOT / "benchmarks" / "serve.json").read_text())
    profile = profile_from_report(report, decode_gpus=2)
    assert profile == load_profile(ROOT / "tests" / "data" / "autoscaler_profile.json")
    long = next(r for r in report["results"] if r["config"] == "tpla" and r["concurrency"] == 4
                and r["mix"] == "long")  # fmt: skip
    assert profile.prefill.throughput(1536) == pytest.approx(
        4 * 1536 / (long["ttft_p99_ms"] / 1e3), rel=1e-6
    )
    assert profile.decode.itl(4, 1552) == pytest.approx(long["tpot_p50_ms"] / 1e3, rel=1e-4)


def test_a_hole_in_the_grid_is_refused() -> None:
    report = json.loads((ROOT / "benchmarks" / "serve.json").read_text())
    rows = [r for r in report["results"] if not (r["mix"] == "long" and r["concurrency"] == 16)]
    with pytest.raises(ValueError, match="full grid"):
        profile_from_rows(rows, "tpla", "m", 2, "")
