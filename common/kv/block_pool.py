"""Paged KV block allocator: fixed-size token blocks, reference counts, per-request tables.

Pure Python (no torch): the decode leader owns one allocator for its whole rank group.
Every rank's pool has the same number of blocks, so a block id names the same slot range on
every rank; each rank just stores its own slice of the latent there.

Block lifecycle: FREE -> (allocate) IN_USE -> (last reference released) FREE.
A request's table grows one block at a time as its sequence grows; `free` releases all of
its references at once (finish, abort, failed transfer, expired lease). `fork` starts a
sequence that shares another's full blocks (n > 1 choices of one prompt): a shared block is
released only when its last holder ends.
With a prefix index (`common.kv.prefix_cache`), a released block that holds an indexed prompt
block is CACHED instead of FREE: reusable by a later request with the same prefix, evicted
(least recently used first) only when the pool needs room. Every reference goes through
`_acquire` / `_take` and `_release`, so a cached block a fork shares is never evicted while
any holder lives.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from common.kv.prefix_cache import PrefixIndex
from common.parallel import ParallelConfig


class BlockState(enum.Enum):
    FREE = "free"
    IN_USE = "in_use"
    CACHED = "cached"  # no live reference, kept for prefix reuse until evicted


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for the request; the caller queues or rejects it."""


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix: PrefixIndex | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, BlockTable] = {}
        self.prefix = prefix  # None: released blocks are simply free
        # Counts the times a table gained blocks: a reader of the tables that sees it
        # unchanged knows that none grew (the decode leader's table edits).
        self.growths = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks a request could get now: free ones and cached ones nobody references."""
        return len(self._free) + self.num_cached

    @property
    def num_cached(self) -> int:
        """Cached blocks without live references (evictable)."""
        return self.prefix.num_parked if self.prefix is not None else 0

    @property
    def num_used(self) -> int:
        """Blocks live requests reference."""
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> BlockTable:
        return self._tables[request_id]

    def state(self, block: int) -> BlockState:
        if self._refcount[block]:
            return BlockState.IN_USE
        if self.prefix is not None and block in self.prefix:
            return BlockState.CACHED
        return BlockState.FREE

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tables

    # -- mutations -------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Reserve blocks for a new request's first `num_tokens` tokens."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        self._tables[request_id] = BlockTable()
        try:
            return self.grow(request_id, num_tokens)
        except OutOfBlocks:
            del self._tables[request_id]
            raise

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Extend the request's table to cover `num_tokens` tokens (all-or-nothing)."""
        table = self._tables[request_id]
        need = self.blocks_for(num_tokens) - len(table.blocks)
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} blocks, {self.num_free} free")
        self.growths += need > 0
        for _ in range(max(need, 0)):
            block = self._take()
            self._refcount[block] = 1
            table.blocks.append(block)
        table.num_tokens = max(table.num_tokens, num_tokens)
        return table.blocks

    def share(self, request_id: str, source_id: str, num_blocks: int) -> None:
        """Start a request with the first `num_blocks` full blocks of another (prefix reuse)."""
        src = self._tables[source_id].blocks[:num_blocks]
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        for block in src:
            self._acquire(block)
        self._tables[request_id] = BlockTable(list(src), len(src) * self.block_size)

    def fork(
        self, request_id: str, source_id: str, shared_tokens: int, num_tokens: int
    ) -> list[tuple[int, int]]:
        """Start `request_id` as a copy of the first `shared_tokens` tokens of `source_id`,
        with room for `num_tokens` tokens (all-or-nothing).

        The full blocks are shared (one more reference each). A partly filled last block
        cannot be: both sequences write their next tokens into it. The fork gets a fresh
        block in its place (copy on write, done at once because every fork writes there next);
        returns that copy as [(source block, fork's block)], or [] when the shared tokens fill
        whole blocks. The caller copies the block's slots before the fork's first step.
        """
        if num_tokens < shared_tokens:
            raise ValueError("a fork holds at least the tokens it shares")
        full, partial = divmod(shared_tokens, self.block_size)
        self.share(request_id, source_id, full)
        try:
            self.grow(request_id, num_tokens)
        except OutOfBlocks:
            self.free(request_id)
            raise
        if not partial:
            return []
        return [(self._tables[source_id].blocks[full], self._tables[request_id].blocks[full])]

    def free(self, request_id: str) -> int:
        """Release the request's references; returns how many blocks became free."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return 0
        released = 0
        for block in table.blocks:
            self._refcount[block] -= 1
            assert self._refcount[block] >= 0, f"block {block} over-released"
            if self._refcount[block] == 0:
                self._release(block)
                released += 1
        return released

    # -- prefix reuse (with a PrefixIndex) -----------------------------------------------------

    def allocate_cached(self, request_id: str, num_tokens: int, cached: list[int]) -> list[int]:
        """`allocate`, starting the table with `cached` (indexed blocks of a matched prefix,
        in order) instead of new blocks; all-or-nothing like `allocate`."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        assert self.prefix is not None and all(b in self.prefix for b in cached)
        for block in cached:
            self._acquire(block)
        self._tables[request_id] = BlockTable(list(cached), len(cached) * self.block_size)
        try:
            return self.grow(request_id, num_tokens)
        except OutOfBlocks:
            self.free(request_id)
            raise

    def cache_blocks(self, request_id: str, hashes: list[tuple[int, int]]) -> int:
        """Index the request's written full blocks: (index in its table, block hash) pairs.
        Returns how many became newly cached."""
        assert self.prefix is not None
        table = self._tables[request_id]
        return sum(self.prefix.insert(h, table.blocks[i]) for i, h in hashes)

    def _acquire(self, block: int) -> None:
        if self._refcount[block] == 0:
            assert self.prefix is not None
            self.prefix.unpark(block)
        self._refcount[block] += 1

    def _take(self) -> int:
        """A block for a new reference: a free one, else the least recently used cached one."""
        if self._free:
            return self._free.popleft()
        assert self.prefix is not None and self.prefix.num_parked, "checked by the caller"
        return self.prefix.evict()

    def _release(self, block: int) -> None:
        if self.prefix is not None and block in self.prefix:
            self.prefix.park(block)
        else:
            self._free.append(block)


class RankPools:
    """The leader's view of every rank's pool.

    One pool per `ParallelConfig.token_ranks`: where every rank caches every token (TPLA,
    MLA-TP) one allocator serves all ranks and the block tables are identical; in SP rank k
    caches only its chunks, so each rank has its own allocator and table, sized by how many
    of the request's tokens it owns.

    Prefix reuse (`prefix_cache`): prompt block b (tokens [b * bs, (b + 1) * bs)) lives in
    one pool, `token_owner(b * bs)`'s, at its local block local_position(b * bs) / bs. The
    leader matches a prompt's chain block by block in those pools and every rank follows its
    table, so all ranks agree on the hit. It needs every block whole in one pool
    (`keeps_whole_blocks`); otherwise it caches nothing.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        parallel: ParallelConfig,
        prefix_cache: bool = False,
    ) -> None:
        self.parallel = parallel
        self.block_size = block_size
        self.prefix_cache = prefix_cache and parallel.keeps_whole_blocks(block_size)
        self.pools = [
            BlockPool(num_blocks, block_size, PrefixIndex() if self.prefix_cache else None)
            for _ in range(parallel.token_ranks)
        ]

    def local_tokens(self, rank: int, total: int) -> int:
        return self.parallel.local_length(total, rank)

    def allocate(self, request_id: str, num_tokens: int) -> list[list[int]]:
        """Reserve on every rank (all-or-nothing); returns each rank's block table."""
        self.allocate_prefix(request_id, num_tokens, [])
        return self.tables(request_id)

    def allocate_prefix(self, request_id: str, num_tokens: int, hashes: list[int]) -> int:
        """Reserve on every rank, reusing the longest cached prefix of the prompt's block
        `hashes` (all-or-nothing); returns the tokens reused (whole blocks)."""
        hit = self.match(hashes)
        done: list[BlockPool] = []
        try:
            for k, pool in enumerate(self.pools):
                tokens = self.local_tokens(k, num_tokens)
                if hit and pool.prefix is not None:
                    cached = [self._cached_block(b, hashes[b]) for b in self._owned(k, hit)]
                    pool.allocate_cached(request_id, tokens, cached)
                else:
                    pool.allocate(request_id, tokens)
                done.append(pool)
        except OutOfBlocks:
            for pool in done:
                pool.free(request_id)
            raise
        if hit:
            for pool in self.pools:
                if pool.prefix is not None:
                    pool.prefix.touch(hashes[:hit])
        return hit * self.block_size

    def match(self, hashes: list[int]) -> int:
        """How many leading prompt blocks are cached (in the pools that hold them)."""
        if not self.prefix_cache:
            return 0
        for b, h in enumerate(hashes):
            prefix = self.pools[self._home(b)[0]].prefix
            assert prefix is not None
            if prefix.get(h) is None:
                return b
        return len(hashes)

    def cache_prompt(self, request_id: str, hashes: list[int]) -> None:
        """Index the request's prompt blocks (its KV is written): `hashes` of its full prompt
        blocks, in order. Blocks it reused are indexed already and stay as they are."""
        if not self.prefix_cache:
            return
        per_pool: list[list[tuple[int, int]]] = [[] for _ in self.pools]
        for b, h in enumerate(hashes):
            k, local = self._home(b)
            per_pool[k].append((local, h))
        for pool, pairs in zip(self.pools, per_pool, strict=True):
            if pairs:
                pool.cache_blocks(request_id, pairs)

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to `limit` cached block hashes of the group, most recently used first."""
        share = -(-limit // len(self.pools))
        out = [h for pool in self.pools if pool.prefix for h in pool.prefix.recent(share)]
        return out[:limit]

    def _home(self, block: int) -> tuple[int, int]:
        """(pool, local block index) of prompt block `block`."""
        pos, par = block * self.block_size, self.parallel
        return par.token_owner(pos), par.local_position(pos) // self.block_size

    def _owned(self, pool: int, blocks: int) -> list[int]:
        """The first `blocks` prompt blocks that live in `pool`, in order."""
        return [b for b in range(blocks) if self._home(b)[0] == pool]

    def _cached_block(self, block: int, block_hash: int) -> int:
        prefix = self.pools[self._home(block)[0]].prefix
        assert prefix is not None
        found = prefix.get(block_hash)
        assert found is not None, "matched just before"
        return found

    def fork(
        self, request_id: str, source_id: str, shared_tokens: int, num_tokens: int
    ) -> list[list[tuple[int, int]]]:
        """`BlockPool.fork` on every rank's pool (all-or-nothing); each pool's block copies
        (one list when every rank shares the tables; SP: per rank, for its own tokens)."""
        copies: list[list[tuple[int, int]]] = []
        try:
            for k, pool in enumerate(self.pools):
                copies.append(
                    pool.fork(
                        request_id,
                        source_id,
                        self.local_tokens(k, shared_tokens),
                        self.local_tokens(k, num_tokens),
                    )
                )
        except OutOfBlocks:
            self.free(request_id)
            raise
        return copies

    def free(self, request_id: str) -> int:
        return sum(pool.free(request_id) for pool in self.pools)

    def tables(self, request_id: str) -> list[list[int]]:
        tables = [list(pool.table(request_id).blocks) for pool in self.pools]
        return tables * self.parallel.tp if len(tables) == 1 else tables

    @property
    def num_used(self) -> int:
        return sum(pool.num_used for pool in self.pools)

    @property
    def num_cached(self) -> int:
        return sum(pool.num_cached for pool in self.pools)

    @property
    def num_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools)
