"""MLA attention of a prompt's new tokens over its cached past, in key tiles.

A chunk of Q new tokens after P cached ones attends over P + Q keys. Materialized at once,
the scores are Q x (P + Q) per head and the expanded keys and values (P + Q) x H wide: both
grow with the prompt. Here the keys are taken a tile at a time (the past's up-projection
too, in the expanded form) and merged by an online softmax (running max and sum, as flash
attention does), so the largest temporary is H x Q x tile. The tile is chosen so that stays
under the device's score budget.

The expanded form up-projects each tile's latents with `kv_b` into per-head keys and values;
the absorbed form folds W_UK into the queries and attends over the latents themselves
(one key and value row per token, shared by the heads), then applies W_UV once. Both take
the heads' slice of `kv_b` that the caller holds, so a rank with some of the heads calls
them the same way. Untiled, both are plain softmax attention under the causal mask
`key <= P + query`; tests/unit/common/model/test_past_attention.py holds them to that.
This is the reference and the path of every device but the CPU's native backend, whose
kernel runs the same attention faster (common/model/past_native.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# At most this many fp32 score elements (heads x queries x keys) per tile. On the CPU 16 MiB:
# a tile's passes (GEMM, max, exp, sum, GEMM) then stay closer to the caches (the demo's
# 2K-token chunk over a 2K past: 0.29 s at 4M elements, 0.6-0.7 s at 16M-64M). On a GPU
# 1 GiB: a V3 chunk of 8192 queries x 128 heads still gets 256-key tiles, not thousands of
# small launches (its untiled scores over a 128K prompt would be 512 GiB).
CPU_SCORE_ELEMENTS = 1 << 22
GPU_SCORE_ELEMENTS = 1 << 28
MIN_TILE = 16

# (first key, end key) -> the scores of every head's queries over that tile of keys [H, Q, t]
# and its values [H or 1, t, d_out].
TileScores = Callable[[int, int], tuple[Tensor, Tensor]]


def key_tile(heads: int, queries: int, device: torch.device) -> int:
    """Keys per tile so heads x queries x tile stays within the device's score budget."""
    budget = GPU_SCORE_ELEMENTS if device.type == "cuda" else CPU_SCORE_ELEMENTS
    return max(MIN_TILE, budget // max(1, heads * queries))


def expanded_over_past(
    q_nope: Tensor,
    q_pe: Tensor,
    n: Tensor,
    k_pe: Tensor,
    kv_b: Tensor,
    scale: float,
    tile: int | None = None,
) -> Tensor:
    """q_nope [Q, H, d_n], q_pe [Q, H, d_r] of the new tokens; n [P + Q, d_c] and k_pe
    [P + Q, d_r] the past's latents then the new tokens'; kv_b [H * (d_n + d_v), d_c] the
    heads' up-projection. Query i attends over keys 0..P + i. Returns [Q, H, d_v]."""
    heads, d_n = q_nope.shape[1], q_nope.shape[2]
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, Q, d_n + d_r]

    def tile_scores(lo: int, hi: int) -> tuple[Tensor, Tensor]:
        kv = F.linear(n[lo:hi], kv_b).view(hi - lo, heads, -1).transpose(0, 1)  # [H, t, e]
        k_nope, v = kv.split([d_n, kv.shape[-1] - d_n], dim=-1)
        pe = k_pe[None, lo:hi].expand(heads, -1, -1)
        # Keys [H, d_n + d_r, t] and values [H, t, d_v] contiguous: each a small copy of the
        # tile, which the two GEMMs then read at full speed.
        k = torch.cat((k_nope, pe), dim=-1).transpose(1, 2).contiguous()
        return torch.bmm(q, k), v.contiguous()

    step = tile or key_tile(heads, q_nope.shape[0], n.device)
    return _online_softmax(tile_scores, q_nope.shape[0], n.shape[0], scale, step)


def absorbed_over_past(
    q_nope: Tensor,
    q_pe: Tensor,
    n: Tensor,
    k_pe: Tensor,
    kv_b: Tensor,
    scale: float,
    tile: int | None = None,
) -> Tensor:
    """`expanded_over_past` computed in the latent space: the same inputs and result."""
    heads, d_n = q_nope.shape[1], q_nope.shape[2]
    w = kv_b.view(heads, -1, kv_b.shape[-1])
    w_uk, w_uv = w[:, :d_n], w[:, d_n:]
    q_lat = torch.einsum("qhn,hnc->hqc", q_nope, w_uk)  # [H, Q, d_c]
    qp = q_pe.transpose(0, 1)

    def tile_scores(lo: int, hi: int) -> tuple[Tensor, Tensor]:
        # Keys and values are the latents themselves, one row per token for every head.
        scores = _shared_keys(qp, k_pe[lo:hi]).add_(_shared_keys(q_lat, n[lo:hi]))
        return scores, n[None, lo:hi]

    step = tile or key_tile(heads, q_nope.shape[0], n.device)
    u = _online_softmax(tile_scores, q_nope.shape[0], n.shape[0], scale, step)
    return torch.einsum("qhc,hvc->qhv", u, w_uv)


def _shared_keys(q: Tensor, k: Tensor) -> Tensor:
    """q [H, Q, d] against keys k [t, d] that every head shares: one GEMM, [H, Q, t]."""
    heads, queries = q.shape[0], q.shape[1]
    return torch.mm(q.reshape(heads * queries, -1), k.T).view(heads, queries, -1)


def _online_softmax(
    tile_scores: TileScores, queries: int, total: int, scale: float, step: int
) -> Tensor:
    """softmax(scores * scale) values over tiles of `step` keys, causal from key total - Q,
    merged with a running max and sum in at least fp32. Returns [Q, H, d_out] in the values'
    dtype."""
    past = total - queries
    row_max = row_sum = acc = None
    # Key 0 is visible to every query, so after the first tile every row's max is finite and
    # a later tile that a row sees none of adds exp(-inf) = 0 to it.
    for lo in range(0, total, step):
        hi = min(lo + step, total)
        scores, v = tile_scores(lo, hi)
        acc_dtype = torch.promote_types(scores.dtype, torch.float32)
        scores = scores.to(acc_dtype).mul_(scale)
        if hi - 1 > past:  # the tile reaches the new tokens: mask the later ones
            query_pos = torch.arange(past, total, device=scores.device)[:, None]
            hidden = torch.arange(lo, hi, device=scores.device)[None] > query_pos
            scores.masked_fill_(hidden, float("-inf"))
        tile_max = scores.amax(dim=-1, keepdim=True)
        new_max = tile_max if row_max is None else torch.maximum(row_max, tile_max)
        probs = scores.sub_(new_max).exp_()
        part = torch.matmul(probs.to(v.dtype), v).to(acc_dtype)  # [H, Q, d_out]
        if row_max is None or row_sum is None or acc is None:
            row_sum, acc = probs.sum(dim=-1, keepdim=True), part
        else:
            rescale = (row_max - new_max).exp_()
            row_sum = row_sum.mul_(rescale).add_(probs.sum(dim=-1, keepdim=True))
            acc = acc.mul_(rescale).add_(part)
        row_max = new_max
    assert acc is not None and row_sum is not None, "attention over no keys"
    return (acc / row_sum).to(v.dtype).transpose(0, 1)
