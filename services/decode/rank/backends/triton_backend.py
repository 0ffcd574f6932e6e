"""The Triton decode backend: paged TPLA / MLA-TP / SP attention in one Triton kernel.

Attention reads the rank's latent slice in place through the block tables (no gathered
copy) with split-KV and a log-sum-exp merge (`common/triton_kernels/decode_attention.py`);
the rest of the step is the torch backend's device-generic PyTorch. It runs on CUDA, and on
the CPU under Triton's interpreter (`TRITON_INTERPRET=1`), which is how the tests run it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.model.tpla import absorbed_queries
from common.triton_kernels import decode_attention, triton_mode
from services.decode.rank.backends.torch_backend import TorchBackend
from services.decode.rank.layers import RankAttention


class TritonBackend(TorchBackend):
    name = "triton"

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        why = triton_mode.unsupported(device)
        if why is not None:
            return why
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"the Triton kernel takes fp32 / bf16 / fp16, not {dtype}"
        return None

    def attention(
        self,
        attn: RankAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
    ) -> Tensor:
        q = absorbed_queries(q_nope, q_pe, attn.w_uk, attn.scale, attn.shard.beta)
        u, _ = _paged(q, cache, index, reads)
        return torch.bmm(u.transpose(0, 1), attn.w_uv.transpose(1, 2)).transpose(0, 1)

    def partial_attention(
        self,
        q_lat: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        # The kernel returns the normalized output and its log-sum-exp: as an SP partial that
        # is u / l with l = 1 relative to m = lse (a rank with no tokens: u = 0, lse = -inf).
        q = torch.cat((q_lat * scale, q_pe * scale), dim=-1)
        u, lse = _paged(q, cache, index, reads)
        return u, lse, torch.ones_like(lse)


def _paged(
    q: Tensor, cache: PagedLatentCache, index: int, reads: CacheReads
) -> tuple[Tensor, Tensor]:
    """The kernel over layer `index` of the cache: (u [B, H, w], lse [B, H])."""
    lay = cache.layout
    return decode_attention.paged_decode_attention(
        q,
        cache.kv[index],
        reads.block_ids,
        reads.lengths,
        lay.block_size,
        rope_width=lay.rope_width,
    )
