"""The block allocator: allocation, growth, forks and refcounts, one pool and per-rank pools
(pure logic, no torch)."""

from __future__ import annotations

import pytest

from common.kv.block_pool import BlockPool, BlockState, OutOfBlocks, RankPools
from common.parallel import ParallelConfig, ParallelMode


def test_allocate_grow_free_and_refcounts() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.allocate("a", 9) == [0, 1, 2]
    assert pool.grow("a", 12) == [0, 1, 2]  # still fits in three blocks
    assert pool.grow("a", 13) == [0, 1, 2, 3]
    pool.share("b", "a", 2)
    assert pool.table("b").blocks == [0, 1] and pool.state(0) is BlockState.IN_USE
    assert pool.free("a") == 2  # blocks 0 and 1 are still referenced by b
    assert pool.num_free == 6
    assert pool.free("b") == 2 and pool.num_free == 8
    assert pool.free("b") == 0  # idempotent


def test_out_of_blocks_is_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    pool.allocate("a", 4)
    with pytest.raises(OutOfBlocks):
        pool.allocate("b", 3)
    assert "b" not in pool and pool.num_free == 1
    # Growing past the free blocks fails whole too: the table keeps what it had.
    with pytest.raises(OutOfBlocks):
        pool.grow("a", 7)
    assert pool.table("a").blocks == [0, 1] and pool.num_free == 1
    assert pool.grow("a", 6) == [0, 1, 2] and pool.num_free == 0


def test_fork_shares_full_blocks_and_copies_the_last_one() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    pool.allocate("a", 10 + 5)  # a 10-token prompt and 5 more
    assert pool.table("a").blocks == [0, 1, 2, 3]
    copies = pool.fork("a#1", "a", 10, 15)
    # Blocks 0 and 1 are full: shared. Block 2 holds tokens 8-9: the fork gets its own.
    assert pool.table("a#1").blocks[:2] == [0, 1]
    own = pool.table("a#1").blocks[2:]
    assert len(own) == 2 and not set(own) & {0, 1, 2, 3}
    assert copies == [(2, own[0])]
    assert pool.fork("a#2", "a", 8, 15) == []  # whole blocks: nothing to copy
    assert pool._refcount[0] == 3 and pool._refcount[2] == 1
    assert pool.num_used == 4 + 2 + 2
    assert pool.free("a") == 2  # a's own blocks 2 and 3; 0 and 1 still shared
    assert pool.state(0) is BlockState.IN_USE
    assert pool.free("a#1") == 2
    assert pool.free("a#2") == 4 and pool.num_used == 0  # the last holder frees 0 and 1
    assert all(count == 0 for count in pool._refcount)


def test_fork_out_of_blocks_leaves_nothing() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)
    pool.allocate("a", 10)
    with pytest.raises(OutOfBlocks):
        pool.fork("a#1", "a", 10, 30)
    assert "a#1" not in pool and pool._refcount[0] == 1 and pool.num_free == 2


def test_rank_pools_fork_per_rank_in_sp() -> None:
    # SP, 2 ranks, chunks of 4 tokens, blocks of 2: a 10-token prompt puts tokens 0-3 and 8-9
    # on rank 0 (6 tokens: full blocks) and tokens 4-7 on rank 1 (4: full) -> no copy;
    # an 11-token prompt leaves rank 0 with 7 tokens: its last block is copied, rank 1's not.
    pools = RankPools(
        num_blocks=32, block_size=2, parallel=ParallelConfig(2, mode=ParallelMode.SP, chunk_size=4)
    )
    pools.allocate("a", 10 + 3)
    assert pools.fork("a#1", "a", 10, 13) == [[], []]
    pools.allocate("b", 11 + 3)
    copies = pools.fork("b#1", "b", 11, 14)
    assert len(copies[0]) == 1 and copies[1] == []
    src, dst = copies[0][0]
    assert src == pools.tables("b")[0][3] and dst == pools.tables("b#1")[0][3]
    for rid in ("a", "a#1", "b", "b#1"):
        pools.free(rid)
    assert pools.num_used == 0
