"""Gating rules checked against a direct computation, including where HF-native V2 differs;
a MoE layer settles its routed experts' kernel once per placement, and a layer holding some
experts (sized to its slots or not) gives its share of the whole layer."""

from __future__ import annotations

import dataclasses

import torch

from common.model.args import ModelConfig
from common.model.experts import grouped_experts, routed_experts
from common.model.moe import Gate, MoE, size_to_held, use_experts_kernel

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


EXPERTS = dataclasses.replace(
    CFG, hidden_size=32, moe_intermediate_size=16, num_experts_per_tok=2, n_shared_experts=1
)


def _moe(config: ModelConfig = EXPERTS, held: slice | None = None) -> MoE:
    moe = MoE(config, held)
    g = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=g)
    return moe


def test_moe_picks_its_kernel_once_and_again_after_a_cast() -> None:
    moe = _moe()
    x = torch.randn(4, 32)
    out = moe(x)
    assert moe.kernel is grouped_experts
    moe.double()
    assert moe.kernel is routed_experts  # no float64 grouped_mm: the loop, picked anew
    torch.testing.assert_close(moe(x.double()).float(), out, atol=1e-5, rtol=1e-5)


def test_the_model_runs_the_chosen_experts_kernel() -> None:
    model = torch.nn.ModuleDict({"layer": _moe()})
    layer = model["layer"]
    x = torch.randn(4, 32)
    grouped = layer(x)
    assert use_experts_kernel(model, "loop") == {
        "layer": "loop: the loop was chosen (TPLA_EXPERTS_KERNEL)"
    }
    assert layer.kernel is routed_experts
    torch.testing.assert_close(layer(x), grouped, atol=1e-5, rtol=1e-5)
    layer.float()  # a move keeps the choice
    assert layer.kernel is routed_experts
    assert use_experts_kernel(model, "grouped") == {"layer": "grouped"}
    assert layer.kernel is grouped_experts
    # Weights that are not quantized run grouped under triton, without a word about it.
    assert use_experts_kernel(model, "triton") == {"layer": "grouped"}
    assert layer.kernel is grouped_experts and layer.loop_reason() is None


def test_a_moe_holding_some_experts_routes_the_rest_elsewhere() -> None:
    whole = _moe()
    x = torch.randn(6, 32)
    weights, ids = whole.gate(x)
    want = whole.routed(x, ids, weights)
    for sized in (False, True):
        halves = []
        for held in (slice(0, 3), slice(3, 8)):
            part = MoE(dataclasses.replace(EXPERTS, n_shared_experts=0), held)
            part.experts.gate_up_proj.data = whole.experts.gate_up_proj.data[held]
            part.experts.down_proj.data = whole.experts.down_proj.data[held]
            assert not part.holds_all and part.first_expert == held.start
            if sized:
                size_to_held(part)
            assert part.sized == sized
            halves.append(part.routed(x, ids, weights))
        torch.testing.assert_close(halves[0] + halves[1], want)
    size_to_held(whole)  # a layer holding every expert has no slot to leave out
    assert not whole.sized
