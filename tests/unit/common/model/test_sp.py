"""Chunked SP: the exact log-sum-exp merge of partial attentions."""

from __future__ import annotations

import torch

from common.model.sp import merge_partials, partial_attention
from common.parallel import ParallelConfig, ParallelMode


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
    owner = ParallelConfig(ranks, mode=ParallelMode.SP, chunk_size=chunk).token_owner(
        torch.arange(t)
    )
    parts = [
        partial_attention(q_lat, q_pe, n, k_pe, valid & (owner == r)[None], scale)
        for r in range(ranks)
    ]
    global_max = torch.stack([m for _, m, _ in parts]).amax(0)
    merged = [merge_partials(u, m, l, global_max) for u, m, l in parts]
    u = sum(x for x, _ in merged) / sum(y for _, y in merged)[..., None]
    torch.testing.assert_close(u, reference, atol=1e-5, rtol=0)


def test_bf16_partials_merge_in_fp32() -> None:
    """The merge sums in fp32 whatever the serving dtype: bf16 partials merged this way sit
    closer to the exact result than the same partials packed and summed in bf16."""
    g = torch.Generator().manual_seed(1)
    b, h, t, d_c, d_r, ranks = 2, 8, 96, 64, 16, 4
    q_lat, q_pe = torch.randn(b, h, d_c, generator=g), torch.randn(b, h, d_r, generator=g)
    n, k_pe = torch.randn(b, t, d_c, generator=g), torch.randn(b, t, d_r, generator=g)
    valid = torch.ones(b, t, dtype=torch.bool)
    owner = ParallelConfig(ranks, mode=ParallelMode.SP, chunk_size=8).token_owner(torch.arange(t))
    scale = 0.1
    exact = [
        partial_attention(q_lat, q_pe, n, k_pe, valid & (owner == r)[None], scale)
        for r in range(ranks)
    ]
    parts = [(u.bfloat16(), m, l) for u, m, l in exact]  # what a bf16 rank hands the merge
    global_max = torch.stack([m for _, m, _ in parts]).amax(0)
    merged = [merge_partials(u, m, l, global_max) for u, m, l in parts]
    assert all(u.dtype == torch.float32 and l.dtype == torch.float32 for u, l in merged)
    fp32 = sum(u for u, _ in merged) / sum(l for _, l in merged)[..., None]
    bf16_u = sum(u.bfloat16() for u, _ in merged)
    bf16_l = sum(l.bfloat16() for _, l in merged)
    bf16 = (bf16_u / bf16_l[..., None]).float()
    ref = [merge_partials(u, m, l, global_max) for u, m, l in exact]  # fp32 partials
    want = (sum(u for u, _ in ref) / sum(l for _, l in ref)[..., None]).double()
    err_fp32 = (fp32.double() - want).abs().max()
    err_bf16 = (bf16.double() - want).abs().max()
    assert err_fp32 < err_bf16 / 2
