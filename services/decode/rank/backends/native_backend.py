"""The native decode backend: the C++ kernels of `common/native` (fp32 CPU).

Attention reads the paged cache in place (`latent_attention.cpp`); a layer's attention inputs
are one call instead of ~45 torch ops (`decode_layer.cpp`); linears over a few rows, the MLP
and a MoE layer's routed experts run in `small_gemm.cpp` (BLAS packs the weight for every
skinny product). Each is tested equal to the torch backend. FP8-resident weights run on the
torch path, dequantized a bounded part at a time (a linear's rows, a group of experts: see
common/model/fp8.py); a layer whose attention inputs are FP8 computes them there too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.model.fp8 import DequantizedOnUse, Weight, linear
from common.model.mla import RMSNorm
from common.model.moe import MoE
from common.model.rope import RotaryEmbedding
from common.native import decode_layer, latent_attention, small_gemm
from services.decode.rank.backends.torch_backend import TorchBackend
from services.decode.rank.layers import RankAttention, RankLayer


class NativeBackend(TorchBackend):
    """The C++ kernels; SP partial attention stays on the torch path (no native kernel)."""

    name = "native"

    def __init__(self) -> None:
        self._inputs: list[decode_layer.AttentionInputs | None] = []

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu" or dtype != torch.float32:
            return f"the native kernels run fp32 on the CPU, not {dtype} on {device}"
        for lib in (latent_attention, decode_layer, small_gemm):
            if not lib.available():
                return f"{lib.__name__} cannot be built or loaded here"
        return None

    def bind(self, layers: Sequence[RankLayer], rope: RotaryEmbedding) -> None:
        # The native call binds its weights once: it cannot take weights dequantized per use.
        self._inputs = [
            None
            if any(isinstance(m, DequantizedOnUse) for m in layer.attn.modules())
            else decode_layer.AttentionInputs(_layer_weights(layer, rope))
            for layer in layers
        ]

    def linear(self, x: Tensor, w: Weight) -> Tensor:
        # A quantized weight applies itself (an FP8 one a bounded run of rows at a time).
        return linear(x, w) if isinstance(w, DequantizedOnUse) else small_gemm.linear(x, w)

    def rms_norm(self, norm: RMSNorm, x: Tensor) -> Tensor:
        return decode_layer.rms_norm(x, norm.weight, norm.eps)

    def ffn(self, module: nn.Module, x: Tensor) -> Tensor:
        if isinstance(module, MoE):
            weights, ids = module.gate(x)
            experts = module.experts
            # The kernel runs every slot it is given; under expert parallelism most slots
            # are other ranks', which `routed` skips. It takes a rank's experts whole: quantized
            # ones run `routed`, which dequantizes a bounded group of them at a time.
            out = None
            gate_up, down = experts.gate_up_proj, experts.down_proj
            if module.holds_all and not isinstance(gate_up, DequantizedOnUse):
                assert not isinstance(down, DequantizedOnUse)  # both quantized, or neither
                out = small_gemm.moe_experts(x, ids, weights, gate_up, down)
            if out is None:
                out = module.routed(x, ids, weights)
            if module.shared_experts is not None:
                out = out + self.ffn(module.shared_experts, x)
            return out
        if isinstance(module.gate_proj, DequantizedOnUse):
            return module(x)  # its FP8 linears, each a bounded run of rows at a time
        return small_gemm.mlp(
            x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight
        )

    def attention_inputs(
        self,
        index: int,
        layer: RankLayer,
        rope: RotaryEmbedding,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: PagedLatentCache,
        write_slots: Tensor,
    ) -> tuple[Tensor, Tensor]:
        inputs = self._inputs[index]
        if inputs is None:
            return super().attention_inputs(index, layer, rope, h, cos, sin, cache, write_slots)
        return inputs(h, cos, sin, cache.kv[index], write_slots)

    def attention(
        self,
        attn: RankAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
    ) -> Tensor:
        return latent_attention.paged_latent_attention(
            q_nope.contiguous(),
            q_pe.contiguous(),
            cache.kv[index],
            reads.block_ids,
            reads.lengths,
            cache.layout.block_size,
            attn.w_uk,
            attn.w_uv,
            attn.scale,
            attn.shard.beta,
        )


def _layer_weights(layer: RankLayer, rope: RotaryEmbedding) -> decode_layer.LayerWeights:
    """A rank layer's attention-input weights as the native call binds them: in exact
    RMSNorm mode the whole small latent projection (normalized exactly, this rank's columns
    kept), in sliced mode only the slice's rows."""
    a, norm = layer.attn, layer.input_norm
    s = a.shard
    exact = a.exact_rmsnorm
    return decode_layer.LayerWeights(
        norm=norm.weight.detach(),
        eps=norm.eps,
        q_a=None if a.q_a is None else a.q_a.detach(),
        q_a_norm=None if a.q_a_norm is None else a.q_a_norm.weight.detach(),
        q_a_eps=0.0 if a.q_a_norm is None else a.q_a_norm.eps,
        q_b=a.q_b.detach(),
        kv_latent=a.kv_a_latent.detach(),
        kv_rope=a.kv_a_rope.detach(),
        kv_norm=a.gamma.detach()[s.start : s.end],
        kv_eps=a.eps,
        latent_offset=s.start if exact else 0,
        rms_correction=1.0 if exact else s.rms_correction,
        heads=a.num_heads,
        d_n=a.d_n,
        d_r=a.d_r,
        interleaved=rope.interleaved,
    )
