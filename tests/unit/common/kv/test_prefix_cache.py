"""Prefix caching in the block pools: hashes, hits, eviction, refcounts (pure logic, no torch)."""

from __future__ import annotations

import random

import pytest

from common.kv.block_pool import BlockPool, BlockState, OutOfBlocks, RankPools
from common.kv.prefix_cache import (
    PrefixIndex,
    block_hashes,
    format_hashes,
    model_identity,
    parse_hashes,
    root_hash,
)
from common.parallel import ParallelConfig, ParallelMode
from services.decode.leader.scheduler import Scheduler

BS = 4
ROOT = root_hash("model-a", "side-file-x")


def _pools(num_blocks: int = 16) -> RankPools:
    return RankPools(num_blocks, BS, ParallelConfig(tp=2), prefix_cache=True)


def _check(pools: RankPools) -> None:
    """Every block is exactly one of in use, cached (parked) or free; refcounts match the
    tables that reference them."""
    for pool in pools.pools:
        refs = [0] * pool.num_blocks
        for rid in list(pool._tables):
            for b in pool.table(rid).blocks:
                refs[b] += 1
        states = [pool.state(b) for b in range(pool.num_blocks)]
        assert refs == [pool.refcount(b) for b in range(pool.num_blocks)]
        assert states.count(BlockState.IN_USE) == pool.num_used
        assert states.count(BlockState.CACHED) == pool.num_cached
        assert pool.num_used + pool.num_free == pool.num_blocks


def test_hash_chain_depends_on_root_parent_and_tokens() -> None:
    ids = list(range(10))
    a = block_hashes(ROOT, ids, BS)
    assert len(a) == 2  # 10 tokens: two full blocks, the partial third has no hash
    assert block_hashes(ROOT, ids[:8], BS) == a
    assert block_hashes(root_hash("model-a", "side-file-y"), ids, BS)[0] != a[0]
    changed = block_hashes(ROOT, [99, *ids[1:]], BS)
    assert changed[0] != a[0] and changed[1] != a[1]  # a child depends on its parent
    assert parse_hashes(format_hashes(a)) == frozenset(a)


def test_model_identity_covers_the_side_file(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "tpla_pca.json").write_text('{"layers": [1]}')
    (tmp_path / "tpla_other.json").write_text('{"layers": [2]}')
    pca = model_identity(tmp_path, "tpla_pca")
    assert pca == model_identity(tmp_path, "tpla_pca.json")
    assert pca != model_identity(tmp_path, "tpla_other") != model_identity(tmp_path, None)


def test_hit_partial_hit_and_miss_across_block_boundaries() -> None:
    pools = _pools()
    sched = Scheduler(pools, max_batch=8, max_model_len=1000)
    prompt = list(range(100, 111))  # 11 tokens: two full blocks
    hashes = block_hashes(ROOT, prompt, BS)
    sched.reserve("a", len(prompt), 3, 10.0, hashes)
    assert sched.seqs["a"].cached_tokens == 0  # cold
    sched.start("a", 7)
    sched.finish("a")
    assert pools.num_used == 0 and pools.num_cached == 2
    # The same prompt: both full blocks; one more token does not change the full blocks.
    for rid, ids, want in [
        ("same", prompt, 8),
        ("longer", [*prompt, 5, 6], 8),
        ("one-block", [*prompt[:4], 0, 0, 0, 0, 0], 4),  # shares block 0, not block 1
        ("short", prompt[:7], 4),  # only one full block of its own
        ("miss", [1, *prompt[1:]], 0),  # first token differs: every child differs
    ]:
        sched.reserve(rid, len(ids), 2, 10.0, block_hashes(ROOT, ids, BS))
        assert sched.seqs[rid].cached_tokens == want, rid
        sched.abort(rid)
        _check(pools)
    assert sched.prefix_hit_tokens == 8 + 8 + 4 + 4
    assert pools.num_used == 0 and pools.num_cached == 2


def test_cached_block_is_shared_and_never_freed_under_a_live_reader() -> None:
    pools = _pools(num_blocks=6)
    sched = Scheduler(pools, max_batch=8, max_model_len=1000)
    prompt = list(range(8))
    hashes = block_hashes(ROOT, prompt, BS)
    sched.reserve("a", 8, 1, 10.0, hashes)  # 8 tokens: two blocks
    sched.start("a", 1)
    sched.reserve("b", 8, 1, 10.0, hashes)  # a's blocks, shared while a is live
    assert pools.tables("b")[0] == pools.tables("a")[0]
    sched.finish("a")
    shared = pools.tables("b")[0]
    assert all(pools.pools[0].state(b) is BlockState.IN_USE for b in shared)
    # Pressure: the other four blocks, and then some, are wanted; b's blocks are not evictable.
    sched.reserve("c", 16, 1, 10.0)
    with pytest.raises(OutOfBlocks):
        sched.reserve("d", 2, 1, 10.0)
    assert pools.tables("b")[0] == shared and "d" not in sched.seqs
    _check(pools)
    sched.abort("c")
    sched.abort("b")
    assert pools.num_used == 0 and pools.num_cached == 2
    _check(pools)


def test_eviction_is_least_recently_used_under_pressure() -> None:
    pools = _pools(num_blocks=4)
    sched = Scheduler(pools, max_batch=8, max_model_len=1000)
    old, new = [1] * 4, [2] * 4
    for rid, ids in (("old", old), ("new", new)):
        sched.reserve(rid, 4, 1, 10.0, block_hashes(ROOT, ids, BS))
        sched.start(rid, 0)
        sched.finish(rid)
    assert pools.num_cached == 2 and pools.pools[0].num_free == 4
    sched.reserve("big", 12, 1, 10.0)  # three blocks: the two free ones, then evict "old"
    sched.abort("big")
    assert pools.match(block_hashes(ROOT, old, BS)) == 0
    assert pools.match(block_hashes(ROOT, new, BS)) == 1
    assert pools.num_cached == 1
    _check(pools)


def test_refcounts_stay_consistent_after_aborts_and_failures() -> None:
    rng = random.Random(0)
    pools = _pools(num_blocks=24)
    sched = Scheduler(pools, max_batch=8, max_model_len=1000)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[str] = []
    for i in range(300):
        if live and rng.random() < 0.45:
            rid = live.pop(rng.randrange(len(live)))
            seq = sched.seqs[rid]
            if seq.generated and rng.random() < 0.5:
                sched.finish(rid)
            else:
                sched.abort(rid)  # a failed transfer, an expired lease, a disconnect
        else:
            ids = [*rng.choice(prefixes)[: rng.randrange(1, 13)], rng.randrange(50)]
            rid = f"r{i}"
            try:
                sched.reserve(rid, len(ids), rng.randrange(1, 6), 10.0, block_hashes(ROOT, ids, BS))
            except OutOfBlocks:
                continue
            if rng.random() < 0.7:
                sched.start(rid, 1)  # the KV arrived: its prompt blocks become cacheable
            live.append(rid)
        _check(pools)
    for rid in live:
        sched.abort(rid)
    assert pools.num_used == 0
    _check(pools)
    assert pools.num_cached == len(list(pools.pools[0].prefix.blocks()))


def test_sp_pools_hit_on_the_chunk_owners() -> None:
    chunk = 8  # two blocks per chunk, chunks round-robin over two ranks
    sp = ParallelConfig(tp=2, mode=ParallelMode.SP, chunk_size=chunk)
    pools = RankPools(16, BS, sp, prefix_cache=True)
    sched = Scheduler(pools, max_batch=8, max_model_len=1000)
    prompt = list(range(30))  # 7 full blocks: rank 0 owns blocks 0,1,4,5; rank 1 owns 2,3,6
    hashes = block_hashes(ROOT, prompt, BS)
    sched.reserve("a", 30, 2, 10.0, hashes)
    sched.start("a", 3)
    a_tables = pools.tables("a")
    sched.finish("a")
    assert [p.num_cached for p in pools.pools] == [4, 3]
    sched.reserve("b", 22, 2, 10.0, hashes[:5])  # 22 tokens: 5 full blocks
    assert sched.seqs["b"].cached_tokens == 20
    b_tables = pools.tables("b")
    for rank in range(2):
        reused = sp.local_length(20, rank) // BS  # rank 0: 12 tokens, rank 1: 8
        assert b_tables[rank][:reused] == a_tables[rank][:reused]
    sched.abort("b")
    _check(pools)
    # Chunks that are not whole blocks: SP then caches nothing (still allocates).
    odd_chunks = ParallelConfig(tp=2, mode=ParallelMode.SP, chunk_size=6)
    odd = RankPools(16, BS, odd_chunks, prefix_cache=True)
    assert not odd.prefix_cache and odd.allocate_prefix("x", 10, hashes) == 0


def test_pool_without_an_index_is_unchanged() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    pool.allocate("a", 8)
    assert pool.num_cached == 0 and pool.free("a") == 2 and pool.num_free == 4
    index = PrefixIndex()
    assert index.insert(1, 0) and not index.insert(1, 2) and not index.insert(3, 0)
    index.park(0)
    assert index.evict() == 0 and len(index) == 0


def test_tpla_prefix_cache_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.runtime.settings import load_settings, placed
    from services.decode.config import engine_config

    assert engine_config(placed(load_settings(device="cpu"))).prefix_cache
    monkeypatch.setenv("TPLA_PREFIX_CACHE", "0")
    assert not engine_config(placed(load_settings(device="cpu"))).prefix_cache
    pools = RankPools(8, BS, ParallelConfig(tp=2), prefix_cache=False)
    sched = Scheduler(pools, max_batch=8, max_model_len=100)
    hashes = block_hashes(ROOT, list(range(8)), BS)
    for rid in ("a", "b"):
        sched.reserve(rid, 8, 1, 10.0, hashes)
        sched.start(rid, 0)
        assert sched.seqs[rid].cached_tokens == 0
        sched.finish(rid)
    assert pools.num_cached == 0 and pools.pools[0].num_free == 8
    assert sched.prefix_queried_tokens == 0  # nothing was looked up
