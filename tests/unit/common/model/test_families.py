"""The family registry (common/model/families.py): every model_type served maps to one family,
an unknown one is refused naming those served, and a family fills in its own defaults."""

from __future__ import annotations

import pytest

from common.model.args import ConfigError, ModelConfig
from common.model.families import FAMILIES, UnknownFamily, family_of, model_types


def test_each_model_type_has_one_family() -> None:
    assert len(model_types()) == len(set(model_types()))
    for family in FAMILIES:
        for model_type in family.model_types:
            assert family_of(model_type) is family
    with pytest.raises(UnknownFamily, match=r"'llama' is not one of .*deepseek_v3"):
        family_of("llama")


def test_a_family_fills_in_its_defaults_and_a_null_is_a_default() -> None:
    assert family_of("deepseek_v2").normalize({"scoring_func": None})["scoring_func"] == "softmax"
    v3 = family_of("deepseek_v3").normalize({"topk_method": None, "n_group": 8})
    assert (v3["topk_method"], v3["scoring_func"], v3["n_group"]) == ("noaux_tc", "sigmoid", 8)
    # A checkpoint's own value wins over the family's default.
    assert family_of("deepseek_v3").normalize({"scoring_func": "softmax"})["scoring_func"] == (
        "softmax"
    )


def test_the_config_parser_refuses_an_unknown_family() -> None:
    with pytest.raises(ConfigError, match="model_type 'mistral' is not one of"):
        ModelConfig.from_hf_dict({"model_type": "mistral"})


def _dsa_raw(model_type: str, **extra: object) -> dict[str, object]:
    return {
        "model_type": model_type,
        "vocab_size": 160,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "q_lora_rank": 24,
        **extra,
    }


def test_deepseek_v32_runs_an_indexer_in_every_layer_with_its_rope_in_halves() -> None:
    c = ModelConfig.from_hf_dict(_dsa_raw("deepseek_v32", index_head_dim=16))
    assert c.dsa is not None
    assert c.dsa.layer_types == ("full",) * 4
    assert (c.dsa.index_topk, c.dsa.index_n_heads, c.dsa.rope_interleave) == (2048, 64, False)
    assert c.rope_interleave and c.attention_norm_eps == 1e-6
    assert (c.topk_method, c.scoring_func, c.first_k_dense_replace) == ("noaux_tc", "sigmoid", 3)


def test_glm5_shares_selections_interleaves_its_indexer_rope_and_keeps_its_eps() -> None:
    c = ModelConfig.from_hf_dict(
        _dsa_raw("glm_moe_dsa", index_head_dim=16, index_topk_freq=2, rms_norm_eps=None)
    )
    assert c.dsa is not None
    assert c.dsa.layer_types == ("full", "full", "shared", "full")
    assert (c.dsa.index_n_heads, c.dsa.rope_interleave) == (32, True)
    assert (c.rms_norm_eps, c.attention_norm_eps) == (1e-5, 1e-6)


def test_a_dsa_config_the_engine_cannot_serve_is_refused() -> None:
    with pytest.raises(ConfigError, match="q-LoRA"):
        ModelConfig.from_hf_dict(_dsa_raw("deepseek_v32", q_lora_rank=None))
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        ModelConfig.from_hf_dict(_dsa_raw("deepseek_v32", mlp_layer_types=["sparse"] * 4))
    with pytest.raises(ConfigError, match="first layer"):
        ModelConfig.from_hf_dict(_dsa_raw("glm_moe_dsa", index_topk_pattern="SFFF"))
