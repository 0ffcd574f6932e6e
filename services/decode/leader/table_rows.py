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

_NO_EDITS = TableEdits.none()  # a steady step's (plans only read it)


@dataclass
class _Held:
    seq: DecodeSequence
    row: int
    tables: list[list[int]]  # its table in each pool (the pool's own list, grown in place)
    sent: list[int]  # blocks of each table the ranks hold


class TableRows:
    """Table rows 0..rows-1 for running sequences; row `rows` is the padding row (-1)."""

    def __init__(self, pool: RankPools, rows: int) -> None:
        self.pool, self.padding = pool, rows
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: lowest first
        self._held: dict[str, _Held] = {}
        self._growths = -1  # the pools' growth count when the tables were last looked at

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
        every = self._held
        growths = sum(pool.growths for pool in self.pool.pools)
        # No table grew since the last step: only the new sequences' tables are looked at.
        grown, self._growths = growths != self._growths, growths
        for sid, seq in current.items():
            held = every.get(sid)
            if held is None:
                held = every[sid] = self._take(sid, seq)
            elif not grown:
                rows.append(held.row)
                continue
            for k, table in enumerate(held.tables):
                sent = held.sent[k]
                if len(table) > sent:
                    runs += (k, held.row, sent, len(table) - sent)
                    blocks += table[sent:]
                    held.sent[k] = len(table)
            rows.append(held.row)
        if not (cleared or runs):
            return rows, _NO_EDITS
        edits = TableEdits(
            torch.tensor(cleared, dtype=torch.int64),
            torch.tensor(runs, dtype=torch.int64).view(-1, 4).T,
            torch.tensor(blocks, dtype=torch.int64),
        )
        return rows, edits

    def _take(self, sid: str, seq: DecodeSequence) -> _Held:
        tables = [pool.table(sid).blocks for pool in self.pool.pools]
        return _Held(seq, self._free.pop(), tables, [0] * len(tables))

    def _release(self, sid: str) -> int:
        row = self._held.pop(sid).row
        self._free.append(row)
        return row

    def held(self) -> dict[str, int]:
        """Each sequence's row, by sequence id (tests rebuild the tables from it)."""
        return {sid: h.row for sid, h in self._held.items()}
