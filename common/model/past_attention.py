"""MLA attention of a prompt's new tokens over its cached past, in key tiles.

A chunk of Q new tokens after P cached ones attends over P + Q keys. Materialized at once,
the scores are Q x (P + Q) per head and the expanded keys and values (P + Q) x H wide: both
grow with the prompt. Here the keys are taken a tile at a time (the past's up-projection
too, in the expanded form) and merged by an online softmax (running max and sum, as flash
attention does), so the largest temporary is H x Q x tile. The tile is chosen so that stays
under `SCORE_ELEMENTS`.

The expanded form up-projects each tile's latents with `kv_b` into per-head keys and values;
the absorbed form folds W_UK into the queries and attends over the latents themselves
(one key and value row per token, shared by the heads), then applies W_UV once. Both take
the heads' slice of `kv_b` that the caller holds, so a rank with some of the heads calls
them the same way. Untiled, both are plain softmax attention under the causal mask
`key <= P + query`; tests/unit/common/model/test_past_attention.py holds them to that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# At most this many fp32 score elements (heads x queries x keys) per tile: 64 MiB.
SCORE_ELEMENTS = 1 << 24
MIN_TILE = 16

# (first key, end key) -> keys [t, H or 1, d_qk] and values [t, H or 1, d_out] of that tile.
TileKV = Callable[[int, int], tuple[Tensor, Tensor]]


def key_tile(heads: int, queries: int, score_elements: int = SCORE_ELEMENTS) -> int:
    """Keys per tile so heads x queries x tile stays within `score_elements`."""
    return max(MIN_TILE, score_elements // max(1, heads * queries))


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

    def tile_kv(lo: int, hi: int) -> tuple[Tensor, Tensor]:
        kv = F.linear(n[lo:hi], kv_b).view(hi - lo, heads, -1)
        k_nope, v = kv.split([d_n, kv.shape[-1] - d_n], dim=-1)
        pe = k_pe[lo:hi, None].expand(-1, heads, -1)
        return torch.cat((k_nope, pe), dim=-1), v

    q = torch.cat((q_nope, q_pe), dim=-1)
    return _online_softmax(q, tile_kv, n.shape[0], scale, tile)


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
    q = torch.cat((torch.einsum("qhn,hnc->qhc", q_nope, w_uk), q_pe), dim=-1)

    def tile_kv(lo: int, hi: int) -> tuple[Tensor, Tensor]:
        return torch.cat((n[lo:hi], k_pe[lo:hi]), dim=-1)[:, None], n[lo:hi, None]

    u = _online_softmax(q, tile_kv, n.shape[0], scale, tile)
    return torch.einsum("qhc,hvc->qhv", u, w_uv)


def _online_softmax(
    q: Tensor, tile_kv: TileKV, total: int, scale: float, tile: int | None
) -> Tensor:
    """softmax(q k^T * scale, causal from key total - Q) v over key tiles, merged with a
    running max and sum in at least fp32. q [Q, H, d_qk] -> [Q, H, d_out] in q's dtype."""
    queries, heads = q.shape[0], q.shape[1]
    past = total - queries
    step = tile or key_tile(heads, queries)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    qh = q.transpose(0, 1)  # [H, Q, d]
    row_max = q.new_full((heads, queries, 1), float("-inf"), dtype=acc_dtype)
    row_sum = q.new_zeros((heads, queries, 1), dtype=acc_dtype)
    acc: Tensor | None = None
    query_pos = torch.arange(past, total, device=q.device)[:, None]
    # Key 0 is visible to every query, so after the first tile every row's max is finite and
    # a later tile that a row sees none of adds exp(-inf) = 0 to it.
    for lo in range(0, total, step):
        hi = min(lo + step, total)
        k, v = tile_kv(lo, hi)
        scores = torch.matmul(qh, k.permute(1, 2, 0)).to(acc_dtype) * scale  # [H, Q, t]
        if hi - 1 > past:  # the tile reaches the new tokens: mask the later ones
            hidden = torch.arange(lo, hi, device=q.device)[None] > query_pos
            scores = scores.masked_fill(hidden[None], float("-inf"))
        new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
        probs = torch.exp(scores - new_max)
        rescale = torch.exp(row_max - new_max)
        row_sum = row_sum * rescale + probs.sum(dim=-1, keepdim=True)
        part = torch.matmul(probs.to(v.dtype), v.permute(1, 0, 2)).to(acc_dtype)  # [H, Q, d_out]
        acc = part if acc is None else acc * rescale + part
        row_max = new_max
    assert acc is not None, "attention over no keys"
    return (acc / row_sum).to(q.dtype).transpose(0, 1)
