"""A DSA decode rank's indexer-key pool: a second paged pool beside the latent one.

It holds one row per token per full layer (common/model/dsa_config.py `key_layer`), in the
rank's key format (common/model/index_keys.py), in the same blocks and slots as the latents:
a block id names the same tokens in both, so a reservation, a prefix-cache hit, a fork's
block copy, a shard's landing and the trash slot work on the pair alike. In SP the keys are
sharded with the latents (the chunk owner keeps both); elsewhere every rank keeps every key.
The pool is a `PagedLatentCache` whose rows are keys (no rope part); the budget buys blocks
of both pools together.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.kv.paged_cache import CacheLayout
from common.model.index_keys import IndexKeyFormat


def index_layout(key_layers: int, fmt: IndexKeyFormat, block_size: int) -> CacheLayout:
    """The key pool of `key_layers` full layers, rows of `fmt`."""
    return CacheLayout(key_layers, fmt.width, 0, block_size, fmt.dtype)


def blocks_for_budget(budget_bytes: int, layouts: Sequence[CacheLayout]) -> int:
    """Blocks of every pool in `layouts` that fit in `budget_bytes` together (each pool has
    that many blocks: a block id names a block of each)."""
    per_block = sum(
        lay.bytes_per_token_per_layer * lay.num_layers * lay.block_size for lay in layouts
    )
    return max(budget_bytes // per_block, 0)
