"""`tpla plan` as a real process: the plans of the published DeepSeek-V3 / V2-Lite configs, and
a bad input's exit status."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from common.tpla.capacity_plan import GIB
from tests.cli import run_tpla

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
V3, V2_LITE = CONFIGS / "deepseek-v3" / "config.json", CONFIGS / "deepseek-v2-lite" / "config.json"


def _plan(args: str) -> dict:
    """Run `tpla plan ARGS --json` as a real process; the parsed last stdout line."""
    proc = run_tpla("plan", *shlex.split(args), "--json")
    assert proc.returncode == 0, proc.stderr
    table, last = proc.stdout.strip().rsplit("\n", 1)
    assert "layout" in table and "fits" in table  # the human table comes first
    return json.loads(last)


def _expected_tokens(out: dict, layout: str, tp: int) -> int:
    budget = out["gpu_mem_bytes"] - out["reserve_bytes"]
    entry = next(p for p in out["layouts"] if p["layout"] == layout)
    budget -= entry["weights_bytes_per_rank"]
    # The default reserve has the CUDA graphs' pool and NCCL's buffers on top.
    budget -= entry["graph_pool_bytes_per_rank"] + entry["nccl_bytes_per_rank"]
    # Less the rank cache's trash block, which no sequence gets.
    blocks = max(max(budget, 0) // (entry["kv_bytes_per_stored_token"] * out["block_size"]) - 1, 0)
    return blocks * out["block_size"] * (tp if layout == "sp" else 1)


def test_v3_fp8_checkpoint_planned_in_bf16_does_not_fit_one_8_gpu_node() -> None:
    out = _plan(
        f"--config {V3} --gpu-mem-gib 80 --gpus-per-group 8 --latent-groups 2 "
        "--context 32768 --dtype bfloat16"
    )
    assert out["checkpoint_quantization"] == "fp8" and out["mtp_layers_not_loaded"] == 1
    assert out["num_hidden_layers"] == 61
    kv = out["kv_bytes_per_token_per_rank"]
    # Per token per layer: 576 elements under MLA-TP, 256 + 64 = 320 under TPLA r=2 (1.8x).
    assert kv == {"mla-tp": 576 * 61 * 2, "tpla": 320 * 61 * 2, "sp": 576 * 61 * 2 // 8}
    assert kv["mla-tp"] / kv["tpla"] == pytest.approx(1.8)
    # 671B parameters without the MTP layer; 2 bytes each.
    assert 670.5e9 < out["full_model_bytes"] / 2 < 671.5e9
    # Experts are split 8 ways but embedding, q_a/kv_a projections are replicated: ~161 GiB
    # per rank in bf16, twice an H100. Nothing fits; no token can be cached.
    assert 155 * GIB < out["weights_bytes_per_rank"] < 170 * GIB
    assert out["fits"] is False and not any(out["fits_by_layout"].values())
    assert out["max_tokens_per_rank"] == {"mla-tp": 0, "tpla": 0, "sp": 0}
    assert out["reserve_bytes"] == 8 * GIB  # 10% of 80 GiB

    h200 = _plan(f"--config {V3} --gpu-mem-gib 141 --gpus-per-group 8 --context 32768")
    assert h200["fits"] is False  # 161 GiB of bf16 weights > 141 GiB


def test_v3_in_its_native_fp8_fits_h200_and_tpla_caches_more() -> None:
    out = _plan(
        f"--config {V3} --gpu-mem-gib 141 --gpus-per-group 8 --latent-groups 2 "
        "--context 32768 --weight-dtype float8"
    )
    assert out["weight_dtype"] == "float8" and out["dtype"] == "bfloat16"
    assert out["fits"] is True
    assert 78 * GIB < out["weights_bytes_per_rank"] < 86 * GIB  # ~half the bf16 bytes
    tokens, seqs = out["max_tokens_per_rank"], out["max_sequences_per_group"]
    for layout in ("mla-tp", "tpla", "sp"):
        assert tokens[layout] == _expected_tokens(out, layout, 8)
    # 32768 tokens = 2048 blocks per rank (MLA-TP, TPLA); SP: 16 chunks of 256 per rank.
    blocks = {p["layout"]: p["blocks_per_sequence"] for p in out["layouts"]}
    assert blocks == {"mla-tp": 2048, "tpla": 2048, "sp": 256}
    assert seqs["mla-tp"] == tokens["mla-tp"] // 32768
    assert seqs["tpla"] > 1.7 * seqs["mla-tp"]  # 1.8x per token, less the larger q_b / o_proj
    assert seqs["sp"] >= 8 * seqs["mla-tp"]
    # The GPU overlay's values: one pod per node of 8 GPUs holding the whole group.
    budget = next(p for p in out["layouts"] if p["layout"] == "tpla")["kv_budget_bytes_per_rank"]
    assert out["manifest"]["TPLA_KV_BUDGET_MB"] == str(budget // 2**20)
    assert out["manifest"]["decode"] == {"size": 1, "nvidia.com/gpu": 8, "shm_size_limit": "32Gi"}
    two_nodes = _plan(
        f"--config {V3} --gpu-mem-gib 141 --gpus-per-group 16 --context 32768 "
        "--weight-dtype float8 --gpus-per-node 8"
    )
    assert two_nodes["manifest"]["decode"]["size"] == 2
    # On an H100 the fp8 weights (~81 GiB) alone exceed the card.
    h100 = _plan(
        f"--config {V3} --gpu-mem-gib 80 --gpus-per-group 8 --context 32768 --weight-dtype float8"
    )
    assert h100["fits"] is False


def test_v2_lite_from_its_model_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "DeepSeek-V2-Lite"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(V2_LITE.read_text())
    out = _plan(
        f"--model {model_dir} --gpu-mem-gib 80 --gpus-per-group 8 --latent-groups 4 2 "
        "--context 32768 --dtype bfloat16"
    )
    kv = out["kv_bytes_per_token_per_rank"]
    assert kv == {"mla-tp": 576 * 27 * 2, "tpla": 192 * 27 * 2, "sp": 576 * 27 * 2 // 8}
    assert kv["mla-tp"] / kv["tpla"] == pytest.approx(3.0)
    assert out["latent_groups"] == 4 and out["fits"] is True
    assert [(p["layout"], p["latent_groups"]) for p in out["layouts"]] == [
        ("mla-tp", 1),
        ("tpla", 4),
        ("tpla", 2),
        ("sp", 1),
    ]
    assert 3 * GIB < out["weights_bytes_per_rank"] < 5 * GIB
    for layout in ("mla-tp", "tpla", "sp"):
        assert out["max_tokens_per_rank"][layout] == _expected_tokens(out, layout, 8)
    assert out["max_sequences_per_group"]["mla-tp"] == out["max_tokens_per_rank"]["mla-tp"] // 32768


def test_a_bad_input_exits_non_zero_from_a_real_process() -> None:
    args = f"--config {V3} --gpu-mem-gib 80 --context 4096 --gpus-per-group 8 --latent-groups 3"
    proc = run_tpla("plan", *shlex.split(args))
    assert proc.returncode == 2
    assert "tpla plan: error: tp=8 is not a multiple of latent_groups=3" in proc.stderr
