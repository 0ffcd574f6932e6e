"""The plans a leader's step sends its ranks, built from the scheduler's host lists.

A batch's `DecodePlan` has a row per fed token (a sequence's last token, then its drafts at
the positions after it, each row on the sequence's table row), the tables' edits since the
last step (leader/table_rows.py: the ranks keep the tables) and the width the step reads:
the blocks under every row's position. Where the ranks replay captured steps (`bucketed`),
it is padded to its bucket (common/step_shapes.py): rows of token 0 at position 0
on the all -1 padding row (each rank writes them to its trash slot; their logits are
dropped), the width to the bucket's. A request's forks copy their own blocks from the
prompt's with one `CopyPlan`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from common.step_shapes import StepShape, batch_bucket, step_shapes, width_bucket
from services.decode.config import EngineConfig, SpecConfig
from services.decode.leader.scheduler import DecodeSequence, Scheduler
from services.decode.leader.table_rows import TableRows
from services.decode.leader.verify import StepRows
from services.decode.step_plan import CopyPlan, DecodePlan, MtpPlan


class DecodePlans:
    """A group's step plans, over its scheduler's block tables."""

    def __init__(self, scheduler: Scheduler, cfg: EngineConfig, bucketed: bool) -> None:
        self.scheduler = scheduler
        self.block_size = cfg.block_size
        self.parallel = cfg.parallel
        # Under SP each rank holds its own tables; otherwise one table serves every rank.
        self.ranks = cfg.parallel.token_ranks
        # A CPU step is not padded: a padding row or block is work for nothing there.
        self.bucketed = bucketed
        # Which table row each running sequence has on the ranks, and what they hold of it.
        self.tables = TableRows(scheduler.pool, scheduler.max_batch)

    def step(
        self,
        batch: list[DecodeSequence],
        rows: StepRows,
        count_syncs: bool = False,
        mtp: MtpPlan | None = None,
    ) -> DecodePlan:
        """The batch's plan (see above), `rows` its rows; `count_syncs`: each rank counts its
        host waits; `mtp`: its draft pass."""
        table_rows, edits = self.tables.edits(batch)
        firsts = [s.prompt_len + len(s.generated) - 1 for s in batch]  # next_position
        tokens, positions, slots = _rows(batch, rows.drafts, firsts, table_rows)
        # Tokens under the longest row: a rank's share of them only grows with it.
        longest = max(p + 1 for p in positions)
        bs = self.block_size
        blocks = max(-(-self.parallel.local_length(longest, k) // bs) for k in range(self.ranks))
        # A draft pass may run more rows than its step (the last step's kept runs).
        passes = 0 if mtp is None else mtp.rows.shape[1]
        width, size = max(blocks, 1), max(len(tokens), passes)
        if self.bucketed:
            width = width_bucket(width, self.max_blocks, bs)
            size = batch_bucket(size, max(self.scheduler.max_batch, size))
            mtp = None if mtp is None else mtp.padded(size)
        pad = size - len(tokens)
        flat = [*tokens, *[0] * pad, *positions, *[0] * pad, *slots, *[self.tables.padding] * pad]
        tokens_t, positions_t, slots_t = torch.tensor(flat, dtype=torch.int64).view(3, size)
        return DecodePlan(tokens_t, positions_t, slots_t, width, edits, count_syncs, mtp)

    @property
    def max_blocks(self) -> int:
        """The most blocks a sequence's table holds (its context limit's)."""
        return -(-self.scheduler.max_model_len // self.block_size)

    def shapes(self, spec: SpecConfig, mtp: bool) -> list[StepShape]:
        """Every shape a step can be padded to, largest first; `mtp`: the group holds the
        MTP module, whose draft pass runs in the steps that speculate (`spec`)."""
        drafting = spec.method == "mtp" and mtp
        rows = spec.max_batch * (spec.tokens + 1) if drafting else 0
        return step_shapes(self.scheduler.max_batch, self.max_blocks, self.block_size, rows)

    def padding(self, spec: SpecConfig, mtp: bool, hidden: int) -> Iterator[DecodePlan]:
        """A plan of padding rows at every shape (`shapes`), largest first: run once before
        the group serves, they compile each kernel variant and capture each shape's CUDA
        graph (rank/graphs.py), the first growing the workspaces to their final size.
        Padding rows write only the trash slot. `hidden`: the model's (a seed's width)."""
        for shape in self.shapes(spec, mtp):
            size = shape.batch
            zeros = torch.zeros(size, dtype=torch.int64)
            slots = torch.full((size,), self.tables.padding)
            draft = MtpPlan.padding(size, spec.tokens - 1, hidden) if shape.drafts else None
            yield DecodePlan(zeros, zeros, slots, shape.width, mtp=draft)

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


def _rows(
    batch: list[DecodeSequence], drafts: list[list[int]], firsts: list[int], table_rows: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """The step's rows: each sequence's last token at its next position, then its drafts at
    the positions after it, all on its table row."""
    if not any(drafts):
        return [s.generated[-1] for s in batch], firsts, table_rows
    tokens, positions, slots = [], [], []
    for seq, d, first, row in zip(batch, drafts, firsts, table_rows, strict=True):
        tokens += (seq.generated[-1], *d)
        positions += range(first, first + 1 + len(d))
        slots += [row] * (1 + len(d))
    return tokens, positions, slots
