"""Gating rules checked against a direct computation, including where HF-native V2 differs."""

from __future__ import annotations

import dataclasses

import torch

from common.model.args import ModelConfig
from common.model.moe import Gate

CFG = ModelConfig(
    model_type="deepseek_v2",
    vocab_size=8,
    hidden_size=16,
    intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
    n_routed_experts=8,
    moe_intermediate_size=4,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.0,
)


def _gate(**changes: object) -> Gate:
    gate = Gate(dataclasses.replace(CFG, **changes))
    torch.nn.init.normal_(gate.weight, std=1.0, generator=torch.Generator().manual_seed(0))
    return gate


def test_v2_norm_topk_prob_normalizes_instead_of_scaling() -> None:
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    scaled_w, ids = _gate()(x)
    norm_w, ids2 = _gate(norm_topk_prob=True)(x)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(norm_w.sum(-1), torch.ones(5))
    torch.testing.assert_close(norm_w, scaled_w / scaled_w.sum(-1, keepdim=True))


def test_group_limited_greedy_picks_only_from_top_groups() -> None:
    gate = _gate(topk_method="group_limited_greedy")
    x = torch.randn(50, 16, generator=torch.Generator().manual_seed(2))
    _, ids = gate(x)
    scores = (x @ gate.weight.T).softmax(-1)
    top_groups = scores.view(50, 4, 2).amax(-1).topk(2, dim=-1).indices
    for row in range(50):
        assert set((ids[row] // 2).tolist()) <= set(top_groups[row].tolist())


def test_noaux_bias_steers_choice_not_weights() -> None:
    gate = _gate(
        model_type="deepseek_v3",
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
    )
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gate.e_score_correction_bias.fill_(-10.0)
        gate.e_score_correction_bias[[5, 6, 7]] = 10.0
    weights, ids = gate(x)
    assert all(set(r) == {5, 6, 7} for r in ids.tolist())
    torch.testing.assert_close(weights, (x @ gate.weight.T).sigmoid().gather(1, ids))
