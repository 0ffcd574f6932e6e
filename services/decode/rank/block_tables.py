"""A decode rank's block tables: one persistent tensor, a row per running sequence.

The leader gives each running sequence a table row (services/decode/leader/table_rows.py)
and sends, with each step, only what changed: rows cleared (their sequence left) and runs of
blocks written (a new sequence's table, or blocks a sequence gained). The rank applies them
in place (`apply`: O(changed), whatever the context), and the step reads its rows' tables out
of the tensor by row index (`rows`), on the device. The tensor never moves, so a captured CUDA
graph reads it as one of its inputs (services/decode/rank/graphs.py): updating it in place
before a replay is all the graph needs. The last row is all -1: the padding rows' table.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.runtime.host_syncs import host_side
from common.runtime.transfers import to_device_tensor
from services.decode.step_plan import TableEdits


class RankTables:
    """`rows` table rows of `width` blocks (-1: none) plus the padding row, on `device`;
    `pool`: the pool whose runs this rank applies (its own under SP, else 0)."""

    def __init__(self, rows: int, width: int, pool: int, device: torch.device) -> None:
        self.pool, self.width, self.padding = pool, width, rows
        self.table = torch.full((rows + 1, width), -1, dtype=torch.int64, device=device)

    def apply(self, edits: TableEdits) -> None:
        """The leader's edits, in place: the cleared rows first, then this pool's runs."""
        device = self.table.device
        if len(edits.cleared):
            self.table.index_fill_(0, to_device_tensor(edits.cleared, device), -1)
        if not edits.runs.shape[1]:
            return
        # The plan's words are host tensors: their arithmetic waits for no device.
        with host_side():
            flat, values = _run_cells(edits, self.pool, self.width)
        if len(flat):
            cells = self.table.view(-1)
            cells.index_copy_(0, to_device_tensor(flat, device), to_device_tensor(values, device))

    def rows(self, slots: Tensor, width: int) -> Tensor:
        """The tables [B, width] of the rows `slots` [B] (on the device): device work, no
        host read, so a captured step runs it."""
        return self.table[:, :width].index_select(0, slots)


def _run_cells(edits: TableEdits, pool: int, width: int) -> tuple[Tensor, Tensor]:
    """The flat cells of the table (row * width + column) that `pool`'s runs write, and
    their blocks, in one vectorized pass over the runs (host tensors)."""
    pools, rows, starts, counts = edits.runs
    run = torch.repeat_interleave(torch.arange(len(counts)), counts)
    first = torch.cumsum(counts, 0) - counts  # each run's first index into `blocks`
    column = starts[run] + torch.arange(len(run)) - first[run]
    flat = rows[run] * width + column
    mine = pools[run] == pool
    if bool(mine.all()):
        return flat, edits.blocks
    return flat[mine], edits.blocks[mine]
