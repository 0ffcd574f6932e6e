"""Continuous-batching scheduler of the decode leader (pure Python, no torch).

Request lifecycle on a decode group:
    RESERVED  blocks held for prompt + max_tokens, waiting for its KV shards and first token;
              freed if not started before its lease expires
    WAITING   KV written, first token known; admitted when the batch has room
    RUNNING   in every step's batch until it finishes
    FINISHED | ABORTED   blocks returned to the pool

Blocks for the whole request (prompt + max_tokens) are reserved up front. That makes
admission the only place a request can be refused for memory: a running request never
stalls or gets preempted mid-stream, and nothing can deadlock.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from common.kv.block_pool import OutOfBlocks, RankPools


class SeqState(enum.Enum):
    RESERVED = "reserved"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class SchedulerError(ValueError):
    """A request the scheduler cannot take (unknown id, wrong state, too long)."""


@dataclass
class Sequence:
    request_id: str
    prompt_len: int
    max_tokens: int
    state: SeqState = SeqState.RESERVED
    lease_deadline: float = 0.0
    generated: list[int] = field(default_factory=list)
    # Prefix reuse: the full prompt blocks' hashes (indexed once the KV is written) and how
    # many leading prompt tokens the group held already (their KV is not shipped).
    block_hashes: list[int] = field(default_factory=list)
    cached_tokens: int = 0

    @property
    def next_position(self) -> int:
        """Position of the last generated token, which the next step feeds in."""
        return self.prompt_len + len(self.generated) - 1

    @property
    def last_token(self) -> int:
        return self.generated[-1]


class Scheduler:
    def __init__(self, pool: RankPools, max_batch: int, max_model_len: int) -> None:
        self.pool = pool
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.seqs: dict[str, Sequence] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        # Prefix-cache counters in prompt tokens (the decode service's metrics).
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def reserve(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        deadline: float,
        block_hashes: list[int] | None = None,
    ) -> list[list[int]]:
        """Hold blocks for the whole request on every rank; returns each rank's table.

        `block_hashes` (the prompt's full blocks, `common.kv.prefix_cache`): reuse the longest
        cached prefix; the sequence's `cached_tokens` says how much."""
        if request_id in self.seqs:
            raise SchedulerError(f"request {request_id!r} already exists")
        if prompt_len < 1 or max_tokens < 1:
            raise SchedulerError("prompt_len and max_tokens must be positive")
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise SchedulerError(
                f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds the "
                f"context limit of {self.max_model_len} tokens"
            )
        # The last generated token is never fed back, so it needs no slot.
        hashes = list(block_hashes or ())
        cached = 0
        if hashes and self.pool.prefix_cache:
            cached = self.pool.allocate_prefix(request_id, total - 1, hashes)  # OutOfBlocks
            tables = self.pool.tables(request_id)
            self.prefix_queried_tokens += prompt_len
            self.prefix_hit_tokens += cached
        else:
            hashes = []
            tables = self.pool.allocate(request_id, total - 1)  # raises OutOfBlocks
        self.seqs[request_id] = Sequence(
            request_id,
            prompt_len,
            max_tokens,
            lease_deadline=deadline,
            block_hashes=hashes,
            cached_tokens=cached,
        )
        return tables

    def start(self, request_id: str, first_token: int) -> Sequence:
        seq = self._get(request_id)
        if seq.state is not SeqState.RESERVED:
            raise SchedulerError(f"request {request_id!r} is {seq.state.value}, not reserved")
        seq.generated.append(first_token)
        seq.state = SeqState.WAITING
        # The prompt's KV is complete now (every shard acknowledged before the first token
        # came here): its full blocks may serve later prompts. Only prompt blocks: they hold
        # the exact prefill's latents, while generated tokens' latents come from the decode
        # step (sliced in TPLA, and not bit-equal to a prefill anywhere), so reusing them
        # would make a request's output depend on what ran before it.
        if seq.block_hashes:
            self.pool.cache_prompt(request_id, seq.block_hashes)
        self.waiting.append(request_id)
        return seq

    def abort(self, request_id: str) -> bool:
        """Drop a request in any live state and free its blocks; False if unknown/ended."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.state in (SeqState.FINISHED, SeqState.ABORTED):
            return False
        self._end(seq, SeqState.ABORTED)
        return True

    def expire_leases(self, now: float) -> list[str]:
        expired = [
            s.request_id
            for s in self.seqs.values()
            if s.state is SeqState.RESERVED and s.lease_deadline <= now
        ]
        for rid in expired:
            self._end(self.seqs[rid], SeqState.ABORTED)
        return expired

    def schedule(self) -> list[Sequence]:
        """The batch for the next step: everything running plus admitted waiters."""
        while self.waiting and len(self.running) < self.max_batch:
            rid = self.waiting.popleft()
            self.seqs[rid].state = SeqState.RUNNING
            self.running.append(rid)
        return [self.seqs[rid] for rid in self.running]

    def append(self, request_id: str, token: int, finished: bool) -> None:
        seq = self.seqs[request_id]
        seq.generated.append(token)
        if finished or len(seq.generated) >= seq.max_tokens:
            self._end(seq, SeqState.FINISHED)

    def finish(self, request_id: str) -> None:
        self._end(self._get(request_id), SeqState.FINISHED)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _get(self, request_id: str) -> Sequence:
        try:
            return self.seqs[request_id]
        except KeyError:
            raise SchedulerError(f"unknown request {request_id!r}") from None

    def _end(self, seq: Sequence, state: SeqState) -> None:
        if seq.request_id in self.running:
            self.running.remove(seq.request_id)
        if seq.request_id in self.waiting:
            self.waiting.remove(seq.request_id)
        seq.state = state
        self.pool.free(seq.request_id)
        del self.seqs[seq.request_id]


__all__ = ["OutOfBlocks", "Scheduler", "SchedulerError", "SeqState", "Sequence"]
