"""DSA's per-layer indexer types (common/model/dsa_config.py): derived exactly as HF's
GlmMoeDsaConfig derives them, and the index-key pool's rows numbering the full layers."""

from __future__ import annotations

from typing import Any

import pytest

from common.model.dsa_config import DsaConfig, DsaConfigError, indexer_types


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"index_topk_freq": 2},
        {"index_topk_freq": 3, "index_skip_topk_offset": 1},
        {"index_topk_freq": 4, "index_skip_topk_offset": 5},
        {"index_topk_freq": 0},
        {"index_topk_pattern": "FFSSFSFS"},
        {"index_topk_pattern": ["full", "shared"] * 4},
        {"indexer_types": ["full"] * 2 + ["shared", "full"] * 3, "index_topk_freq": 2},
    ],
)
def test_indexer_types_are_hfs(extra: dict[str, Any]) -> None:
    from transformers import GlmMoeDsaConfig

    hf = GlmMoeDsaConfig(num_hidden_layers=8, **extra)
    assert indexer_types({"num_hidden_layers": 8, **extra}, 8) == hf.indexer_types


def test_key_layers_number_full_layers_and_mtp_layers_are_full() -> None:
    dsa = DsaConfig(8, 4, 16, True, ("full", "full", "shared", "full"))
    assert [dsa.is_full(n) for n in range(5)] == [True, True, False, True, True]
    assert [dsa.key_layer(n) for n in (0, 1, 3, 4)] == [0, 1, 2, 3]
    assert dsa.key_layers(5) == 4
    with pytest.raises(ValueError, match="keeps no indexer keys"):
        dsa.key_layer(2)


def test_a_shared_first_layer_is_refused() -> None:
    with pytest.raises(DsaConfigError, match="first layer"):
        DsaConfig(8, 4, 16, True, ("shared", "full"))
