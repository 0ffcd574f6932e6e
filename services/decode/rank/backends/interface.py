"""The decode backend: how a rank runs the pieces of its decode step (DESIGN §5).

`RankModel.decode_step` is device-generic PyTorch that calls a backend for everything a
kernel can speed up: a layer's attention inputs (norm, projections, rotary embeddings, the
new token's cache write), attention over the paged latent cache (TPLA / MLA-TP shard
attention with beta; SP partial attention with the max / sum its log-sum-exp merge needs),
the small linears and the FFN / MoE experts. One backend is chosen per rank at start-up
(`select_decode_kernel`); the step itself holds no kernel flags.

Implementations: `torch` (the reference, any device), `native` (C++ kernels, fp32 CPU) and
`triton` (paged attention kernel; GPUs, or the CPU under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor, nn

from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.model.fp8 import Weight
from common.model.mla import RMSNorm
from common.model.rope import RotaryEmbedding
from services.decode.rank.layers import RankAttention, RankLayer


class DecodeBackend(abc.ABC):
    """The kernels of one rank's decode step. A backend may bind per-layer state to the
    layers it serves (`bind`), so an instance serves one rank's model."""

    name: ClassVar[str]

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run a rank on `device` in `dtype`, or None if it can:
        the one check behind `select_decode_kernel`."""
        return None

    def bind(  # noqa: B027 - optional hook
        self, layers: Sequence[RankLayer], rope: RotaryEmbedding
    ) -> None:
        """Prepare per-layer state once the layers' weights sit on their device (`rope`: the
        model's rotary tables, on the same device)."""

    @abc.abstractmethod
    def linear(self, x: Tensor, w: Weight) -> Tensor:
        """`F.linear(x, w)` for the step's few rows (an FP8 weight dequantized first)."""

    @abc.abstractmethod
    def rms_norm(self, norm: RMSNorm, x: Tensor) -> Tensor:
        """`norm(x)` for rows x [B, D]."""

    @abc.abstractmethod
    def ffn(self, module: nn.Module, x: Tensor) -> Tensor:
        """`module(x)` for a rank's slice of a dense MLP or of a MoE layer's experts."""

    @abc.abstractmethod
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
        """Layer `index`'s queries q_nope [B, h, d_n], rotated q_pe [B, h, d_r] from the
        hidden state h [B, D]; writes each new token's latent slice and k_pe into the cache
        at write_slots [B], every row (a row not to be stored names the cache's trash
        slot)."""

    @abc.abstractmethod
    def attention(
        self,
        attn: RankAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
    ) -> Tensor:
        """TPLA / MLA-TP: W_UV^h[:, S_i] u^h_i as [B, h, d_v] over the rank's latent slice
        of layer `index`, read in place through `reads.block_ids` / `reads.lengths`."""

    @abc.abstractmethod
    def partial_attention(
        self,
        q_lat: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """SP: every head's absorbed query q_lat [B, H, d_c], q_pe [B, H, d_r] over this
        rank's tokens -> (u [B, H, d_c], m [B, H], l [B, H]) as `common.model.sp.
        partial_attention` defines them: u / l is the rank's attention output, m the score
        scale u and l are relative to (-inf where the rank holds none of a sequence)."""
