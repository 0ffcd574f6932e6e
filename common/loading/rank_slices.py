"""A rank's slices of one layer's weights, read from a `WeightSource` into the model's modules.

Decode ranks and prefill ranks both take their shares here, as `common/parallel.py` lays them
out: the norms (replicated), a dense MLP's or the shared experts' intermediate columns, a MoE
layer's routed experts (`rank_ffn`: a column slice of every expert, or whole experts) with
its float32 router replicated, and a head group's attention with the whole latent projection
(`head_attention`, MLA-TP). Each returns the whole model's module class, so one forward serves
the whole model and its shares; a linear weight the source keeps in FP8 takes its `nn.Linear`'s
place as an `Fp8Weight`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from common.loading.indexer_weights import load_indexer
from common.loading.weights import WeightSource
from common.model.causal_lm import DecoderLayer
from common.model.fp8 import Fp8Weight, Weight, held
from common.model.mla import MLAttention, RMSNorm
from common.model.moe import MLP, MoE
from common.parallel import ParallelConfig, span


def place_linear(module: nn.Module, name: str, w: Weight) -> None:
    """Weight `w` as `module.<name>`, an `nn.Linear` built on the meta device: a dense tensor
    becomes its weight, an FP8 weight takes the module's place."""
    if isinstance(w, Fp8Weight):
        setattr(module, name, w)
    else:
        getattr(module, name).weight = nn.Parameter(w)


def rank_norm(src: WeightSource, name: str, eps: float) -> RMSNorm:
    weight = src.tensor(name)
    with torch.device("meta"):
        norm = RMSNorm(weight.shape[0], eps)
    norm.weight = nn.Parameter(weight)
    return norm


def rank_mlp(src: WeightSource, prefix: str, cols: slice) -> MLP:
    """Rows `cols` of gate / up and columns `cols` of down (a slice of the intermediate dim)."""
    gate = src.linear(prefix + "gate_proj.weight", cols)
    with torch.device("meta"):
        local = MLP(gate.shape[1], gate.shape[0])
    place_linear(local, "gate_proj", gate)
    place_linear(local, "up_proj", src.linear(prefix + "up_proj.weight", cols))
    place_linear(local, "down_proj", src.linear(prefix + "down_proj.weight", cols=cols))
    return local


def rank_ffn(src: WeightSource, layer: int, parallel: ParallelConfig, rank: int) -> nn.Module:
    """Rank `rank`'s share of a dense MLP (1/tp of its intermediate dimension) or of a MoE:
    its routed experts and their columns (`ParallelConfig.owned_experts` /
    `expert_columns`: a slice of every expert, or whole experts), 1/tp of the shared experts'
    columns, the router replicated."""
    c = src.config
    p = f"model.layers.{layer}.mlp."
    if not c.is_moe_layer(layer):
        return rank_mlp(src, p, parallel.ffn_columns(rank, c.intermediate_size))
    cols = parallel.expert_columns(rank, c.moe_intermediate_size)
    experts = parallel.owned_experts(rank, c.n_routed_experts)
    with torch.device("meta"):
        local = MoE(dataclasses.replace(c, moe_intermediate_size=cols.stop - cols.start), experts)
    # The router runs in float32 whatever the serving dtype (its scores pick the experts), read
    # from the checkpoint's own values: bf16 rounding would move V3's correction bias.
    local.gate.weight = nn.Parameter(src.tensor(p + "gate.weight", dtype=torch.float32))
    if c.topk_method == "noaux_tc" and c.router_bias:
        bias = src.tensor(p + "gate.e_score_correction_bias", dtype=torch.float32)
        local.gate.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
    for name, w in (
        ("gate_up_proj", src.gate_up(p + "experts", cols, experts)),
        ("down_proj", src.down(p + "experts", cols, experts)),
    ):
        delattr(local.experts, name)
        setattr(local.experts, name, held(w))
    if c.n_shared_experts:
        cols = parallel.shared_expert_columns(rank, c.moe_intermediate_size, c.n_shared_experts)
        local.shared_experts = rank_mlp(src, p + "shared_experts.", cols)
    return local


def head_attention(src: WeightSource, layer: int, heads: slice) -> MLAttention:
    """The attention of heads `heads` over the whole latent (MLA-TP): their rows of the query
    projection and of kv_b_proj, their columns of o_proj, and the whole kv_a projection and
    norms, so every rank computes the same latent. `output` then gives a partial hidden
    state, summed over the ranks."""
    c = src.config
    p = f"model.layers.{layer}.self_attn."
    qk, kv = c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_nope_head_dim + c.v_head_dim
    with torch.device("meta"):
        attn = MLAttention(dataclasses.replace(c, num_attention_heads=span(heads)))
    q_rows = slice(heads.start * qk, heads.stop * qk)
    if c.q_lora_rank is None:
        place_linear(attn, "q_proj", src.linear(p + "q_proj.weight", q_rows))
    else:
        place_linear(attn, "q_a_proj", src.linear(p + "q_a_proj.weight"))
        attn.q_a_layernorm = rank_norm(src, p + "q_a_layernorm.weight", c.attention_norm_eps)
        place_linear(attn, "q_b_proj", src.linear(p + "q_b_proj.weight", q_rows))
    place_linear(attn, "kv_a_proj_with_mqa", src.linear(p + "kv_a_proj_with_mqa.weight"))
    attn.kv_a_layernorm = rank_norm(src, p + "kv_a_layernorm.weight", c.attention_norm_eps)
    kv_rows = slice(heads.start * kv, heads.stop * kv)
    place_linear(attn, "kv_b_proj", src.linear(p + "kv_b_proj.weight", kv_rows))
    o_cols = slice(heads.start * c.v_head_dim, heads.stop * c.v_head_dim)
    place_linear(attn, "o_proj", src.linear(p + "o_proj.weight", cols=o_cols))
    attn.indexer = load_indexer(src, layer)  # DSA: whole on every rank
    return attn


def head_layer(src: WeightSource, layer: int, parallel: ParallelConfig, rank: int) -> DecoderLayer:
    """Rank `rank`'s share of decoder layer `layer` under MLA-TP, as the whole model's
    `DecoderLayer`: its head group's attention (`head_attention`), its FFN slice (`rank_ffn`)
    and the norms."""
    c = src.config
    p = f"model.layers.{layer}."
    with torch.device("meta"):
        local = DecoderLayer(c, layer)
    local.input_layernorm = rank_norm(src, p + "input_layernorm.weight", c.rms_norm_eps)
    local.self_attn = head_attention(src, layer, parallel.heads(rank, c.num_attention_heads))
    local.post_attention_layernorm = rank_norm(
        src, p + "post_attention_layernorm.weight", c.rms_norm_eps
    )
    local.mlp = rank_ffn(src, layer, parallel, rank)
    if local.post_mlp_layernorm is not None:
        local.post_mlp_layernorm = rank_norm(src, p + "post_mlp_layernorm.weight", c.rms_norm_eps)
    return local
