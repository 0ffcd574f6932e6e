"""compressed-tensors' pack-quantized INT4 in the checkpoint reader and the weight source:
dequantize-at-load is the HF model's values, a kept INT4 expert dequantizes on use to exactly
the same, a rank's share is the slice of the whole, and what the loader cannot read is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.loading.checkpoint import CheckpointError, CheckpointReader, UnsupportedQuantization
from common.loading.loader import load_model
from common.loading.model_builder import build_model
from common.loading.weights import CheckpointWeights
from common.model.int4 import Int4Weight
from tests.tiny_families import save_kimi_int4

EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("kimi-int4")
    return save_kimi_int4(path), path


def test_the_reader_lists_an_int4_weight_by_its_name(kimi) -> None:
    _, path = kimi
    reader = CheckpointReader(path)
    name = "language_model." + EXPERTS + ".3.down_proj.weight"
    assert reader.tensors[name].shape == (64, 32) and name in reader.int4
    assert reader.is_scale(name + "_packed") and reader.is_scale(name + "_scale")
    whole = reader.read(name, dtype=torch.float32)
    torch.testing.assert_close(
        reader.read(name, (slice(2, 9), slice(16, 32)), dtype=torch.float32),
        whole[2:9, 16:32],
        rtol=0,
        atol=0,
    )
    with pytest.raises(CheckpointError, match="cut INT4 groups of 16"):
        reader.read(name, (slice(None), slice(8, 24)), dtype=torch.float32)


def test_kept_int4_experts_equal_dequantize_at_load(kimi) -> None:
    hf, path = kimi
    loaded = load_model(path)
    kept = build_model(CheckpointWeights(path, torch.float32, keep_fp8=True))
    assert isinstance(kept.model.layers[1].mlp.experts.gate_up_proj, Int4Weight)
    ids = torch.randint(2, 160, (23,), generator=torch.Generator().manual_seed(0))
    a = loaded.prefill(ids, [23], all_logits=True).logits
    assert torch.equal(kept.prefill(ids, [23], all_logits=True).logits, a)
    with torch.no_grad():
        torch.testing.assert_close(a, hf(ids[None]).logits[0], atol=1e-4, rtol=0)


def test_a_ranks_int4_share_is_its_slice(kimi) -> None:
    _, path = kimi
    src = CheckpointWeights(path, torch.float32, keep_fp8=True)
    whole = CheckpointWeights(path, torch.float32)
    cols, experts = slice(16, 32), slice(2, 6)
    gate_up = src.gate_up(EXPERTS, cols, experts)
    down = src.down(EXPERTS, cols, experts)
    assert isinstance(gate_up, Int4Weight) and isinstance(down, Int4Weight)
    assert torch.equal(gate_up.dequantize(), whole.gate_up(EXPERTS, cols, experts))
    assert torch.equal(down.dequantize(), whole.down(EXPERTS, cols, experts))


def test_an_unsupported_scheme_is_named(kimi, tmp_path: Path) -> None:
    _, path = kimi
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedQuantization, match="only symmetric 4-bit integer weights"):
        CheckpointReader(tmp_path)
