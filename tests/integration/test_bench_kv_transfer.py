"""`tpla bench kv-transfer` in a small configuration: real receiver processes, every backend.

No timing is asserted: only the report's contract, that every backend moved the same bytes,
and that each receiver's paged cache holds exactly the bytes that were sent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli import run_bench
from tools.bench.kv_transfer import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
TOKENS, SYNTHETIC = 200, 40


@pytest.fixture(scope="module")
def report() -> dict:
    return run_bench(
        "kv-transfer",
        "--json",
        "--model",
        str(ROOT / "models" / "demo"),
        "--prompt-tokens",
        str(TOKENS),
        "--synthetic-tokens",
        str(SYNTHETIC),
        "--reps",
        "2",
    )


def test_json_contract(report: dict) -> None:
    for key in ("raw_tcp_GBps", "grpc_GBps", "torch_GBps", "grpc_vs_raw", "torch_vs_raw"):
        assert report[key] > 0, key
    assert report["headline_set"] == "v2-lite-tpla"  # the largest set
    assert report["bytes"] == next(
        s["bytes"] for s in report["sets"] if s["name"] == "v2-lite-tpla"
    )
    assert [s["name"] for s in report["sets"]] == ["demo-tpla", "demo-mla-tp", "v2-lite-tpla"]


def test_every_backend_moves_the_same_bytes(report: dict) -> None:
    # Per rank and token: layers x (latent slice + rope) x bytes per element.
    demo = 4 * TOKENS * 4  # demo model: 4 layers, fp32
    expected = {
        "demo-tpla": 2 * demo * (64 + 16),
        "demo-mla-tp": 2 * demo * (128 + 16),
        "v2-lite-tpla": 2 * 27 * SYNTHETIC * (256 + 64) * 2,  # bf16
    }
    for s in report["sets"]:
        assert s["bytes"] == expected[s["name"]] == sum(s["shard_bytes"])
        for backend in BACKENDS:
            assert s[backend]["acked_bytes"] == [s["bytes"]] * report["reps"], backend


def test_receiver_caches_hold_exactly_the_sent_bytes(report: dict) -> None:
    assert report["checksums_ok"] is True
    for s in report["sets"]:
        assert s["grpc"]["checksum_ok"] is True and s["torch"]["checksum_ok"] is True
        assert s["raw_tcp"]["checksum_ok"] is None  # the wire baseline writes no cache
        # One write per shard per repetition went through the rank's cache sink.
        assert s["grpc"]["sink_ms_median"] is not None
