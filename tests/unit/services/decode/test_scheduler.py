"""Block allocator and continuous-batching scheduler: pure logic, no torch."""

from __future__ import annotations

import pytest

from common.kv.block_pool import BlockPool, BlockState, OutOfBlocks, RankPools
from services.decode.scheduler import Scheduler, SchedulerError, SeqState


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


def test_scheduler_lifecycle_and_batch_limit() -> None:
    pool = BlockPool(num_blocks=64, block_size=4)
    sched = Scheduler(pool, max_batch=2, max_model_len=100)
    for rid in "abc":
        sched.reserve(rid, prompt_len=5, max_tokens=3, deadline=10.0)
        sched.start(rid, first_tokens=7)
    batch = sched.schedule()
    assert [s.request_id for s in batch] == ["a", "b"] and sched.num_waiting == 1
    assert batch[0].next_position == 5 and batch[0].last_token == 7
    sched.append("a", 8, finished=False)
    sched.append("a", 9, finished=False)  # third token: max_tokens reached
    assert "a" not in sched.seqs
    assert [s.request_id for s in sched.schedule()] == ["b", "c"]
    assert sched.abort("c") and not sched.abort("c")
    sched.finish("b")
    assert pool.num_used == 0 and not sched.has_work()


def test_scheduler_rejects_bad_requests_and_expires_leases() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    sched = Scheduler(pool, max_batch=4, max_model_len=32)
    with pytest.raises(SchedulerError, match="context limit"):
        sched.reserve("x", prompt_len=30, max_tokens=5, deadline=1.0)
    with pytest.raises(OutOfBlocks):
        sched.reserve("y", prompt_len=16, max_tokens=10, deadline=1.0)
    sched.reserve("z", prompt_len=4, max_tokens=2, deadline=1.0)
    with pytest.raises(SchedulerError, match="already exists"):
        sched.reserve("z", prompt_len=4, max_tokens=2, deadline=1.0)
    with pytest.raises(SchedulerError, match="unknown"):
        sched.start("nope", 1)
    assert sched.expire_leases(now=0.5) == []
    assert sched.expire_leases(now=1.0) == ["z"] and pool.num_used == 0
    sched.reserve("w", prompt_len=4, max_tokens=2, deadline=1.0)
    sched.start("w", 3)
    assert sched.expire_leases(now=5.0) == []  # started requests hold no lease
    assert sched.seqs["w"].state is SeqState.WAITING


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
    pools = RankPools(num_blocks=32, block_size=2, ranks=2, chunk_size=4)
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


def test_scheduler_forks_choices_and_frees_them_when_all_end() -> None:
    pools = RankPools(num_blocks=64, block_size=4, ranks=2)
    sched = Scheduler(pools, max_batch=8, max_model_len=100)
    sched.reserve("r", prompt_len=6, max_tokens=4, deadline=10.0, n=3)
    # The prompt's full block once, then per choice: the copied last block + room to grow.
    assert pools.num_used == 1 + 3 * 2
    forks = sched.forks("r")
    assert [s.seq_id for s in forks] == ["r", "r#1", "r#2"] and forks[1].block_copies
    with pytest.raises(SchedulerError, match="3 choices"):
        sched.start("r", [5])
    sched.start("r", [5, 6, 7])
    batch = sched.schedule()
    assert [(s.choice, s.last_token, s.next_position) for s in batch] == [
        (0, 5, 6),
        (1, 6, 6),
        (2, 7, 6),
    ]
    sched.append("r#1", 9, finished=True)
    assert pools.num_used == 1 + 2 * 2  # choice 1's own blocks are back, the prompt's not
    assert [s.choice for s in sched.abort("r", frozenset({2}))] == [2]
    assert [s.choice for s in sched.abort("r")] == [0]
    assert pools.num_used == 0 and not sched.has_work() and "r" not in sched.requests


def test_scheduler_expires_every_fork_of_a_reservation() -> None:
    pools = RankPools(num_blocks=64, block_size=4, ranks=1)
    sched = Scheduler(pools, max_batch=8, max_model_len=100)
    sched.reserve("r", prompt_len=5, max_tokens=2, deadline=1.0, n=4)
    with pytest.raises(SchedulerError, match="already exists"):
        sched.reserve("r", prompt_len=5, max_tokens=2, deadline=1.0)
    with pytest.raises(OutOfBlocks):
        sched.reserve("big", prompt_len=5, max_tokens=90, deadline=1.0, n=60)
    assert "big" not in sched.requests and "big#1" not in pools.pools[0]
    assert sched.expire_leases(now=2.0) == ["r"]
    assert pools.num_used == 0 and not sched.seqs


def test_forks_share_cached_prefix_blocks_and_keep_them_from_eviction() -> None:
    """A prompt's cached blocks, reused by an n = 3 request, are referenced by every fork:
    they are not evictable while any fork lives (a request that needs them is refused) and
    go back to the cache, not the free list, when the last fork ends."""
    pools = RankPools(num_blocks=12, block_size=4, ranks=1, prefix_cache=True)
    pool = pools.pools[0]
    sched = Scheduler(pools, max_batch=8, max_model_len=100)
    hashes = [11, 22]  # the prompt's two full blocks (10 tokens)
    sched.reserve("a", prompt_len=10, max_tokens=2, deadline=10.0, block_hashes=hashes)
    sched.start("a", 5)
    prefix = pools.tables("a")[0][:2]
    sched.finish("a")
    assert [pool.state(b) for b in prefix] == [BlockState.CACHED] * 2

    sched.reserve("b", prompt_len=10, max_tokens=2, deadline=10.0, block_hashes=hashes, n=3)
    assert sched.seqs["b"].cached_tokens == 8 and sched.prefix_hit_tokens == 8
    assert all(pools.tables(f)[0][:2] == prefix for f in ("b", "b#1", "b#2"))
    assert [pool.refcount(b) for b in prefix] == [3, 3] and pool.num_cached == 0
    # Each fork copies the partly filled third block into one of its own.
    copies = [s.block_copies[0] for s in sched.forks("b")[1:]]
    assert [src for [(src, _)] in copies] == [pools.tables("b")[0][2]] * 2
    sched.reserve("x", prompt_len=20, max_tokens=9, deadline=10.0)  # every free block
    with pytest.raises(OutOfBlocks):  # the forks' cached blocks cannot be evicted
        sched.reserve("y", prompt_len=1, max_tokens=4, deadline=10.0)
    sched.start("b", [5, 6, 7])
    sched.abort("x")
    sched.abort("b", frozenset({0, 1}))
    assert [pool.state(b) for b in prefix] == [BlockState.IN_USE] * 2  # fork 2 holds them
    sched.abort("b")
    assert [pool.state(b) for b in prefix] == [BlockState.CACHED] * 2 and pool.num_cached == 2
    sched.reserve("z", prompt_len=40, max_tokens=8, deadline=10.0)  # needs the cached ones
    assert pool.num_cached == 0 and pool.num_used == 12
