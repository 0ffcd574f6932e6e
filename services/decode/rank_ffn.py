"""How a decode rank runs its feed-forward slice (cut by `rank_model._shard_ffn`).

`MLP.forward` / `MoE.forward` with the decode-sized products of `common.native.small_gemm`
when the native kernels are in use; `module(x)` is the reference.
"""

from __future__ import annotations

from torch import Tensor, nn

from common.model.moe import MoE
from common.native import small_gemm


def ffn_forward(module: nn.Module, x: Tensor, native: bool) -> Tensor:
    """`module(x)` for a rank's MLP or MoE slice; `native` runs its products natively."""
    if not native:
        return module(x)
    if isinstance(module, MoE):
        weights, ids = module.gate(x)
        experts = module.experts
        out = small_gemm.moe_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj)
        if module.shared_experts is not None:
            out = out + ffn_forward(module.shared_experts, x, native)
        return out
    return small_gemm.mlp(
        x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight
    )
