"""The shapes a decode step runs at: batch sizes and block-table widths rounded up to buckets.

A step padded to its bucket has one of a few static shapes, so each can be captured once (a
CUDA graph per bucket) and replayed by every rank. Batch buckets are the powers of two up to
`max_batch`, then `max_batch` itself; padding rows cost a whole row of compute, but a step's
cost grows slowly with its batch. Table widths (blocks per sequence) grow eightfold from
the blocks of 1,024 tokens up to the context limit's (`TPLA_MAX_MODEL_LEN`): on a GPU the
decode kernel walks each row's own length (common/triton_kernels/decode_attention.py), so a
wider table costs its gather and its row stride, not its reads, and a few widths keep the
graphs few: a DeepSeek-V3 group (163,840 positions at 16 per block, batch 128, MTP drafts)
captures 4 widths x (8 batch sizes + 4 with a draft pass) = 48 graphs. A reader that reads
the whole padded width (the torch kernel, a reference) reads up to 8x what it needs there.
Pure bookkeeping, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

WIDTH_FLOOR_TOKENS = 1024  # the narrowest table width holds this many tokens
WIDTH_GROWTH = 8  # each width bucket is this many times the one before


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


def width_buckets(max_blocks: int, block_size: int) -> list[int]:
    """Every table width bucket up to `max_blocks` (included), smallest first."""
    if max_blocks < 1:
        raise ValueError(f"a table of {max_blocks} blocks")
    out, width = [], -(-WIDTH_FLOOR_TOKENS // block_size)
    while width < max_blocks:
        out.append(width)
        width *= WIDTH_GROWTH
    return [*out, max_blocks]


def width_bucket(blocks: int, max_blocks: int, block_size: int) -> int:
    """The smallest table width bucket holding `blocks` blocks (1 <= blocks <= max_blocks)."""
    if not 1 <= blocks <= max_blocks:
        raise ValueError(f"{blocks} blocks is outside the [1, {max_blocks}] a sequence holds")
    return next(w for w in width_buckets(max_blocks, block_size) if w >= blocks)


@dataclass(frozen=True)
class StepShape:
    """One captured step: its rows, the table width it reads, and whether an MTP draft pass
    (of `DecodePlan.mtp.chain` chained drafts) runs first."""

    batch: int
    width: int
    drafts: bool = False


def step_shapes(
    max_batch: int, max_blocks: int, block_size: int, draft_rows: int = 0
) -> list[StepShape]:
    """Every shape a group's steps are padded to, largest first: each batch and width
    bucket, and with an MTP draft pass (`draft_rows`: the most rows a drafting step runs,
    0 without one) each batch bucket up to the one holding `draft_rows` again."""
    widths = width_buckets(max_blocks, block_size)
    plain = [StepShape(b, w) for b in batch_buckets(max_batch) for w in widths]
    drafting = []
    if draft_rows:
        top = batch_bucket(min(draft_rows, max_batch), max_batch)
        drafting = [
            StepShape(b, w, True) for b in batch_buckets(max_batch) if b <= top for w in widths
        ]
    return sorted(plain + drafting, key=lambda s: (s.batch, s.width, s.drafts), reverse=True)
