"""`tpla plan`: analytic per-rank weights equal the engine's `RankModel`, the published
DeepSeek-V3 / V2-Lite configs parse, and bad inputs are clear errors (the real process's plans
are in tests/integration/test_cli_plan.py)."""

from __future__ import annotations

import itertools
import json
import shlex
from pathlib import Path

import pytest

from common.group.comm import Comm
from common.loading.loader import load_model
from common.loading.serving_model import open_serving_weights
from common.model.fp8 import Fp8Weight
from common.parallel import MoeParallel, ParallelConfig, ParallelMode, RmsNormMode
from common.tpla.capacity_plan import (
    GIB,
    Hardware,
    PlanRequest,
    build_plan,
    checkpoint_from_hf_dict,
)
from common.tpla.rank_memory import (
    kv_bytes_per_stored_token,
    prefill_rank_tensors,
    rank_tensors,
    weight_bytes,
)
from services.decode.rank.rank_model import RankModel
from services.prefill.rank.prefill_rank_model import PrefillRankModel
from tests.shard_checkpoints import ThreadCollectives, ThreadGroup, fp8_copy
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


@pytest.mark.parametrize("variant", ["v2-greedy", "v3-noaux-yarn"])
def test_analytic_rank_weights_equal_rank_model_parameter_bytes(
    variant: str, tmp_path: Path
) -> None:
    # vocab 163 does not split evenly: tensor_split gives the first ranks one more lm_head row.
    save_hf(variant, tmp_path, vocab_size=163)
    full = load_model(tmp_path)  # fp32
    c = full.config
    assert weight_bytes(rank_tensors(c, ParallelConfig(), 0), "float32") == sum(
        p.numel() * 4 for p in full.parameters()
    )
    for (tp, r, mode), rmsnorm, moe in itertools.product(LAYOUTS, RmsNormMode, MoeParallel):
        parallel = ParallelConfig(tp, r, rmsnorm, ParallelMode(mode), moe=moe)
        per_rank = []
        for rank in range(tp):
            engine = RankModel(full, parallel, rank).parameter_bytes()
            analytic = weight_bytes(rank_tensors(c, parallel, rank), "float32")
            assert analytic == engine, (tp, r, mode, rmsnorm, moe, rank)
            per_rank.append(analytic)
        assert per_rank[0] == max(per_rank)  # the planner's bound is rank 0's


def test_uneven_expert_parallel_ranks_are_planned(tmp_path: Path) -> None:
    """6 experts over 4 ranks: 2, 2, 1, 1 whole experts; the plan's rank 0 holds the most."""
    save_hf("v2-greedy", tmp_path, n_routed_experts=6)
    full = load_model(tmp_path)
    c = full.config
    parallel = ParallelConfig(4, 2, moe=MoeParallel.EP)
    sizes = []
    for rank in range(4):
        model = RankModel(full, parallel, rank)
        analytic = weight_bytes(rank_tensors(c, parallel, rank), "float32")
        assert analytic == model.parameter_bytes()
        sizes.append(model.layers[1].ffn.experts.gate_up_proj.shape[0])
    assert sizes == [2, 2, 1, 1]
    request = PlanRequest(Hardware(80 * GIB, 4), context=512, moe=MoeParallel.EP)
    assert build_plan(c, request).chosen.weights_bytes == weight_bytes(
        rank_tensors(c, parallel, 0), "bfloat16"
    )


def test_bf16_rank_model_holds_the_bf16_bytes(tmp_path: Path) -> None:
    """bf16 halves every tensor but the router, which the engine keeps in fp32."""
    save_hf("v3-noaux-yarn", tmp_path)
    full = load_model(tmp_path, dtype="bfloat16")
    c = full.config
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    request = PlanRequest(Hardware(80 * GIB, 4), context=512, weight_dtype="bfloat16")
    assert build_plan(c, request).full_model_bytes == full_bytes  # the host copy at load
    for tp, r, mode in [(4, 2, "tpla"), (2, 1, "sp")]:
        parallel = ParallelConfig(tp, r, RmsNormMode.EXACT, ParallelMode(mode))
        for rank in range(tp):
            engine = RankModel(full, parallel, rank).parameter_bytes()
            assert weight_bytes(rank_tensors(c, parallel, rank), "bfloat16") == engine


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
        layout = ParallelConfig(8, r)
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_float8_resident_rank_model_holds_the_planned_bytes(dtype: str, tmp_path: Path) -> None:
    """`--weight-dtype float8 --dtype D` counts what a rank computing in D keeps of an FP8
    checkpoint: its linear weights' e4m3 bytes and one fp32 scale per block of its slice, the
    rest in D (blocks of 4 divide every slice here, so no slice starts inside a block)."""
    save_hf("v3-noaux-yarn", tmp_path / "hf")
    fp8, _ = fp8_copy(tmp_path / "hf", tmp_path, block=4)
    weights, _ = open_serving_weights(fp8, None, dtype, weight_dtype="float8")
    c = weights.config
    for (tp, r, mode), rmsnorm in itertools.product(LAYOUTS, RmsNormMode):
        parallel = ParallelConfig(tp, r, rmsnorm, ParallelMode(mode))
        for rank in range(tp):
            model = RankModel(weights, parallel, rank)
            assert isinstance(model.layers[1].ffn.experts.gate_up_proj, Fp8Weight)
            tensors = rank_tensors(c, parallel, rank)
            planned = weight_bytes(tensors, "float8", (4, 4), model_dtype=dtype)
            assert model.parameter_bytes() == planned, (tp, r, mode, rmsnorm, rank)


@pytest.mark.parametrize("variant", ["v2-greedy", "v3-noaux-yarn"])
def test_analytic_prefill_rank_weights_equal_the_prefill_rank_model(
    variant: str, tmp_path: Path
) -> None:
    save_hf(variant, tmp_path, vocab_size=163)  # uneven vocabulary shards
    full = load_model(tmp_path)
    c = full.config
    for tp, moe in itertools.product((1, 2, 4), MoeParallel):
        parallel = ParallelConfig(tp, moe=moe)
        held = []
        for rank in range(tp):
            coll = ThreadCollectives(ThreadGroup(tp), rank)  # building runs no collective
            model = PrefillRankModel(full, parallel, rank, Comm(tp, coll, coll))
            analytic = weight_bytes(prefill_rank_tensors(c, parallel, rank), "float32")
            assert analytic == model.parameter_bytes(), (tp, moe, rank)
            held.append(analytic)
        request = PlanRequest(Hardware(80 * GIB, 2), context=512, moe=moe, prefill_gpus=tp)
        assert build_plan(c, request).prefill_weights_bytes == max(
            weight_bytes(prefill_rank_tensors(c, parallel, r), "bfloat16") for r in range(tp)
        )
        assert held[0] == max(held)


def test_a_prefill_group_of_one_holds_the_whole_model() -> None:
    c = checkpoint_from_hf_dict(json.loads(V2_LITE.read_text())).config
    plan = build_plan(c, PlanRequest(Hardware(80 * GIB, 2), context=4096))
    assert plan.prefill_weights_bytes == plan.full_model_bytes
    assert plan.to_json()["prefill_weights_bytes_per_rank"] == plan.full_model_bytes


@pytest.mark.parametrize(
    ("weight_dtype", "gib", "fits"), [("float8", 81, True), ("bfloat16", 160, False)]
)
def test_deepseek_v3_prefills_on_8_h200s_only_in_fp8(
    weight_dtype: str, gib: float, fits: bool
) -> None:
    """One 8 x H200 prefill group: about 81 GiB a rank with FP8 kept FP8, 160 GiB in bf16."""
    ckpt = checkpoint_from_hf_dict(json.loads(V3.read_text()))
    request = PlanRequest(
        Hardware(141 * 10**9, 8),
        context=32768,
        weight_dtype=weight_dtype,
        fp8_block=ckpt.fp8_block,
        prefill_gpus=8,
    )
    out = build_plan(ckpt.config, request).to_json()
    assert out["prefill_weights_bytes_per_rank"] / GIB == pytest.approx(gib, rel=0.03)
    assert out["prefill_fits"] is fits
    # Split by vocabulary, the embedding is no longer whole on every rank: less than decode's.
    assert out["prefill_weights_bytes_per_rank"] < out["layouts"][0]["weights_bytes_per_rank"]


def test_prefill_gpus_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one GPU"):
        PlanRequest(Hardware(80 * GIB, 2), prefill_gpus=0)
