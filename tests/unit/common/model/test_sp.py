"""Chunked SP: the exact log-sum-exp merge of partial attentions."""

from __future__ import annotations

import torch

from common.kv.chunks import chunk_owner
from common.model.sp import merge_partials, partial_attention


def test_merged_partials_equal_full_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    b, h, t, d_c, d_r = 3, 4, 37, 16, 8
    q_lat, q_pe = torch.randn(b, h, d_c, generator=g), torch.randn(b, h, d_r, generator=g)
    n, k_pe = torch.randn(b, t, d_c, generator=g), torch.randn(b, t, d_r, generator=g)
    lengths = torch.tensor([37, 5, 20])
    valid = torch.arange(t)[None] < lengths[:, None]
    scale = 0.3
    scores = (
        torch.einsum("bhc,btc->bht", q_lat, n) + torch.einsum("bhr,btr->bht", q_pe, k_pe)
    ) * scale
    probs = scores.masked_fill(~valid[:, None], float("-inf")).softmax(-1)
    reference = torch.einsum("bht,btc->bhc", probs, n)

    chunk, ranks = 4, 3
    owner = torch.tensor([chunk_owner(p, chunk, ranks) for p in range(t)])
    parts = [
        partial_attention(q_lat, q_pe, n, k_pe, valid & (owner == r)[None], scale)
        for r in range(ranks)
    ]
    global_max = torch.stack([m for _, m, _ in parts]).amax(0)
    merged = [merge_partials(u, m, l, global_max) for u, m, l in parts]
    u = sum(x for x, _ in merged) / sum(y for _, y in merged)[..., None]
    torch.testing.assert_close(u, reference, atol=1e-5, rtol=0)
