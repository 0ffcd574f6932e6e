"""Round-robin token chunks of sequence-parallel decode (pure bookkeeping, no torch).

Position p belongs to chunk p // C, owned by rank (p // C) mod R; each rank stores its
tokens contiguously in chunk order, so its local cache is an ordinary growing sequence. The
ranges of a prompt each rank owns are `common.parallel.ParallelConfig.owned_ranges`.
"""

from __future__ import annotations

from typing import Any  # int, or an integer tensor (the arithmetic is the same)


def chunk_owner(position: Any, chunk_size: int, ranks: int) -> Any:
    return (position // chunk_size) % ranks


def local_length(total: Any, rank: int, chunk_size: int, ranks: int) -> Any:
    """How many of the first `total` tokens rank `rank` holds (int, or elementwise tensor)."""
    full_rounds, rest = total // (chunk_size * ranks), total % (chunk_size * ranks)
    mine = rest - rank * chunk_size
    mine = min(max(mine, 0), chunk_size) if isinstance(mine, int) else mine.clamp(0, chunk_size)
    return full_rounds * chunk_size + mine


def local_index(position: Any, chunk_size: int, ranks: int) -> Any:
    """Where the owner of `position` stores it in its own (contiguous) token order."""
    chunk = position // chunk_size
    return (chunk // ranks) * chunk_size + position % chunk_size
