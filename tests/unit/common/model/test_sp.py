"""Chunked SP: round-robin bookkeeping and the exact log-sum-exp merge."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.chunks import chunk_owner, local_index, local_length, owned_ranges
from common.model.sp import merge_partials, partial_attention


@settings(max_examples=60, deadline=None)
@given(total=st.integers(0, 200), chunk=st.integers(1, 9), ranks=st.integers(1, 4))
def test_round_robin_bookkeeping(total: int, chunk: int, ranks: int) -> None:
    seen: dict[int, list[int]] = {r: [] for r in range(ranks)}
    for pos in range(total):
        owner = chunk_owner(pos, chunk, ranks)
        assert local_index(pos, chunk, ranks) == len(seen[owner])  # contiguous local order
        seen[owner].append(pos)
    lengths = [local_length(total, r, chunk, ranks) for r in range(ranks)]
    # A growing sequence stays balanced: no rank holds more than one chunk more than another.
    assert max(lengths) - min(lengths) <= chunk
    for r in range(ranks):
        assert lengths[r] == len(seen[r])
        flat = [p for lo, hi in owned_ranges(total, r, chunk, ranks) for p in range(lo, hi)]
        assert flat == seen[r]


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
