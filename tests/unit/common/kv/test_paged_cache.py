"""`CacheReads`: the block readers' view of a step's history taken straight from the block
tables must address exactly what the per-token slot tables address."""

from __future__ import annotations

import pytest
import torch

from common.kv.paged_cache import CacheReads, slot_table


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_blocks_address_what_the_slot_tables_address(block_size: int) -> None:
    g = torch.Generator().manual_seed(block_size)
    lengths = torch.tensor([1, 37, 64, 5]) if block_size > 1 else torch.tensor([3, 1, 2, 9])
    width = int(-(-lengths.max() // block_size)) + 2  # reserved past the longest, as in a step
    tables = torch.full((len(lengths), width), -1, dtype=torch.int64)
    pool = torch.randperm(200, generator=g)
    start = 0
    for b, n in enumerate(lengths.tolist()):
        owned = -(-n // block_size) + (b % 2)  # some sequences hold a spare block
        tables[b, :owned] = pool[start : start + owned]
        start += owned

    fast, slow = (
        CacheReads.blocks(tables, lengths, block_size),
        CacheReads.tokens(tables, lengths, block_size),
    )
    assert fast.slots is None and fast.valid is None
    assert fast.block_ids.shape == slow.block_ids.shape
    assert torch.equal(fast.lengths, slow.lengths)
    assert int(fast.block_ids.min()) >= 0  # padding names a real block, never -1
    # Every block a sequence's tokens live in is the same; what lies past its end is padding.
    for b, n in enumerate(lengths.tolist()):
        used = -(-n // block_size)
        assert torch.equal(fast.block_ids[b, :used], tables[b, :used])
        assert torch.equal(slow.block_ids[b, :used], tables[b, :used])
    slots, valid = slot_table(tables, lengths, block_size)
    assert torch.equal(slow.slots, slots) and torch.equal(slow.valid, valid)


def test_a_rank_holding_none_of_a_sequence_reads_nothing_of_it() -> None:
    tables = torch.tensor([[3, 4], [7, -1]])
    reads = CacheReads.tokens(tables, torch.tensor([5, 0]), 4)
    assert reads.valid is not None and not reads.valid[1].any()
    assert reads.lengths.tolist() == [5, 0]
