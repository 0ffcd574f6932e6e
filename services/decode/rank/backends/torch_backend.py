"""The reference decode backend: PyTorch ops on any device."""

from __future__ import annotations

from torch import Tensor, nn

from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.model.fp8 import Weight, linear
from common.model.mla import RMSNorm
from common.model.rope import RotaryEmbedding
from common.model.sp import partial_attention
from common.model.tpla import fused_slice_attention
from services.decode.rank.backends.interface import DecodeBackend
from services.decode.rank.layers import RankAttention, RankLayer


class TorchBackend(DecodeBackend):
    """Every piece in PyTorch: the reference the other backends are tested against, and
    what runs where no kernel does (any device, any dtype)."""

    name = "torch"

    def linear(self, x: Tensor, w: Weight) -> Tensor:
        return linear(x, w)

    def rms_norm(self, norm: RMSNorm, x: Tensor) -> Tensor:
        return norm(x)

    def ffn(self, module: nn.Module, x: Tensor) -> Tensor:
        return module(x)

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
        x = self.rms_norm(layer.input_norm, h)
        q_nope, q_pe = layer.attn.queries(x, rope, cos, sin, self.linear)
        n_new, k_pe_new = layer.attn.new_latent(x, rope, cos, sin, self.linear)
        cache.write(index, write_slots, n_new, k_pe_new)
        return q_nope, q_pe

    def attention(
        self,
        attn: RankAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
    ) -> Tensor:
        rows = cache.rows(index, reads.block_ids)
        return fused_slice_attention(
            q_nope,
            q_pe,
            rows.read,
            rows.total,
            cache.chunk_tokens(q_nope.shape[0]),
            reads.lengths,
            attn.w_uk,
            attn.w_uv,
            attn.scale,
            attn.shard.beta,
        )

    def partial_attention(
        self,
        q_lat: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if reads.slots is None or reads.valid is None:
            raise ValueError("an SP decode step reads per-token slots: use CacheReads.tokens")
        n, k_pe = cache.gather(index, reads.slots)
        return partial_attention(q_lat, q_pe, n, k_pe, reads.valid, scale)
