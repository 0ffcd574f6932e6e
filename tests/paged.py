"""Random paged latent caches for the attention kernel tests."""

from __future__ import annotations

import torch

from common.kv.paged_cache import CacheLayout, PagedLatentCache, slot_table


def random_cache(
    lengths: list[int], width: int, d_r: int, block_size: int, seed: int
) -> tuple[PagedLatentCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache with shuffled (non-contiguous) blocks, -1-padded block tables, random latents."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_seq) + 3
    cache = PagedLatentCache(CacheLayout(2, width, d_r, block_size), num_blocks)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lengths), max(per_seq) + 1), -1, dtype=torch.long)
    for b, nb in enumerate(per_seq):
        tables[b, :nb] = torch.tensor(order[:nb])
        order = order[nb:]
    lens = torch.tensor(lengths)
    slots, valid = slot_table(tables, lens, block_size)
    return cache, slots, valid, lens
