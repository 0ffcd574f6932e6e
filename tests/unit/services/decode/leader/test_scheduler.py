"""The continuous-batching scheduler over the block pools: pure logic, no torch."""

from __future__ import annotations

import pytest

from common.kv.block_pool import BlockPool, BlockState, OutOfBlocks, RankPools
from common.parallel import ParallelConfig
from services.decode.leader.scheduler import Scheduler, SchedulerError, SeqState


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
    sched.append("a", 9, finished=True)  # third token: max_tokens reached (the leader says)
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


def test_scheduler_forks_choices_and_frees_them_when_all_end() -> None:
    pools = RankPools(num_blocks=64, block_size=4, parallel=ParallelConfig(tp=2))
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
    pools = RankPools(num_blocks=64, block_size=4, parallel=ParallelConfig())
    sched = Scheduler(pools, max_batch=8, max_model_len=100)
    sched.reserve("r", prompt_len=5, max_tokens=2, deadline=1.0, n=4)
    with pytest.raises(SchedulerError, match="already exists"):
        sched.reserve("r", prompt_len=5, max_tokens=2, deadline=1.0)
    with pytest.raises(OutOfBlocks):
        sched.reserve("big", prompt_len=5, max_tokens=90, deadline=1.0, n=60)
    assert "big" not in sched.requests and "big#1" not in pools.pools[0]
    assert sched.expire_leases(now=2.0) == ["r"]
    assert pools.num_used == 0 and not sched.seqs


def test_progress_renews_a_reservation_until_it_stops() -> None:
    pools = RankPools(num_blocks=64, block_size=4, parallel=ParallelConfig())
    sched = Scheduler(pools, max_batch=8, max_model_len=100)
    sched.reserve("r", prompt_len=12, max_tokens=2, deadline=1.0, n=2)
    # Each chunk's landing pushes the deadline out, every fork's; an earlier one never
    # pulls it back.
    for landed_at in (0.8, 1.6, 2.4):
        assert sched.expire_leases(now=landed_at) == []
        sched.renew("r", deadline=landed_at + 1.0)
    sched.renew("r", deadline=2.0)
    assert [s.lease_deadline for s in sched.forks("r")] == [3.4, 3.4]
    sched.renew("late", deadline=9.0)  # a shard of a request that is gone: nothing to renew
    assert sched.expire_leases(now=3.3) == []
    assert sched.expire_leases(now=3.4) == ["r"] and pools.num_used == 0
    sched.reserve("s", prompt_len=4, max_tokens=2, deadline=1.0)
    sched.start("s", 3)
    sched.renew("s", deadline=9.0)  # started: no lease left to renew
    assert sched.seqs["s"].lease_deadline == 1.0


def test_forks_share_cached_prefix_blocks_and_keep_them_from_eviction() -> None:
    """A prompt's cached blocks, reused by an n = 3 request, are referenced by every fork:
    they are not evictable while any fork lives (a request that needs them is refused) and
    go back to the cache, not the free list, when the last fork ends."""
    pools = RankPools(num_blocks=12, block_size=4, parallel=ParallelConfig(), prefix_cache=True)
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
