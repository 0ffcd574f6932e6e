"""`tpla plan`'s planner on every family's reference config (models/reference-configs): each
parses through its family and plans on 8 x H200 in every layout, or says why not (GLM-4.7-
Flash's 20 heads do not split over 8 ranks: the error names the head groups that do); Kimi's
INT4 experts counted at their size, held equal to what a rank keeps of a tiny INT4 checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.loading.serving_model import open_serving_weights
from common.model.int4 import Int4Weight
from common.parallel import ParallelConfig, ParallelError, ParallelMode
from common.tpla.capacity_plan import (
    GIB,
    Hardware,
    PlanRequest,
    build_plan,
    checkpoint_from_hf_dict,
)
from common.tpla.rank_memory import rank_tensors, weight_bytes
from services.decode.rank.rank_model import RankModel
from tests.tiny_families import save_kimi_int4

CONFIGS = sorted(
    Path(__file__).parents[4].joinpath("models/reference-configs").glob("*/config.json")
)
H200 = 141 * GIB


def _plan(path: Path, gpus: int):
    ckpt = checkpoint_from_hf_dict(json.loads(path.read_text()))
    request = PlanRequest(
        hardware=Hardware(gpu_mem_bytes=H200, gpus_per_group=gpus),
        latent_groups=(2,),
        context=32768,
        kv_dtype="bfloat16",
        weight_dtype="float8",
        fp8_block=ckpt.fp8_block,
    )
    return build_plan(ckpt.config, request)


def test_every_family_has_a_reference_config() -> None:
    assert {p.parent.name for p in CONFIGS} >= {
        "kimi-k2.6",
        "glm-4.7-flash",
        "mistral-small-4-119b",
        "sarvam-105b",
        "a.x-k1",
        "youtu-llm-2b",
    }


@pytest.mark.parametrize(
    "path", [p for p in CONFIGS if p.parent.name != "glm-4.7-flash"], ids=lambda p: p.parent.name
)
def test_a_family_plans_on_8_h200(path: Path) -> None:
    plan = _plan(path, 8)
    assert any(row.fits for row in plan.layouts)


def test_glm_names_the_tp_values_its_heads_split_over() -> None:
    path = next(p for p in CONFIGS if p.parent.name == "glm-4.7-flash")
    with pytest.raises(
        ParallelError, match=r"head groups that split 20 heads: \[1, 2, 4, 5, 10, 20\]"
    ):
        _plan(path, 8)
    assert any(row.fits for row in _plan(path, 4).layouts)


def test_kimis_int4_experts_count_at_4_bits() -> None:
    """The plan reads the checkpoint's quantization_config: Kimi K2.6's routed experts at 4
    bits a value plus a bf16 scale per 32, the rest (attention, shared experts, dense
    layer) in bf16 as the checkpoint stores them."""
    path = next(p for p in CONFIGS if p.parent.name == "kimi-k2.6")
    ckpt = checkpoint_from_hf_dict(json.loads(path.read_text()))
    assert (ckpt.quant_method, ckpt.int4_group) == ("compressed-tensors", 32)
    hardware = Hardware(gpu_mem_bytes=H200, gpus_per_group=8)
    plans = {
        dtype: build_plan(
            ckpt.config,
            PlanRequest(hardware=hardware, weight_dtype=dtype, int4_group=ckpt.int4_group),
        )
        for dtype in ("quantized", "float8", "bfloat16")
    }
    parts = {dtype: dict(plan.breakdown) for dtype, plan in plans.items()}
    assert parts["quantized"] == parts["float8"]
    experts = parts["quantized"].pop("routed_experts")
    assert experts / parts["bfloat16"].pop("routed_experts") == (0.5 + 2 / 32) / 2
    assert parts["quantized"] == parts["bfloat16"]
    assert all(row.fits for row in plans["quantized"].layouts)


def test_int4_resident_rank_model_holds_the_planned_bytes(tmp_path: Path) -> None:
    """What a rank keeps of a tiny Kimi-K2.6-shaped INT4 checkpoint (TPLA_WEIGHT_DTYPE=
    quantized) is what the plan counts, in every layout at tp = 2."""
    save_kimi_int4(tmp_path)
    weights, _ = open_serving_weights(tmp_path, None, "bfloat16", weight_dtype="quantized")
    c = weights.config
    for tp, r, mode in [(2, 1, "tpla"), (2, 2, "tpla"), (2, 1, "sp")]:
        parallel = ParallelConfig(tp, r, mode=ParallelMode(mode))
        for rank in range(tp):
            model = RankModel(weights, parallel, rank)
            assert isinstance(model.layers[1].ffn.experts.gate_up_proj, Int4Weight)
            planned = weight_bytes(rank_tensors(c, parallel, rank), "quantized", (128, 128), 16)
            assert model.parameter_bytes() == planned, (tp, r, mode, rank)
