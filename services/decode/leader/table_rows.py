"""The leader's record of its ranks' block tables: which table row each running sequence has,
and how much of its table the ranks hold, so a step sends only what changed.

A sequence gets a row the first step it runs in (its whole table, as its pools hold it, goes
with that step) and keeps it until a step runs without it (finished, aborted): its row is
cleared then and free for the next. Blocks a sequence gains later go as they come. So a
step's edits are O(rows that changed + blocks that are new), never O(batch x context): the
ranks keep the tables (services/decode/rank/block_tables.py). A sequence is known by its
object, not only its id, so a request id that ends and is reserved again between two steps
gets a fresh row. Runs on the leader's loop thread; pure bookkeeping over the pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.kv.block_pool import RankPools
from services.decode.leader.scheduler import DecodeSequence
from services.decode.step_plan import TableEdits


@dataclass
class _Held:
    seq: DecodeSequence
    row: int
    sent: list[int]  # blocks of each pool's table the ranks hold


class TableRows:
    """Table rows 0..rows-1 for running sequences; row `rows` is the padding row (-1)."""

    def __init__(self, pool: RankPools, rows: int) -> None:
        self.pool, self.padding = pool, rows
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: lowest first
        self._held: dict[str, _Held] = {}

    def edits(self, batch: Sequence[DecodeSequence]) -> tuple[list[int], TableEdits]:
        """Each sequence's table row, and the edits that bring the ranks' tables to the
        batch's: rows of sequences that left cleared, new and grown tables written."""
        current = {seq.seq_id: seq for seq in batch}
        cleared: list[int] = []
        for sid in [s for s, h in self._held.items() if current.get(s) is not h.seq]:
            cleared.append(self._release(sid))
        runs: list[int] = []
        blocks: list[int] = []
        rows = []
        pools = self.pool.pools
        for sid, seq in current.items():
            held = self._held.get(sid)
            if held is None:
                held = self._held[sid] = _Held(seq, self._free.pop(), [0] * len(pools))
            for k, pool in enumerate(pools):
                table = pool.table(sid).blocks
                if len(table) > held.sent[k]:
                    runs += (k, held.row, held.sent[k], len(table) - held.sent[k])
                    blocks += table[held.sent[k] :]
                    held.sent[k] = len(table)
            rows.append(held.row)
        edits = TableEdits(
            torch.tensor(cleared, dtype=torch.int64),
            torch.tensor(runs, dtype=torch.int64).view(-1, 4).T,
            torch.tensor(blocks, dtype=torch.int64),
        )
        return rows, edits

    def _release(self, sid: str) -> int:
        row = self._held.pop(sid).row
        self._free.append(row)
        return row

    def held(self) -> dict[str, int]:
        """Each sequence's row, by sequence id (tests rebuild the tables from it)."""
        return {sid: h.row for sid, h in self._held.items()}
