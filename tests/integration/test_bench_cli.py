"""`tpla bench roofline | decode-attn | prefill | capacity | decode-step | gpu` as real processes:
JSON contracts and the counting formulas, never timing thresholds (timings on a shared CPU are
noise)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch

from tests.cli import run_bench, tpla_json
from tools.bench.attn_work import shapes
from tools.bench.gpu_check import NO_GPU
from tools.bench.prefill import prefill_work

ROOT = Path(__file__).resolve().parents[2]


def test_roofline_json() -> None:
    r = run_bench("roofline", "--json", "--gemm-size", "256", "--stream-mb", "16", "--repeats", "2")
    assert r["flops_per_s"] > 0 and r["bytes_per_s"] > 0 and r["threads"] >= 1
    assert math.isclose(r["ridge_flop_per_byte"], r["flops_per_s"] / r["bytes_per_s"])


def test_decode_attn_quick_json(tmp_path: Path) -> None:
    plot = tmp_path / "fig.png"
    result = run_bench(
        "decode-attn", "--quick", "--json", "--shapes", "demo", "--rounds", "2", "--plot", str(plot)
    )
    rows = result["rows"]
    assert result["rounds"] == 2
    # Every row keeps the repeats of both sweeps (at least 5 each).
    assert all(r["repeats"] >= 10 for r in rows)
    assert {(r["mode"], r["context"], r["batch"]) for r in rows} == {
        (m, c, b) for m in ("mla-tp", "tpla") for c in (1024, 4096) for b in (1, 4)
    }
    roof = result["roofline"]
    for r in rows:
        assert {"shape", "mode", "context", "batch", "ms", "roofline_fraction"} <= set(r)
        bound = max(r["bytes"] / roof["bytes_per_s"], r["flops"] / roof["flops_per_s"])
        assert math.isclose(r["bound_ms"], 1e3 * bound, rel_tol=1e-9)
        assert math.isclose(r["roofline_fraction"], r["bound_ms"] / r["ms"], rel_tol=1e-9)
        assert math.isclose(r["gflops_per_s"], r["flops"] / r["ms"] / 1e6, rel_tol=1e-9)
    pairs = {(r["context"], r["batch"], r["mode"]): r for r in rows}
    for (context, batch, mode), tpla in pairs.items():
        if mode == "tpla":
            mla = pairs[(context, batch, "mla-tp")]
            assert math.isclose(tpla["speedup_vs_mla_tp"], mla["ms"] / tpla["ms"], rel_tol=1e-9)
            predicted = mla["bound_ms"] / tpla["bound_ms"]
            assert math.isclose(tpla["predicted_speedup_cpu"], predicted, rel_tol=1e-9)
            assert tpla["predicted_speedup_h100"] > 0 and tpla["predicted_speedup_h200"] > 0
    assert plot.stat().st_size > 10_000


def test_prefill_json_and_flops() -> None:
    result = run_bench("prefill", "--json", "--prompt", "64", "--shapes", "demo", "--repeats", "1")
    rows = {(r["backend"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(b, m) for b in ("sdpa", "native") for m in ("mla-sep", "tpla")}
    for b in ("sdpa", "native"):
        tpla, mla = rows[(b, "tpla")], rows[(b, "mla-sep")]
        assert math.isclose(tpla["sep_speedup"], tpla["ms"] / mla["ms"], rel_tol=1e-9)
    for m in ("mla-sep", "tpla"):
        native, sdpa = rows[("native", m)], rows[("sdpa", m)]
        assert math.isclose(native["speedup_vs_sdpa"], sdpa["ms"] / native["ms"], rel_tol=1e-9)
    mla = rows[("sdpa", "mla-sep")]
    demo = {s.name: s for s in shapes()}["demo"]
    w = prefill_work(demo, "mla-sep", 64)
    pairs = 64 * 65 / 2
    assert w.flops() == 2 * 64 * 128 * 4 * 64 + 2 * 4 * pairs * 48 + 2 * 4 * pairs * 32
    assert mla["flops"] == w.flops()


def test_capacity_json_matches_formula() -> None:
    result = run_bench("capacity", "--json", "--budget-mb", "32")
    rows = result["rows"]
    assert {(r["shape"], r["latent_groups"]) for r in rows} == {
        (s, r) for s in ("demo", "deepseek-v3") for r in (1, 2, 4)
    }
    bs = result["block_size"]
    base = {r["shape"]: r for r in rows if r["latent_groups"] == 1}
    for r in rows:
        assert r["allocated_bytes"] <= r["budget_bytes"]
        assert r["blocks"] == r["budget_bytes"] // (r["bytes_per_token"] * bs)
        assert r["tokens_per_rank"] == r["blocks"] * bs
        # Per token the saving is exactly the formula; whole blocks add at most one block of
        # rounding to each count.
        per_token = base[r["shape"]]["bytes_per_token"] / r["bytes_per_token"]
        assert per_token == pytest.approx(r["expected_ratio"], rel=1e-12)
        slack = 2 * r["expected_ratio"] / base[r["shape"]]["blocks"]
        assert abs(r["ratio_vs_mla_tp"] - r["expected_ratio"]) <= slack + 1e-12


def test_decode_step_json_side_by_side() -> None:
    """The real engine at tp=2 with shared-memory and gloo collectives, in one run; every
    configuration times exactly `--steps` steps that ran its whole batch."""
    result = run_bench(
        "decode-step",
        "--tp", "2", "--layouts", "mla-tp", "tpla", "--batch", "1", "3", "--context", "64",
        "--steps", "4", "--collectives", "shm", "dist", "--json",
    )  # fmt: skip
    for row in result["rows"]:
        assert len(row["step_ms"]) == 4
        assert row["median_ms"] == pytest.approx(statistics.median(row["step_ms"]))
    rows = {(r["collectives"], r["layout"]): r for r in result["rows"] if r["batch"] == 1}
    assert set(rows) == {(c, m) for c in ("shm", "dist") for m in ("mla-tp", "tpla")}
    for (coll, _), row in rows.items():
        assert row["median_ms"] > 0 and row["comm_bytes_per_step"] > 0
        base = rows[(coll, "mla-tp")]
        assert math.isclose(row["speedup_vs_mla_tp"], base["median_ms"] / row["median_ms"])
    # Same layout, same bytes, whichever transport carries them.
    assert (
        rows[("shm", "tpla")]["comm_bytes_per_step"]
        == rows[("dist", "tpla")]["comm_bytes_per_step"]
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine times the Triton rows")
def test_decode_attn_triton_needs_cuda() -> None:
    """Without CUDA the Triton rows say why they are missing (exit 0, no traceback) instead of
    timing Triton's interpreter."""
    result = run_bench("decode-attn", "--kernel", "triton", "--json")
    assert result["kernel"] == "triton" and result["rows"] == []
    assert "need a CUDA GPU" in result["skipped"]


def test_gpu_check_without_a_gpu_skips_each_gpu_part_and_runs_the_leader_step(
    tmp_path: Path,
) -> None:
    """`make gpu-check` on a machine without CUDA: every GPU part says why it skipped, the
    leader-step part runs on the CPU, and the summary is written."""
    parts = ["gpu-tests", "decode-attn", "decode-step", "fp8-experts", "leader-step"]
    argv = ["bench", "gpu", "--parts", *parts, "--quick", "--out-dir", str(tmp_path), "--json"]
    summary = tpla_json(*argv, env={"CUDA_VISIBLE_DEVICES": ""})
    status = {p["name"]: (p["status"], p["detail"]) for p in summary["parts"]}
    assert summary["device"] == "none"
    assert all(status[name] == ("skipped", NO_GPU) for name in parts[:4]), status
    assert status["leader-step"][0] == "ok", status
    assert (tmp_path / "gpu_check.json").exists()
    assert (tmp_path / "leader_step_check.json").exists()


def test_decode_attn_dsa_splits_the_indexer_from_the_sparse_attention() -> None:
    result = run_bench("decode-attn", "--dsa", "--contexts", "4096", "--rounds", "1", "--json")
    assert [r["layout"] for r in result["rows"]] == ["mla-tp", "tpla", "sp"]
    for row in result["rows"]:
        assert row["indexer_ms"] > 0 and row["sparse_attention_ms"] > 0
        assert row["sparse_step_ms"] == pytest.approx(
            row["indexer_ms"] + row["sparse_attention_ms"]
        )


def test_decode_step_on_the_dsa_bench_model() -> None:
    """The named DSA model past its index_topk (2048): every layout's step, one host wait."""
    result = run_bench(
        "decode-step", "--model", "dsa-v32-bench", "--tp", "2", "--layouts", "mla-tp", "tpla",
        "sp", "--batch", "1", "--context", "2600", "--steps", "2", "--reparam", "", "--json",
    )  # fmt: skip
    assert {r["layout"] for r in result["rows"]} == {"mla-tp", "tpla", "sp"}
    assert all(r["host_syncs_per_step"] == 1 for r in result["rows"])
