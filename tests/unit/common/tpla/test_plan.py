"""`tpla plan`: analytic per-rank weights equal the engine's `RankModel`, and the plans of the
published DeepSeek-V3 / V2-Lite configs through the real CLI."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from common.loading.loader import load_model
from common.model.tpla import RmsNormMode, latent_shards
from common.tpla.plan import GIB, Hardware, PlanRequest, build_plan, checkpoint_from_hf_dict
from common.tpla.rank_memory import (
    Kind,
    Layout,
    kv_bytes_per_stored_token,
    rank_tensors,
    weight_bytes,
)
from services.decode.config import ParallelConfig, ParallelMode
from services.decode.rank.model import RankModel
from tests.cli import run_tpla
from tests.tiny import save_hf
from tools.cli.main import main

CONFIGS = Path(__file__).resolve().parents[3] / "data" / "configs"
V3, V2_LITE = CONFIGS / "deepseek-v3" / "config.json", CONFIGS / "deepseek-v2-lite" / "config.json"
# (tp, r, mode): MLA-TP, TPLA at r = 2 and r = tp, SP.
LAYOUTS = [
    (2, 1, "tpla"),
    (2, 2, "tpla"),
    (4, 2, "tpla"),
    (4, 4, "tpla"),
    (2, 1, "sp"),
    (4, 1, "sp"),
]


def _layout(tp: int, r: int, mode: str, rmsnorm: RmsNormMode) -> tuple[Layout, ParallelConfig]:
    exact = rmsnorm is RmsNormMode.EXACT
    kind = Kind.SP if mode == "sp" else (Kind.MLA_TP if r == 1 else Kind.TPLA)
    return Layout(kind, tp, r, exact), ParallelConfig(tp, r, rmsnorm, ParallelMode(mode))


@pytest.mark.parametrize("variant", ["v2-greedy", "v3-noaux-yarn"])
def test_analytic_rank_weights_equal_rank_model_parameter_bytes(
    variant: str, tmp_path: Path
) -> None:
    # vocab 163 does not split evenly: tensor_split gives the first ranks one more lm_head row.
    save_hf(variant, tmp_path, vocab_size=163)
    full = load_model(tmp_path)  # fp32
    c = full.config
    assert weight_bytes(rank_tensors(c, Layout(Kind.MLA_TP, 1), 0), "float32") == sum(
        p.numel() * 4 for p in full.parameters()
    )
    for tp, r, mode in LAYOUTS:
        for rmsnorm in RmsNormMode:
            layout, parallel = _layout(tp, r, mode, rmsnorm)
            shards = [latent_shards(c.kv_lora_rank, r) for _ in range(c.num_hidden_layers)]
            per_rank = []
            for rank in range(tp):
                engine = RankModel(full, parallel, rank, shards).parameter_bytes()
                analytic = weight_bytes(rank_tensors(c, layout, rank), "float32")
                assert analytic == engine, (tp, r, mode, rmsnorm, rank)
                per_rank.append(analytic)
            assert per_rank[0] == max(per_rank)  # the planner's bound is rank 0's


def test_bf16_rank_model_holds_the_bf16_bytes(tmp_path: Path) -> None:
    """bf16 halves every tensor but the router, which the engine keeps in fp32."""
    save_hf("v3-noaux-yarn", tmp_path)
    full = load_model(tmp_path, dtype="bfloat16")
    c = full.config
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    request = PlanRequest(Hardware(80 * GIB, 4), context=512, weight_dtype="bfloat16")
    assert build_plan(c, request).full_model_bytes == full_bytes  # the host copy at load
    for tp, r, mode in [(4, 2, "tpla"), (2, 1, "sp")]:
        layout, parallel = _layout(tp, r, mode, RmsNormMode.EXACT)
        shards = [latent_shards(c.kv_lora_rank, r) for _ in range(c.num_hidden_layers)]
        for rank in range(tp):
            engine = RankModel(full, parallel, rank, shards).parameter_bytes()
            assert weight_bytes(rank_tensors(c, layout, rank), "bfloat16") == engine


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
    blocks = max(budget, 0) // (entry["kv_bytes_per_stored_token"] * out["block_size"])
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


def test_published_configs_parse_and_the_kv_formula() -> None:
    v3 = checkpoint_from_hf_dict(json.loads(V3.read_text()))
    assert (v3.quant_method, v3.fp8_block, v3.mtp_layers) == ("fp8", (128, 128), 1)
    c = v3.config
    assert (c.vocab_size, c.q_lora_rank, c.n_routed_experts, c.first_k_dense_replace) == (
        129280,
        1536,
        256,
        3,
    )
    lite = checkpoint_from_hf_dict(json.loads(V2_LITE.read_text())).config
    assert (lite.num_hidden_layers, lite.num_attention_heads, lite.q_lora_rank) == (27, 16, None)
    assert (lite.n_routed_experts, lite.n_shared_experts, lite.num_experts_per_tok) == (64, 2, 6)
    assert lite.rope_scaling is not None and lite.rope_scaling.factor == 40
    for r in (1, 2, 4, 8):
        layout = Layout(Kind.TPLA, 8, r)
        assert kv_bytes_per_stored_token(c, layout, "float16") == (512 // r + 64) * 61 * 2


def _error(args: str, capsys: pytest.CaptureFixture[str]) -> str:
    """`tpla plan ARGS` in this process (the same `main` as the console script)."""
    assert main(["plan", *shlex.split(args)]) == 2
    return capsys.readouterr().err


def test_bad_inputs_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lite = f"--config {V2_LITE} --gpu-mem-gib 80 --context 4096"
    err = _error(f"{lite} --gpus-per-group 6 --latent-groups 4", capsys)
    assert "tpla plan: error: tp=6 is not a multiple of latent_groups=4" in err
    err = _error(f"{lite} --gpus-per-group 32 --latent-groups 2", capsys)
    assert "mla-tp: num_attention_heads (16) is not divisible by 32" in err
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({**json.loads(V2_LITE.read_text()), "kv_lora_rank": 500}))
    err = _error(
        f"{lite.replace(str(V2_LITE), str(odd))} --gpus-per-group 8 --latent-groups 8", capsys
    )
    assert "tpla r=8: kv_lora_rank (500) is not divisible by 8" in err
    err = _error(f"--model {tmp_path} --gpu-mem-gib 80 --context 4096 --gpus-per-group 8", capsys)
    assert "no config.json found" in err
    err = _error(f"--config {V2_LITE} --gpu-mem-gib 80 --gpus-per-group 8 --context 200000", capsys)
    assert "exceeds the model's max_position_embeddings (163840)" in err
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"model_type": "llama"}))
    err = _error(f"--config {llama} --gpu-mem-gib 80 --context 4096 --gpus-per-group 8", capsys)
    assert "model_type 'llama'" in err
    with pytest.raises(SystemExit) as exc:  # argparse refuses an unknown dtype
        main(["plan", *shlex.split(lite), "--gpus-per-group", "8", "--dtype", "int8"])
    assert exc.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_a_bad_input_exits_non_zero_from_a_real_process() -> None:
    args = f"--config {V3} --gpu-mem-gib 80 --context 4096 --gpus-per-group 8 --latent-groups 3"
    proc = run_tpla("plan", *shlex.split(args))
    assert proc.returncode == 2
    assert "tpla plan: error: tp=8 is not a multiple of latent_groups=3" in proc.stderr
