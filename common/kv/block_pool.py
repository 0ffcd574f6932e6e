"""Paged KV block allocator: fixed-size token blocks, reference counts, per-request tables.

Pure Python (no torch): the decode leader owns one allocator for its whole rank group.
Every rank's pool has the same number of blocks, so a block id names the same slot range on
every rank; each rank just stores its own slice of the latent there.

Block lifecycle: FREE -> (allocate) IN_USE -> (last reference released) FREE.
A request's table grows one block at a time as its sequence grows; `free` releases all of
its references at once (finish, abort, failed transfer, expired lease). `fork` starts a
sequence that shares another's full blocks (n > 1 choices of one prompt): a shared block is
freed only when its last holder ends.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from common.kv.chunks import local_length


class BlockState(enum.Enum):
    FREE = "free"
    IN_USE = "in_use"


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for the request; the caller queues or rejects it."""


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, BlockTable] = {}

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request could grow to `num_tokens` with the blocks free now."""
        have = len(self._tables[request_id].blocks) if request_id in self._tables else 0
        return self.blocks_for(num_tokens) - have <= self.num_free

    def table(self, request_id: str) -> BlockTable:
        return self._tables[request_id]

    def state(self, block: int) -> BlockState:
        return BlockState.IN_USE if self._refcount[block] else BlockState.FREE

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
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} blocks, {len(self._free)} free")
        for _ in range(max(need, 0)):
            block = self._free.popleft()
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
            self._refcount[block] += 1
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
                self._free.append(block)
                released += 1
        return released


class RankPools:
    """The leader's view of every rank's pool.

    TPLA / MLA-TP: every rank caches every token, so one allocator serves all ranks and the
    block tables are identical. SP: rank k caches only its chunks, so each rank has its own
    allocator and table, sized by how many of the request's tokens it owns.
    """

    def __init__(
        self, num_blocks: int, block_size: int, ranks: int, chunk_size: int | None = None
    ) -> None:
        self.ranks = ranks
        self.chunk_size = chunk_size
        self.block_size = block_size
        count = 1 if chunk_size is None else ranks
        self.pools = [BlockPool(num_blocks, block_size) for _ in range(count)]

    def local_tokens(self, rank: int, total: int) -> int:
        if self.chunk_size is None:
            return total
        return local_length(total, rank, self.chunk_size, self.ranks)

    def allocate(self, request_id: str, num_tokens: int) -> list[list[int]]:
        """Reserve on every rank (all-or-nothing); returns each rank's block table."""
        done: list[BlockPool] = []
        try:
            for k, pool in enumerate(self.pools):
                pool.allocate(request_id, self.local_tokens(k, num_tokens))
                done.append(pool)
        except OutOfBlocks:
            for pool in done:
                pool.free(request_id)
            raise
        return self.tables(request_id)

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
        return tables * self.ranks if len(tables) == 1 else tables

    @property
    def num_used(self) -> int:
        return sum(pool.num_used for pool in self.pools)

    @property
    def num_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools)
