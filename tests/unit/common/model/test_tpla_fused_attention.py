"""The fast decode-attention kernels agree with their references on random paged inputs."""

from __future__ import annotations

import pytest
import torch

from common.kv.paged_cache import CacheLayout, PagedLatentCache, block_ids_from_slots
from common.model.tpla import fused_slice_attention, latent_slice_attention
from tests.paged import random_cache


@pytest.mark.parametrize(
    ("lengths", "heads", "width", "d_r", "block_size", "beta"),
    [
        ([1], 4, 16, 8, 4, 1.0),  # a single token
        ([37, 5, 16, 64], 8, 32, 8, 16, 0.5),  # ragged, partial and exactly-full blocks
        ([130, 129], 16, 64, 16, 16, 0.37),  # multi-block, one token past a block edge
        ([7, 7, 7], 2, 24, 8, 8, 1.0),  # equal lengths: no padding mask at all
    ],
)
def test_fused_slice_attention_matches_reference(
    lengths: list[int], heads: int, width: int, d_r: int, block_size: int, beta: float
) -> None:
    cache, slots, valid, lens = random_cache(lengths, width, d_r, block_size, seed=len(lengths))
    g = torch.Generator().manual_seed(7)
    b, d_n, d_v = len(lengths), 12, 10
    q_nope = torch.randn(b, heads, d_n, generator=g)
    q_pe = torch.randn(b, heads, d_r, generator=g)
    w_uk = torch.randn(heads, d_n, width, generator=g) * 0.2
    w_uv = torch.randn(heads, d_v, width, generator=g) * 0.2
    scale = 0.3
    layer = 1
    n, k_pe = cache.gather(layer, slots)
    reference = latent_slice_attention(
        q_nope[:, None], q_pe[:, None], n, k_pe, valid[:, None], w_uk, w_uv, scale, beta
    )[:, 0]
    rows = cache.rows(layer, block_ids_from_slots(slots, block_size))
    # One chunk (plain softmax) and several (split-K with the log-sum-exp merge), including
    # chunks in which a short sequence has no valid token at all.
    for chunk in (rows.total, block_size, 2 * block_size):
        fast = fused_slice_attention(
            q_nope, q_pe, rows.read, rows.total, chunk, lens, w_uk, w_uv, scale, beta
        )
        assert fast.shape == (b, heads, d_v)
        torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


def test_gather_blocks_matches_per_token_gather() -> None:
    cache, slots, valid, _ = random_cache([45, 3, 33], 20, 6, 8, seed=3)
    kv = cache.gather_blocks(0, block_ids_from_slots(slots, 8))
    n, k_pe = cache.gather(0, slots)
    t = slots.shape[1]
    mask = valid[..., None]
    assert torch.equal(kv[:, :t, :20] * mask, n * mask)
    assert torch.equal(kv[:, :t, 20:] * mask, k_pe * mask)


def test_cache_views_share_storage() -> None:
    """n and k_pe are views of one buffer, so writes through either land in `kv`."""
    cache = PagedLatentCache(CacheLayout(2, 8, 4, 4), 3)
    slots = torch.tensor([0, 5, 11])
    n, k_pe = torch.randn(3, 8), torch.randn(3, 4)
    cache.write(1, slots, n, k_pe)
    assert torch.equal(cache.kv[1, slots], torch.cat((n, k_pe), dim=-1))
    assert cache.nbytes == 2 * 12 * 12 * 4
