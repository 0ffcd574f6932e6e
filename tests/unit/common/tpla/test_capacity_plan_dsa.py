"""`tpla plan` for DeepSeek Sparse Attention models: a rank's indexers (whole on every rank,
weights_proj in float32) are the engine's bytes, the indexer keys are in the KV bytes as the
decode rank's two pools hold them, and the published V3.2 and GLM-5 configs plan."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from common.loading.loader import load_model
from common.parallel import ParallelConfig, ParallelMode
from common.tpla.capacity_plan import (
    GIB,
    Hardware,
    PlanRequest,
    build_plan,
    checkpoint_from_hf_dict,
)
from common.tpla.rank_memory import (
    index_key_bytes,
    kv_bytes_per_stored_token,
    rank_tensors,
    weight_bytes,
)
from services.decode.rank.rank_model import RankModel
from tests.tiny import save_hf

CONFIGS = Path(__file__).resolve().parents[4] / "models" / "reference-configs"
LAYOUTS = [ParallelConfig(2), ParallelConfig(2, 2), ParallelConfig(2, mode=ParallelMode.SP)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rank_weights_and_kv_bytes_are_the_engines(tmp_path: Path, dtype: str) -> None:
    save_hf("glm-shared", tmp_path, vocab_size=163)
    full = load_model(tmp_path, dtype=dtype)
    c = full.config
    torch_dtype = getattr(torch, dtype)
    for layout, rank in itertools.product(LAYOUTS, range(2)):
        model = RankModel(full, layout, rank)
        assert weight_bytes(rank_tensors(c, layout, rank), dtype) == model.parameter_bytes()
        pools = [model.cache_layout(4, torch_dtype)]
        for fmt in ("model", "fp8"):
            keys = model.index_layout(4, fmt, torch_dtype)
            assert keys is not None
            stored = sum(p.bytes_per_token_per_layer * p.num_layers for p in [*pools, keys])
            assert kv_bytes_per_stored_token(c, layout, dtype, 0, fmt) == stored


@pytest.mark.parametrize(
    ("name", "full_layers", "heads", "key_bytes"),
    [("deepseek-v3.2", 61, 64, 61 * 128 * 2), ("glm-5", 78, 32, 78 * 128 * 2)],
)
def test_the_published_configs_plan(
    name: str, full_layers: int, heads: int, key_bytes: int
) -> None:
    ckpt = checkpoint_from_hf_dict(json.loads((CONFIGS / name / "config.json").read_text()))
    c = ckpt.config
    assert c.dsa is not None and c.dsa.index_topk == 2048 and c.dsa.index_n_heads == heads
    assert c.dsa.key_layers(c.num_hidden_layers) == full_layers and ckpt.mtp_layers == 1
    assert index_key_bytes(c, "bfloat16") == key_bytes
    assert index_key_bytes(c, "bfloat16", index_cache_dtype="fp8") == full_layers * 132
    for context in (32768, 131072):
        request = PlanRequest(
            Hardware(141 * GIB, 8), (2, 4), context, weight_dtype="float8", fp8_block=ckpt.fp8_block
        )
        plan = build_plan(c, request)
        assert all(p.fits and p.max_sequences > 0 for p in plan.layouts)
        assert dict(plan.breakdown)["indexer"] > 0
