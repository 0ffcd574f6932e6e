"""`tpla bench serve --quick`: one configuration (the disaggregated TPLA stack as real
processes, two prefill workers) at concurrency 1 and 2 on a tiny model. No timing is
asserted: only the report's contract and that every request completed with exactly the
requested number of tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.cli import run_bench
from tests.tiny import save_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]


def _quick_serve(tmp_path: Path, *args: str) -> dict:
    """`tpla bench serve --quick --json` on a tiny model (identity basis) with `args`."""
    model = save_tiny_chat_model(tmp_path / "model", std=0.08)
    return run_bench("serve", "--quick", "--json", "--reparam", "", "--model", str(model), *args)


def test_quick_serve_bench_reports_every_request(tmp_path: Path) -> None:
    report = _quick_serve(
        tmp_path,
        "--configs",
        "tpla",
        "--prefill-workers",
        "2",
        "--out",
        str(tmp_path / "serve.json"),
    )
    assert report == json.loads((tmp_path / "serve.json").read_text())
    assert report["bench"] == "serve" and report["sweep"]["configs"] == ["tpla"]
    assert report["sweep"]["prefill_workers"] == 2  # recorded (the stack was asked for two)
    rows = report["results"]
    assert [(r["config"], r["mix"], r["concurrency"]) for r in rows] == [
        ("tpla", "short", 1),
        ("tpla", "short", 2),
    ]
    for r in rows:
        assert r["requests"] == r["completed"] == max(r["concurrency"], 2), r["errors"]
        assert r["errors"] == []
        assert r["completion_tokens"] == [r["max_tokens"]] * r["requests"]
        assert r["output_tokens"] == r["max_tokens"] * r["requests"]
        assert r["output_tok_s"] > 0
        _check_latencies(r)
    assert isinstance(report["goals"], dict)


def _check_latencies(r: dict) -> None:
    for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms"):
        assert math.isfinite(r[key]) and r[key] > 0, key
    assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tpot_p50_ms"] <= r["tpot_p99_ms"]
    assert r["itl_p50_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"]


def test_poisson_arrivals_against_the_colocated_baseline(tmp_path: Path) -> None:
    """`--request-rate`: the in-process colocated server under a seeded Poisson schedule, and
    hf-static (closed loops only) skipped rather than faked."""
    report = _quick_serve(
        tmp_path, "--configs", "colocated", "hf-static", "--request-rate", "20", "--requests", "5"
    )
    assert report["sweep"]["arrival"] == "poisson" and report["sweep"]["request_rates"] == [20.0]
    [row] = report["results"]
    assert (row["config"], row["arrival"], row["concurrency"], row["request_rate"]) == (
        "colocated",
        "poisson",
        None,
        20.0,
    )
    assert row["requests"] == row["completed"] == 5, row["errors"]
    assert row["completion_tokens"] == [row["max_tokens"]] * 5
    _check_latencies(row)
