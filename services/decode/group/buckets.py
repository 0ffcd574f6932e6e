"""The shapes a decode step runs at: batch sizes and block-table widths rounded up to buckets.

A step padded to its bucket has one of a few static shapes, so each can be captured once (a
CUDA graph per bucket) and replayed by every rank. Batch buckets are the powers of two up to
`max_batch`, then `max_batch` itself; padding rows cost a whole row of compute, but a step's
cost grows slowly with its batch. Table widths (blocks per sequence) are the powers of two
and the midpoints between them (1, 2, 3, 4, 6, 8, 12, 16, 24, ...): a reader that reads the
whole padded width (the torch attention kernel) reads less than half again what it needs,
where powers of two alone would read up to twice as much. Pure bookkeeping, no torch.
"""

from __future__ import annotations


def batch_bucket(batch: int, max_batch: int) -> int:
    """The smallest batch bucket holding `batch` rows (1 <= batch <= max_batch)."""
    if not 1 <= batch <= max_batch:
        raise ValueError(f"batch {batch} is outside [1, {max_batch}]")
    return min(1 << (batch - 1).bit_length(), max_batch)


def batch_buckets(max_batch: int) -> list[int]:
    """Every batch bucket, smallest first: 1, 2, 4, ... up to max_batch (included)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def width_bucket(blocks: int, max_blocks: int | None = None) -> int:
    """The smallest table width bucket holding `blocks` blocks (>= 1), capped at
    `max_blocks` (a sequence's most blocks) when given."""
    if blocks < 1:
        raise ValueError(f"a block table of {blocks} blocks")
    if max_blocks is not None and blocks > max_blocks:
        raise ValueError(f"{blocks} blocks is over the {max_blocks} a sequence can hold")
    power = 1 << (blocks - 1).bit_length()
    width = power * 3 // 4 if power >= 4 and blocks <= power * 3 // 4 else power
    return width if max_blocks is None else min(width, max_blocks)


def width_buckets(max_blocks: int) -> list[int]:
    """Every table width bucket up to `max_blocks` (included), smallest first."""
    return sorted({width_bucket(n, max_blocks) for n in range(1, max_blocks + 1)})
