"""`tpla plan`'s planner on every family's reference config (models/reference-configs): each
parses through its family and plans on 8 x H200 in every layout, or says why not (GLM-4.7-
Flash's 20 heads do not split over 8 ranks: the error names the head groups that do)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.parallel import ParallelError
from common.tpla.capacity_plan import (
    GIB,
    Hardware,
    PlanRequest,
    build_plan,
    checkpoint_from_hf_dict,
)

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
