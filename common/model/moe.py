"""Feed-forward blocks: the dense SwiGLU MLP and DeepSeek's MoE (routed + shared experts).

Routed experts are stored fused, as transformers 5 does: `gate_up_proj` [E, 2I, D] (gate
rows first) and `down_proj` [E, D, I]. The loader stacks per-expert hub checkpoints into it.
Under expert parallelism a rank's MoE holds a contiguous run of whole experts. Either stacked
tensor may be an `Fp8Weight` (common/model/fp8.py), multiplied in FP8 or dequantized a few
experts at a time. The slots are sorted by expert in common/model/expert_routing.py, the
kernels over them live in common/model/experts.py and fp8_experts.py, and which one a layer
runs is settled in experts_kernel.py.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.model.args import ModelConfig
from common.model.expert_routing import route
from common.model.experts import RoutedExperts
from common.model.experts_kernel import loop_reason, settle

log = logging.getLogger(__name__)


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
        if config.topk_method == "noaux_tc" and config.router_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(config.n_routed_experts), requires_grad=False
            )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, D] -> (weights [T, k] float32, expert ids [T, k])."""
        c = self.c
        if c.router_in_model_dtype:
            logits = F.linear(x, self.weight.to(x.dtype))
        else:
            logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if c.scoring_func == "softmax" else logits.sigmoid()
        k = c.num_experts_per_tok
        if c.topk_method == "greedy":
            weights, ids = scores.topk(k, dim=-1, sorted=False)
        else:
            choice = scores
            if c.topk_method == "noaux_tc" and c.router_bias:
                # The bias steers selection only; weights come from the unbiased scores.
                choice = scores + self.e_score_correction_bias.float()
            grouped = choice.view(x.shape[0], c.n_group, -1)
            if c.ranks_groups_by_top2:
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.amax(-1)
            keep = group_scores.topk(c.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            masked = grouped.masked_fill(~group_mask[..., None], float("-inf")).flatten(1)
            ids = masked.topk(k, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
        if c.norm_and_scale:
            if c.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            return (weights * c.routed_scaling_factor).float(), ids
        # DeepSeek-V2 rule: normalize *or* scale. HF-native DeepseekV2 always scales (ignores
        # norm_topk_prob); released V2 checkpoints set norm_topk_prob=false, where both agree.
        if k > 1 and c.norm_topk_prob:
            return weights / (weights.sum(-1, keepdim=True) + 1e-20), ids
        return weights * c.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed experts (all of them, or the run `experts` a rank holds under expert
    parallelism) plus the shared experts. The routed kernel follows the model's choice
    (`experts_kernel`, given by `use_experts_kernel`; grouped until then), settled for the
    weights as they are placed (`settle`), on the first call after a load or a move, never
    per call. `sized`: the routed rows are only the held slots, at one host read per call
    (a prefill model under expert parallelism: `size_to_held`); else every slot has a row
    and nothing is read back (a decode step's graph holds it)."""

    def __init__(self, config: ModelConfig, experts: slice | None = None) -> None:
        super().__init__()
        d, i = config.hidden_size, config.moe_intermediate_size
        held = experts or slice(0, config.n_routed_experts)
        self.first_expert, self.holds_all = held.start, held == slice(0, config.n_routed_experts)
        self.gate = Gate(config)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(held.stop - held.start, 2 * i, d))
        self.experts.down_proj = nn.Parameter(torch.empty(held.stop - held.start, d, i))
        self.shared_experts = (
            MLP(d, i * config.n_shared_experts) if config.n_shared_experts else None
        )
        # The choice (common/model/experts_kernel.py): triton | grouped | loop.
        self.experts_kernel = "grouped"
        self.sized = False
        self._kernel: RoutedExperts | None = None

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> MoE:
        # .to() / .cuda() / .half() move or cast the weights: pick the kernel again for them.
        self._kernel = None
        return super()._apply(fn, recurse)

    def loop_reason(self) -> str | None:
        """Why the held experts run the per-expert loop, or None: grouped GEMMs."""
        e = self.experts
        return loop_reason(self.experts_kernel, e.gate_up_proj, e.down_proj)

    def use_kernel(self, kernel: str) -> str:
        """Run the routed experts on `kernel` (triton | grouped | loop), settled now for
        the weights as placed; says what runs ("grouped", "loop: why", ...)."""
        self.experts_kernel = kernel
        self._kernel, how = settle(kernel, self.experts.gate_up_proj, self.experts.down_proj)
        return how

    @property
    def kernel(self) -> RoutedExperts:
        if self._kernel is None:
            self.use_kernel(self.experts_kernel)
        assert self._kernel is not None
        return self._kernel

    def routed(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The held experts' share of the routed output for x [T, D], ids / weights [T, k]."""
        e, kernel = self.experts, self.kernel
        r = route(ids, weights, e.gate_up_proj.shape[0], self.first_expert, self.sized)
        return kernel(x, r, e.gate_up_proj, e.down_proj)

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = self.gate(x)
        out = self.routed(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def use_experts_kernel(model: nn.Module, kernel: str) -> dict[str, str]:
    """Give every MoE layer of `model` (placed on its device) the routed experts' kernel the
    model was given (`select_experts_kernel`: triton | grouped | loop), settled now;
    logs how many layers run each and how. Returns, per layer, what runs ("triton (FP8 blocks)",
    "grouped", "loop: why", ...)."""
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            chosen[name] = module.use_kernel(kernel)
    if chosen:
        counts = Counter(chosen.values())
        log.info("MoE experts: %s", "; ".join(f"{c} x {how}" for how, c in counts.items()))
    return chosen


def size_to_held(model: nn.Module) -> None:
    """Size the routed rows of `model`'s MoE layers that hold some experts only (expert
    parallelism) to the slots they hold: a prefill model's, where a host read per layer
    costs nothing next to the chunk and T * k rows on every rank would cost memory."""
    for module in model.modules():
        if isinstance(module, MoE) and not module.holds_all:
            module.sized = True
