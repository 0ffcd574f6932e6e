"""`tpla bench serve --quick`: one configuration (the disaggregated TPLA stack as real
processes, two prefill workers) at concurrency 1 and 2 on a tiny model. No timing is
asserted: only the report's contract and that every request completed with exactly the
requested number of tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.bench.runner import run_bench
from tests.model.tiny import save_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]


def test_quick_serve_bench_reports_every_request(tmp_path: Path) -> None:
    model = save_tiny_chat_model(tmp_path / "model", std=0.08)
    report = run_bench(
        "serve",
        "--quick",
        "--json",
        "--configs",
        "tpla",
        "--reparam",
        "",
        "--prefill-workers",
        "2",
        "--model",
        str(model),
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
        for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tpot_p50_ms"] <= r["tpot_p99_ms"]
    assert isinstance(report["goals"], dict)
