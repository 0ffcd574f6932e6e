"""Multi-head Latent Attention: weights, the expanded path (prefill) and the absorbed path.

Names follow DESIGN §1: `n` is the normalized latent (d_c) and `k_pe` the shared rotated key
(d_r); together they are the whole per-token cache. `W_UK` [H, d_n, d_c] and `W_UV`
[H, d_v, d_c] are views of `kv_b_proj.weight`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.model.args import ModelConfig
from common.model.dsa_config import DsaConfig
from common.model.indexer import Indexer
from common.model.prefill_attention import PrefillAttention
from common.model.rope import RotaryEmbedding

Linear = Callable[[Tensor, Tensor], Tensor]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Normalize in at least fp32 like the reference (bf16 serving), fp64 stays fp64; the
    # weight multiplies after the cast back.
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def project_queries(
    x: Tensor,
    q_a: Tensor | None,
    q_a_norm: Callable[[Tensor], Tensor] | None,
    q_b: Tensor,
    head_dims: tuple[int, int],
    rope: RotaryEmbedding,
    cos: Tensor,
    sin: Tensor,
    linear: Linear = F.linear,
) -> tuple[Tensor, Tensor]:
    """x [T, D] -> q_nope [T, h, d_n], rotated q_pe [T, h, d_r] for the h heads whose rows
    `q_b` holds (q_a / q_a_norm None: no query LoRA, `q_b` is q_proj).

    The one query path: the full model, the oracle and every decode rank call it.
    """
    d_n, d_r = head_dims
    if q_a is not None and q_a_norm is not None:
        x = q_a_norm(linear(x, q_a))
    q = linear(x, q_b)
    q_nope, q_pe = q.view(q.shape[0], -1, d_n + d_r).split([d_n, d_r], dim=-1)
    return q_nope, rope.apply(q_pe, cos[:, None], sin[:, None])


def project_latent(
    x: Tensor,
    w_latent: Tensor,
    w_rope: Tensor,
    norm: Callable[[Tensor], Tensor],
    rope: RotaryEmbedding,
    cos: Tensor,
    sin: Tensor,
    linear: Linear = F.linear,
) -> tuple[Tensor, Tensor]:
    """x [T, D] -> norm(x W_latent^T) and the rotated k_pe [T, d_r]: the one latent path.

    `w_latent` is kv_a_proj_with_mqa's latent rows (all d_c, or a rank's slice), `w_rope` its
    d_r rope rows; `norm` is the full RMSNorm or a rank's (exact then sliced, or sliced).
    """
    return norm(linear(x, w_latent)), rope.apply(linear(x, w_rope), cos, sin)


def _applied(x: Tensor, module: nn.Module) -> Tensor:
    return module(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLAttention(nn.Module):
    """One layer's MLA weights, named like the HF checkpoint so loading is a plain mapping."""

    # Read as tensors (latent and rope rows split, per-head W_UK / W_UV views), never applied
    # whole: an FP8 one dequantizes on use (common/model/fp8_gemm.py `assign_gemms`).
    dense_weights = ("kv_a_proj_with_mqa", "kv_b_proj")

    def __init__(self, config: ModelConfig, indexer: bool = False) -> None:
        """`indexer`: the layer runs its own DSA indexer (a full layer of a DSA model)."""
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.d_c, self.d_r, self.d_n, self.d_v = (
            c.kv_lora_rank,
            c.qk_rope_head_dim,
            c.qk_nope_head_dim,
            c.v_head_dim,
        )
        self.scale = c.softmax_scale
        q_out = c.num_attention_heads * c.qk_head_dim
        self.q_lora = c.q_lora_rank is not None
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.attention_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.attention_norm_eps)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=False)
        # DSA: the model's sparse-attention config; a shared layer (no indexer of its own)
        # reuses the selection of the full layer before it.
        self.dsa: DsaConfig | None = c.dsa
        self.indexer = Indexer(c) if indexer else None

    # -- projections shared by every path -------------------------------------------------

    def q_latent(self, h: Tensor) -> Tensor:
        """The q-LoRA output q_a_layernorm(q_a_proj(h)) [T, q_lora_rank] (what DSA's indexer
        reads besides h)."""
        return self.q_a_layernorm(self.q_a_proj(h))

    def queries(
        self,
        h: Tensor,
        rope: RotaryEmbedding,
        cos: Tensor,
        sin: Tensor,
        q_latent: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """h [T, D] -> q_nope [T, H, d_n], rotated q_pe [T, H, d_r]; from `q_latent` (the
        q-LoRA output of h, already computed) when given."""
        # The projections are applied as modules: an FP8 weight's own GEMM (fp8.py) runs.
        if q_latent is not None:
            return project_queries(
                q_latent, None, None, self.q_b_proj, (self.d_n, self.d_r), rope, cos, sin, _applied
            )
        if self.q_lora:
            return project_queries(
                h,
                self.q_a_proj,
                self.q_a_layernorm,
                self.q_b_proj,
                (self.d_n, self.d_r),
                rope,
                cos,
                sin,
                _applied,
            )
        return project_queries(
            h, None, None, self.q_proj, (self.d_n, self.d_r), rope, cos, sin, _applied
        )

    def latents(
        self, h: Tensor, rope: RotaryEmbedding, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor]:
        """h [T, D] -> n [T, d_c] (normalized latent), k_pe [T, d_r] (rotated)."""
        w = self.kv_a_proj_with_mqa.weight
        return project_latent(h, w[: self.d_c], w[self.d_c :], self.kv_a_layernorm, rope, cos, sin)

    def w_uk(self) -> Tensor:
        return self.kv_b_proj.weight.view(self.num_heads, self.d_n + self.d_v, self.d_c)[
            :, : self.d_n
        ]

    def w_uv(self) -> Tensor:
        return self.kv_b_proj.weight.view(self.num_heads, self.d_n + self.d_v, self.d_c)[
            :, self.d_n :
        ]

    def output(self, o: Tensor) -> Tensor:
        """Per-head values o [T, H, d_v] -> hidden [T, D]."""
        return self.o_proj(o.reshape(o.shape[0], -1))

    # -- the two attention paths ------------------------------------------------------------

    def expanded(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        n: Tensor,
        k_pe: Tensor,
        cu_seqlens: list[int],
        backend: PrefillAttention,
    ) -> Tensor:
        """Training-style attention: per-head K/V up-projected from n. Returns [T, H, d_v]."""
        kv = F.linear(n, self.kv_b_proj.weight).view(
            n.shape[0], self.num_heads, self.d_n + self.d_v
        )
        k_nope, v = kv.split([self.d_n, self.d_v], dim=-1)
        return backend.causal_mla(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens, self.scale)

    def absorb_query(self, q_nope: Tensor) -> Tensor:
        """q~^h = W_UK^h^T q_nope^h: [..., H, d_n] -> [..., H, d_c]."""
        return torch.einsum("...hn,hnc->...hc", q_nope, self.w_uk())

    def absorbed(
        self, q_nope: Tensor, q_pe: Tensor, n: Tensor, k_pe: Tensor, valid: Tensor
    ) -> Tensor:
        """Attention computed in the latent space, for a batch of queries over a latent cache.

        q_nope [B, Q, H, d_n], q_pe [B, Q, H, d_r]; n [B, T, d_c], k_pe [B, T, d_r];
        valid [B, Q, T] bool (causality and padding). Returns [B, Q, H, d_v].
        """
        q_lat = self.absorb_query(q_nope)
        scores = torch.einsum("bqhc,btc->bqht", q_lat, n) + torch.einsum(
            "bqhr,btr->bqht", q_pe, k_pe
        )
        scores = (scores * self.scale).masked_fill(~valid[:, :, None, :], float("-inf"))
        probs = torch.softmax(
            scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1
        ).to(n.dtype)
        u = torch.einsum("bqht,btc->bqhc", probs, n)
        return torch.einsum("bqhc,hvc->bqhv", u, self.w_uv())
