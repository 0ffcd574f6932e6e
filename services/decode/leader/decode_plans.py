"""The plans a leader's step sends its ranks, built from the scheduler's host lists.

A batch's `DecodePlan` has a row per fed token (a sequence's last token, then its drafts at
the positions after it, each row with the sequence's tables), every table cut to the blocks
under every row's position (padded with -1 for shorter rows). Where the ranks replay
captured steps (`bucketed`), it is padded to its bucket (services/decode/group/buckets.py):
rows of token 0 at position 0 with an all -1 table (each rank writes them to its trash slot;
their logits are dropped), tables to the bucket's width. A request's forks copy their own
blocks from the prompt's with one `CopyPlan`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.decode.config import EngineConfig
from services.decode.group.buckets import batch_bucket, batch_buckets, width_bucket, width_buckets
from services.decode.leader.scheduler import DecodeSequence, Scheduler
from services.decode.leader.verify import StepRows
from services.decode.step_plan import CopyPlan, DecodePlan, MtpPlan


class DecodePlans:
    """A group's step plans, over its scheduler's block tables."""

    def __init__(self, scheduler: Scheduler, cfg: EngineConfig, bucketed: bool) -> None:
        self.scheduler = scheduler
        self.block_size = cfg.block_size
        # Under SP each rank holds its own tables; otherwise one table serves every rank.
        self.ranks = cfg.parallel.token_ranks
        # A CPU step is not padded: a padding row or block is work for nothing there.
        self.bucketed = bucketed

    def step(
        self,
        batch: list[DecodeSequence],
        rows: StepRows,
        count_syncs: bool = False,
        mtp: MtpPlan | None = None,
    ) -> DecodePlan:
        """The batch's plan (see above), `rows` its rows; `count_syncs`: each rank counts its
        host waits; `mtp`: its draft pass."""
        pool, scheduler, bs = self.scheduler.pool, self.scheduler, self.block_size
        per_seq = [pool.tables(s.seq_id) for s in batch]
        sizes = rows.sizes
        blocks = max(
            -(-pool.local_tokens(k, s.next_position + n) // bs)
            for s, n in zip(batch, sizes, strict=True)
            for k in range(self.ranks)
        )
        width, size = max(blocks, 1), rows.total
        if self.bucketed:
            width = width_bucket(width, -(-scheduler.max_model_len // bs))
            size = batch_bucket(size, max(scheduler.max_batch, size))
        pad_row = [-1] * width
        tables = [
            [
                [*tables[k][:width], *pad_row[: max(width - len(tables[k]), 0)]]
                for tables, n in zip(per_seq, sizes, strict=True)
                for _ in range(n)
            ]
            + [pad_row] * (size - rows.total)
            for k in range(self.ranks)
        ]
        pad = [0] * (size - rows.total)
        tokens = [t for s, d in zip(batch, rows.drafts, strict=True) for t in (s.last_token, *d)]
        positions = [
            s.next_position + j for s, n in zip(batch, sizes, strict=True) for j in range(n)
        ]
        return DecodePlan(
            torch.tensor(tokens + pad),
            torch.tensor(positions + pad),
            torch.tensor(tables, dtype=torch.int64),
            count_syncs,
            mtp,
        )

    def buckets(self) -> list[tuple[int, int]]:
        """Every (batch, table width) a step can be padded to, largest first."""
        max_blocks = -(-self.scheduler.max_model_len // self.block_size)
        sizes = batch_buckets(self.scheduler.max_batch)
        return sorted(((b, w) for b in sizes for w in width_buckets(max_blocks)), reverse=True)

    def padding(self) -> Iterator[DecodePlan]:
        """A plan of padding rows at every bucket, largest first: run once before the group
        serves, they compile each kernel variant and capture each bucket's CUDA graph
        (rank/graphs.py), the first growing the workspaces to their final size. Padding rows
        write only the trash slot."""
        for size, width in self.buckets():
            zeros = torch.zeros(size, dtype=torch.int64)
            yield DecodePlan(zeros, zeros, torch.full((self.ranks, size, width), -1))

    def copies(self, seqs: list[DecodeSequence]) -> CopyPlan | None:
        """The copies of the forks' own blocks from the prompt's, on every rank, before
        their first step: one plan for all of a request's forks (None: nothing to copy)."""
        pools = self.scheduler.pool.pools
        per_pool = [
            [pair for seq in seqs for pair in (seq.block_copies[k] if seq.block_copies else [])]
            for k in range(len(pools))
        ]
        width = max(len(p) for p in per_pool)
        if not width:
            return None
        pairs = torch.full((len(per_pool), width, 2), -1, dtype=torch.int64)
        for k, pool_pairs in enumerate(per_pool):
            if pool_pairs:
                pairs[k, : len(pool_pairs)] = torch.tensor(pool_pairs, dtype=torch.int64)
        return CopyPlan(pairs)
