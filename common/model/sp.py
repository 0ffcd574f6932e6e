"""Chunked sequence parallelism for absorbed MLA decode (`papers/mla-decode-tp-sp.txt`).

The cache is split by token chunks placed round-robin over the ranks; each rank keeps the
full latent width for its chunks. A rank attends with every head over its own tokens and
returns an unnormalized partial (u, running max m, sum of exponentials l); merging the
partials with log-sum-exp is exact, like flash-decoding's split-K:

    M = max_k m_k,   u = sum_k e^{m_k - M} u_k / sum_k e^{m_k - M} l_k

A rank with no tokens for a sequence contributes m = -inf, l = 0, u = 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def partial_attention(
    q_lat: Tensor, q_pe: Tensor, n: Tensor, k_pe: Tensor, valid: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """q_lat [B, H, d_c], q_pe [B, H, d_r] over n [B, T, d_c], k_pe [B, T, d_r], valid [B, T].

    Returns u [B, H, d_c] (sum_t e^{s_t - m} n_t), m [B, H] and l [B, H] (sum_t e^{s_t - m}).
    """
    scores = (
        torch.einsum("bhc,btc->bht", q_lat, n) + torch.einsum("bhr,btr->bht", q_pe, k_pe)
    ) * scale
    scores = scores.float().masked_fill(~valid[:, None, :], float("-inf"))
    m = scores.amax(-1)
    safe_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - safe_m[..., None])  # exp(-inf) = 0 for masked tokens
    return torch.einsum("bht,btc->bhc", p.to(n.dtype), n), m, p.sum(-1)


def merge_partials(u: Tensor, m: Tensor, l: Tensor, global_max: Tensor) -> tuple[Tensor, Tensor]:
    """Rescale one rank's partial to the global max: returns (u', l') to be summed over ranks,
    both fp32 whatever u's dtype: summed in bf16, the ranks' partials would each be rounded
    to 8 bits of mantissa before the division (the caller casts the merged output back)."""
    factor = torch.exp(m.float() - global_max.float())
    factor = torch.where(torch.isfinite(m), factor, torch.zeros_like(factor))
    return u.float() * factor[..., None], l.float() * factor
