"""Feed-forward blocks: the dense SwiGLU MLP and DeepSeek's MoE (routed + shared experts).

Routed experts are stored fused, as transformers 5 does: `gate_up_proj` [E, 2I, D] (gate
rows first) and `down_proj` [E, D, I]. The loader stacks per-expert hub checkpoints into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.model.args import ModelConfig


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Router: scores experts and picks top-k with DeepSeek's three gating algorithms."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(config.n_routed_experts), requires_grad=False
            )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, D] -> (weights [T, k] float32, expert ids [T, k])."""
        c = self.c
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if c.scoring_func == "softmax" else logits.sigmoid()
        k = c.num_experts_per_tok
        if c.topk_method == "greedy":
            weights, ids = scores.topk(k, dim=-1, sorted=False)
        else:
            choice = scores
            if c.topk_method == "noaux_tc":
                # The bias steers selection only; weights come from the unbiased scores.
                choice = scores + self.e_score_correction_bias.float()
            grouped = choice.view(x.shape[0], c.n_group, -1)
            if c.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.amax(-1)
            keep = group_scores.topk(c.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            masked = grouped.masked_fill(~group_mask[..., None], float("-inf")).flatten(1)
            ids = masked.topk(k, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
        if c.topk_method == "noaux_tc":
            if c.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            return weights * c.routed_scaling_factor, ids
        # DeepSeek-V2 rule: normalize *or* scale. HF-native DeepseekV2 always scales (ignores
        # norm_topk_prob); released V2 checkpoints set norm_topk_prob=false, where both agree.
        if k > 1 and c.norm_topk_prob:
            return weights / (weights.sum(-1, keepdim=True) + 1e-20), ids
        return weights * c.routed_scaling_factor, ids


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = Gate(config)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.experts.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.shared_experts = (
            MLP(d, i * config.n_shared_experts) if config.n_shared_experts else None
        )

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = self.gate(x)
        out = routed_experts(x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def routed_experts(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x_t) for x [T, D], ids / weights [T, k],
    gate_up [E, 2I, D] (gate rows first), down [E, D, I] -> [T, D]."""
    out = torch.zeros_like(x)
    # Group tokens by expert so each expert runs one matmul over the tokens routed to it.
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // ids.shape[1]
    w_sorted = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tok = token_of[start : start + count]
        gate, up = F.linear(x[tok], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, tok, (y * w_sorted[start : start + count, None]).to(x.dtype))
        start += count
    return out
