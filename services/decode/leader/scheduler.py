"""Continuous-batching scheduler of the decode leader (pure Python, no torch).

Request lifecycle on a decode group:
    RESERVED  blocks held for prompt + max_tokens, waiting for its KV shards and first token;
              freed if neither started nor renewed (`renew`: a shard landed) within a lease
    WAITING   KV written, first token known; admitted when the batch has room
    RUNNING   in every step's batch until it finishes
    FINISHED | ABORTED   blocks returned to the pool

Blocks for the whole request (prompt + max_tokens) are reserved up front. That makes
admission the only place a request can be refused for memory: a running request never
stalls or gets preempted mid-stream, and nothing can deadlock.

A request with n > 1 choices is n sequences (forks) from its reservation on: fork 0 is keyed
by the request id and receives the prompt's KV; fork i (`fork_id`) shares fork 0's full
prompt blocks and holds its own copy of the partly filled last one (`block_copies`, which the
engine copies before the forks' first step) plus its own room for max_tokens. Each fork runs
and ends on its own; aborting or expiring the request ends every fork still live.
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


def fork_id(request_id: str, choice: int) -> str:
    """The key of a request's fork `choice` in the scheduler and the block pools."""
    return request_id if choice == 0 else f"{request_id}#{choice}"


@dataclass
class DecodeSequence:
    request_id: str
    prompt_len: int
    max_tokens: int
    state: SeqState = SeqState.RESERVED
    lease_deadline: float = 0.0
    generated: list[int] = field(default_factory=list)
    choice: int = 0
    # Per pool: the (source, destination) blocks to copy before this fork's first step.
    block_copies: list[list[tuple[int, int]]] = field(default_factory=list)
    # Prefix reuse (fork 0): the full prompt blocks' hashes (indexed once the KV is written)
    # and how many leading prompt tokens the group held already (their KV is not shipped).
    block_hashes: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_ids: tuple[int, ...] = ()  # when reserved with them (draft proposers read them)
    # Its key in the scheduler and the pools (`fork_id`); set once: every step reads it.
    seq_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.seq_id = fork_id(self.request_id, self.choice)

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
        self.seqs: dict[str, DecodeSequence] = {}  # by fork id
        self.requests: dict[str, list[str]] = {}  # request id -> its live forks' ids
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
        n: int = 1,
        prompt_ids: tuple[int, ...] = (),
    ) -> list[list[int]]:
        """Hold blocks for the whole request on every rank: the prompt once and room for
        max_tokens per choice. Returns each rank's table of fork 0 (where the KV goes).

        `block_hashes` (the prompt's full blocks, `common.kv.prefix_cache`): reuse the longest
        cached prefix; fork 0's `cached_tokens` says how much. The forks share those blocks
        like the rest of the prompt's full blocks (a reference each)."""
        ids = [fork_id(request_id, i) for i in range(n)]
        if request_id in self.requests or any(i in self.seqs for i in ids):
            raise SchedulerError(f"request {request_id!r} already exists")
        if prompt_len < 1 or max_tokens < 1 or n < 1:
            raise SchedulerError("prompt_len, max_tokens and n must be positive")
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
        else:
            hashes = []
            tables = self.pool.allocate(request_id, total - 1)  # raises OutOfBlocks
        seqs = [
            DecodeSequence(
                request_id,
                prompt_len,
                max_tokens,
                lease_deadline=deadline,
                block_hashes=hashes,
                cached_tokens=cached,
                prompt_ids=prompt_ids,
            )
        ]
        try:
            for i, fid in enumerate(ids[1:], start=1):
                copies = self.pool.fork(fid, request_id, prompt_len, total - 1)
                seqs.append(
                    DecodeSequence(
                        request_id,
                        prompt_len,
                        max_tokens,
                        lease_deadline=deadline,
                        choice=i,
                        block_copies=copies,
                        prompt_ids=prompt_ids,
                    )
                )
        except OutOfBlocks:
            for fid in ids:
                self.pool.free(fid)
            raise
        if hashes:
            self.prefix_queried_tokens += prompt_len
            self.prefix_hit_tokens += cached
        for seq in seqs:
            self.seqs[seq.seq_id] = seq
        self.requests[request_id] = ids
        return tables

    def start(self, request_id: str, first_tokens: int | list[int]) -> list[DecodeSequence]:
        """The reserved request's forks start, fork i from first_tokens[i]."""
        firsts = [first_tokens] if isinstance(first_tokens, int) else list(first_tokens)
        ids = self.requests.get(request_id)
        if ids is None:
            raise SchedulerError(f"unknown request {request_id!r}")
        seqs = [self.seqs[i] for i in ids]
        if any(s.state is not SeqState.RESERVED for s in seqs):
            raise SchedulerError(f"request {request_id!r} is {seqs[0].state.value}, not reserved")
        if len(firsts) != len(seqs):
            raise SchedulerError(
                f"request {request_id!r} has {len(seqs)} choices, got {len(firsts)} first tokens"
            )
        for seq, token in zip(seqs, firsts, strict=True):
            seq.generated.append(token)
            seq.state = SeqState.WAITING
            self.waiting.append(seq.seq_id)
        # The prompt's KV is complete now (every shard acknowledged before the first token
        # came here): its full blocks may serve later prompts. Only prompt blocks: they hold
        # the exact prefill's latents, while generated tokens' latents come from the decode
        # step (sliced in TPLA, and not bit-equal to a prefill anywhere), so reusing them
        # would make a request's output depend on what ran before it. Fork 0 holds them
        # (every fork shares the same full blocks).
        if seqs[0].block_hashes:
            self.pool.cache_prompt(request_id, seqs[0].block_hashes)
        return seqs

    def forks(self, request_id: str) -> list[DecodeSequence]:
        """The request's live forks (none when it is unknown or over)."""
        return [self.seqs[i] for i in self.requests.get(request_id, ())]

    def abort(self, request_id: str, choices: frozenset[int] | None = None) -> list[DecodeSequence]:
        """End the request's live forks (only `choices` when given) and free their blocks;
        returns the forks ended (none when the request is unknown or over)."""
        ended = [s for s in self.forks(request_id) if choices is None or s.choice in choices]
        for seq in ended:
            self._end(seq, SeqState.ABORTED)
        return ended

    def renew(self, request_id: str, deadline: float) -> None:
        """Progress on a reservation (one of its KV shards landed): its lease runs to
        `deadline` at least. A request that is unknown (a late shard of an expired or aborted
        one) or started has no lease to renew."""
        for seq in self.forks(request_id):
            if seq.state is SeqState.RESERVED:
                seq.lease_deadline = max(seq.lease_deadline, deadline)

    def expire_leases(self, now: float) -> list[str]:
        """End reservations neither started nor renewed by their lease deadline; their
        request ids."""
        expired = [
            rid
            for rid, ids in self.requests.items()
            if any(
                self.seqs[i].state is SeqState.RESERVED and self.seqs[i].lease_deadline <= now
                for i in ids
            )
        ]
        for rid in expired:
            self.abort(rid)
        return expired

    def schedule(self) -> list[DecodeSequence]:
        """The batch for the next step: everything running plus admitted waiters."""
        while self.waiting and len(self.running) < self.max_batch:
            rid = self.waiting.popleft()
            self.seqs[rid].state = SeqState.RUNNING
            self.running.append(rid)
        return [self.seqs[rid] for rid in self.running]

    def append(self, seq_id: str, token: int, finished: bool) -> None:
        """A running sequence's next token; `finished`: it ends the sequence. The caller
        decides (the leader's finish check, which ends a sequence at its max_tokens)."""
        seq = self.seqs[seq_id]
        seq.generated.append(token)
        assert finished or len(seq.generated) < seq.max_tokens, "past the reserved tokens"
        if finished:
            self._end(seq, SeqState.FINISHED)

    def finish(self, seq_id: str) -> None:
        self._end(self._get(seq_id), SeqState.FINISHED)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _get(self, seq_id: str) -> DecodeSequence:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise SchedulerError(f"unknown request {seq_id!r}") from None

    def _end(self, seq: DecodeSequence, state: SeqState) -> None:
        sid = seq.seq_id
        if sid in self.running:
            self.running.remove(sid)
        if sid in self.waiting:
            self.waiting.remove(sid)
        seq.state = state
        self.pool.free(sid)
        del self.seqs[sid]
        ids = self.requests[seq.request_id]
        ids.remove(sid)
        if not ids:
            del self.requests[seq.request_id]


__all__ = ["DecodeSequence", "OutOfBlocks", "Scheduler", "SchedulerError", "SeqState", "fork_id"]
