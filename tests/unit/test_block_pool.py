"""Block allocator and continuous-batching scheduler: pure logic, no torch."""

from __future__ import annotations

import pytest

from common.kv.block_pool import BlockPool, BlockState, OutOfBlocks
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
    assert pool.can_hold("a", 6) and not pool.can_hold("a", 7)


def test_scheduler_lifecycle_and_batch_limit() -> None:
    pool = BlockPool(num_blocks=64, block_size=4)
    sched = Scheduler(pool, max_batch=2, max_model_len=100)
    for rid in "abc":
        sched.reserve(rid, prompt_len=5, max_tokens=3, deadline=10.0)
        sched.start(rid, first_token=7)
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
