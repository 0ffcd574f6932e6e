"""The leader -> ranks step plan, as int64 tensors over the group's broadcast (no pickle).

Every plan is a fixed 8-word header, then an op-specific int64 payload (inline in the same
message up to `INLINE_WORDS`, else in a second broadcast):
    DECODE    tokens [B], positions [B], slots [B] (each row's table row on the ranks), then
              the table edits (`TableEdits`: cleared [C], runs [4, E], blocks [N]). Every
              rank keeps its block tables as one persistent tensor, a row per running
              sequence (services/decode/rank/block_tables.py); a step sends only what
              changed since the last (services/decode/leader/table_rows.py), so a plan is
              O(batch + new blocks), whatever the context. B and W (the columns the step
              reads) are the step's bucket (common/step_shapes.py): the leader
              pads the batch with rows on the all -1 padding row (their write goes to the
              trash slot, their logits are dropped), so every rank runs the same static
              shapes. Header word 6 set: each rank counts its step's host waits (`tpla
              bench decode-step`). Header word 7 set: an MTP draft pass follows
              (`MtpPlan`): 5 words (M, S, E, D, chain), then rows [4, M], drafts [3, S]
              and seeds [E, D] as fp32 bits
    WRITE_KV  slots [N]; then the leader sends n [L, N, w] and k_pe [L, N, d_r] to `target`
    COPY      block pairs [R, P, 2] (source, destination; -1 padded; R = 1 when every rank
              shares the tables, R = tp in SP mode):
              every rank copies its pairs' slots, all layers (a forked sequence's own copy
              of the prompt's partly filled last block)
    EPOCH     epoch, then blocks [R, N] (-1 padded; R as for COPY): a reservation's blocks
              are its epoch's from now on (common/kv/epochs.py): late pushes of the
              reservations they served before are dropped
    PING      nothing: an idle leader's keep-alive (see `PingPlan`)
    SHUTDOWN  nothing
    PREFILL   lens [S], starts [S], stored_from [S], after [S], tokens [T], block_tables
              [R, S, W] (as DECODE's R): a piece of S prompts the group prefills itself
              (`PrefillPlan`)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from common.group.comm import Comm

HEADER_WORDS = 8
# A plan is one broadcast where its payload fits after the header: each collective costs a
# round of wake-ups on every rank, whatever its size (a 32 KB message costs what an 8 KB one
# does). 4096 words hold a step's rows at batch 256 with a joining sequence's whole table at
# 32K context (block size 16, TPLA r = 2), so at that scale a step is one broadcast even as
# sequences join. A larger payload follows in a second broadcast.
INLINE_WORDS = 4096
MESSAGE_WORDS = HEADER_WORDS + INLINE_WORDS
MTP_SIZES = 5  # an MTP pass's sizes: rows, drafting sequences, seeds, seed width, chain


class Op(enum.IntEnum):
    DECODE = 1
    WRITE_KV = 2
    SHUTDOWN = 3
    PING = 4
    COPY = 5
    EPOCH = 6
    PREFILL = 7


@dataclass(frozen=True)
class MtpPlan:
    """A step's MTP draft pass (services/decode/rank/draft_pass.py), before its rows run.

    Pass row m runs the MTP module at position t = rows[2, m] on token t + 1 = rows[1, m]
    and the main model's hidden state at t: row rows[0, m] of the previous step's (>= 0) or
    seed -1 - rows[0, m] (< 0: a prefill's last hidden state); its latents go where the step
    row rows[3, m] (the same sequence's) says. Drafting sequence s takes its first draft from
    pass row drafts[0, s] into step row drafts[1, s] and chains drafts[2, s] drafts in all,
    into the rows after it. The ranks run `chain` chained drafts after the first for every
    drafting sequence (those that take fewer write theirs nowhere): the pass's shape is
    then its rows' and the step's, whatever each sequence drafts. A padded pass (`padded`)
    has as many rows and drafting sequences as its step has rows; a padding row's step row
    and a padding draft's are the step's size (one past its rows: nowhere)."""

    rows: Tensor  # [4, M] int64
    drafts: Tensor  # [3, S] int64
    seeds: Tensor  # [E, D] float32
    chain: int = 0

    def words(self) -> Tensor:
        e, d = self.seeds.shape
        bits = self.seeds.contiguous().flatten()
        if bits.numel() % 2:
            bits = torch.cat((bits, bits.new_zeros(1)))
        sizes = torch.tensor([self.rows.shape[1], self.drafts.shape[1], e, d, self.chain])
        return torch.cat(
            (sizes, self.rows.flatten(), self.drafts.flatten(), bits.view(torch.int64))
        )

    @staticmethod
    def read(comm: Comm) -> MtpPlan:
        sizes = torch.zeros(MTP_SIZES, dtype=torch.int64)
        comm.broadcast_plan_(sizes)
        m, s, e, d, chain = (int(v) for v in sizes)
        payload = torch.empty(4 * m + 3 * s + -(-e * d // 2), dtype=torch.int64)
        comm.broadcast_plan_(payload)
        seeds = payload[4 * m + 3 * s :].view(torch.float32)[: e * d].view(e, d)
        rows, drafts = payload[: 4 * m].view(4, m), payload[4 * m : 4 * m + 3 * s].view(3, s)
        return MtpPlan(rows, drafts, seeds, chain)

    def padded(self, size: int) -> MtpPlan:
        """The pass with `size` rows and drafting sequences (a step of `size` rows)."""
        m, s = self.rows.shape[1], self.drafts.shape[1]
        rows = torch.tensor([[0], [0], [0], [size]]).expand(4, size - m)
        drafts = torch.tensor([[0], [size], [0]]).expand(3, size - s)
        return MtpPlan(
            torch.cat((self.rows, rows), 1),
            torch.cat((self.drafts, drafts), 1),
            self.seeds,
            self.chain,
        )

    @staticmethod
    def padding(size: int, chain: int, hidden: int) -> MtpPlan:
        """A pass of padding rows only, for a step of `size` padding rows (warm-up)."""
        empty = MtpPlan(
            torch.zeros(4, 0, dtype=torch.int64),
            torch.zeros(3, 0, dtype=torch.int64),
            torch.zeros(0, hidden),
            chain,
        )
        return empty.padded(size)


@dataclass(frozen=True)
class TableEdits:
    """What changed in the ranks' block tables since the last step, applied before it
    (services/decode/rank/block_tables.py): the `cleared` rows are all -1 again (their
    sequence left), then each run e writes its blocks into pool runs[0, e]'s table, row
    runs[1, e], from column runs[2, e] on, runs[3, e] of them, taken in order from `blocks`.
    A pool is a rank's own under SP (each rank applies its own runs), else the one every
    rank shares (pool 0)."""

    cleared: Tensor  # [C] int64
    runs: Tensor  # [4, E] int64: (pool, row, first column, blocks)
    blocks: Tensor  # [N] int64

    @staticmethod
    def none() -> TableEdits:
        empty = torch.zeros(0, dtype=torch.int64)
        return TableEdits(empty, empty.view(4, 0), empty)

    @staticmethod
    def whole(tables: Tensor) -> TableEdits:
        """Rows written whole: tables [R, B, W] (-1 padded) into rows 0..B-1 of pools
        0..R-1 (a rank's tests, from explicit tables)."""
        r, b, w = tables.shape
        runs = [(k, row, 0, w) for k in range(r) for row in range(b)]
        cleared = torch.zeros(0, dtype=torch.int64)
        return TableEdits(cleared, torch.tensor(runs).view(-1, 4).T.contiguous(), tables.flatten())

    @property
    def words(self) -> int:
        return self.cleared.numel() + self.runs.numel() + self.blocks.numel()


@dataclass(frozen=True)
class DecodePlan:
    tokens: Tensor  # [B] int64
    positions: Tensor  # [B] int64
    slots: Tensor  # [B] int64: each row's table row on the ranks (padding rows: the all -1 one)
    width: int  # table columns the step reads: blocks under its longest row, or its bucket's
    edits: TableEdits = field(default_factory=TableEdits.none)
    # Each rank counts its step's host waits and returns the count as one extra logits row
    # (services/decode/rank/runtime.py).
    count_syncs: bool = False
    # The MTP draft pass that fills the draft rows' tokens first; the ranks then return the
    # step's tokens after its logits (`token_rows`).
    mtp: MtpPlan | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(batch, table width, chained drafts or -1 without a draft pass): what a step's
        static shapes follow (one CUDA graph each)."""
        return len(self.tokens), self.width, -1 if self.mtp is None else self.mtp.chain


@dataclass(frozen=True)
class WritePlan:
    target: int
    slots: Tensor  # [N] int64


@dataclass(frozen=True)
class CopyPlan:
    pairs: Tensor  # [R, P, 2] int64: (source block, destination block), -1 padded

    def rank_pairs(self, rank: int) -> Tensor:
        """This rank's (source, destination) block pairs [P', 2], padding dropped."""
        pairs = self.pairs[rank if self.pairs.shape[0] > 1 else 0]
        return pairs[pairs[:, 0] >= 0]


@dataclass(frozen=True)
class EpochPlan:
    """A new reservation's blocks, per pool, and its epoch (sent before its targets leave)."""

    epoch: int
    blocks: Tensor  # [R, N] int64, -1 padded

    def rank_blocks(self, rank: int) -> Tensor:
        """This rank's blocks [N'], padding dropped (host words: no device to wait for)."""
        blocks = self.blocks[rank if self.blocks.shape[0] > 1 else 0]
        return blocks[: int((blocks >= 0).sum())]


@dataclass(frozen=True)
class PingPlan:
    """Sent by an idle leader every second or so. Followers wait for plans in a collective,
    which times out (`collective_timeout_s`): without it an idle group's followers would
    fail after that long. It also makes a hung rank visible while idle: the leader's ping
    then blocks like a stuck step, and the group reports itself stalled."""


@dataclass(frozen=True)
class PrefillPlan:
    """A piece of each of S prompts the group prefills itself (rank/prefill_pass.py): prompt
    s's tokens at positions starts[s] .. starts[s] + lens[s] - 1 (packed in `tokens`), after
    the tokens before them already in its blocks (`block_tables`, one table per prompt).
    Only positions from `stored_from[s]` on are stored: those before it are in the prompt's
    cached blocks already, which other prompts share (a piece recomputes them for their
    logits alone). `after[s]`: the prompt's token after its piece, -1 where the piece ends
    the prompt (the MTP layer's last row reads it). `logits`: the ranks return the logits of
    each prompt's last row, or with `every_row` of every row, for the leader's gather;
    neither (a prompt's earlier chunks): nothing."""

    lens: Tensor  # [S] int64
    starts: Tensor  # [S] int64
    stored_from: Tensor  # [S] int64
    after: Tensor  # [S] int64
    tokens: Tensor  # [T] int64
    block_tables: Tensor  # [R, S, W] int64
    logits: bool = False
    every_row: bool = False


Plan = (
    DecodePlan | WritePlan | CopyPlan | EpochPlan | PrefillPlan | PingPlan | None
)  # None = shutdown


def send_plan(plan: Plan, comm: Comm) -> None:
    """Leader side: broadcast a plan from rank 0."""
    message = torch.zeros(MESSAGE_WORDS, dtype=torch.int64)
    header = message[:HEADER_WORDS]
    if plan is None or isinstance(plan, PingPlan):
        header[0] = Op.SHUTDOWN if plan is None else Op.PING
        comm.broadcast_plan_(message)
        return
    if isinstance(plan, DecodePlan):
        edits = plan.edits
        header[:6] = torch.tensor(
            [
                Op.DECODE,
                len(plan.tokens),
                plan.width,
                len(edits.cleared),
                edits.runs.shape[1],
                len(edits.blocks),
            ]
        )
        header[6] = int(plan.count_syncs)
        header[7] = int(plan.mtp is not None)
        payload = torch.cat(
            [
                plan.tokens,
                plan.positions,
                plan.slots,
                edits.cleared,
                edits.runs.flatten(),
                edits.blocks,
            ]
        )
    elif isinstance(plan, CopyPlan):
        r, p, _ = plan.pairs.shape
        header[:3] = torch.tensor([Op.COPY, r, p])
        payload = plan.pairs.flatten()
    elif isinstance(plan, EpochPlan):
        r, n = plan.blocks.shape
        header[:4] = torch.tensor([Op.EPOCH, r, n, plan.epoch])
        payload = plan.blocks.flatten()
    elif isinstance(plan, PrefillPlan):
        r, s, w = plan.block_tables.shape
        header[:7] = torch.tensor(
            [Op.PREFILL, s, len(plan.tokens), w, r, plan.logits, plan.every_row]
        )
        parts = (
            plan.lens,
            plan.starts,
            plan.stored_from,
            plan.after,
            plan.tokens,
            plan.block_tables.flatten(),
        )
        payload = torch.cat(parts)
    else:
        header[:4] = torch.tensor([Op.WRITE_KV, 0, 0, len(plan.slots)])
        header[4] = plan.target
        payload = plan.slots
    if len(payload) <= INLINE_WORDS:
        message[HEADER_WORDS : HEADER_WORDS + len(payload)] = payload
        comm.broadcast_plan_(message)
    else:
        comm.broadcast_plan_(message)
        comm.broadcast_plan_(payload.to(torch.int64).contiguous())
    if isinstance(plan, DecodePlan) and plan.mtp is not None:
        words = plan.mtp.words()
        comm.broadcast_plan_(words[:MTP_SIZES].clone())
        comm.broadcast_plan_(words[MTP_SIZES:].clone())


def recv_plan(comm: Comm) -> Plan:
    """Rank side: receive the next plan from rank 0."""
    message = torch.zeros(MESSAGE_WORDS, dtype=torch.int64)
    comm.broadcast_plan_(message)
    header = message[:HEADER_WORDS]
    op = Op(int(header[0]))
    if op is Op.SHUTDOWN:
        return None
    if op is Op.PING:
        return PingPlan()
    if op is Op.DECODE:
        b, width, c, e, n = (int(v) for v in header[1:6])
        payload = _payload(message, 3 * b + c + 4 * e + n, comm)
        rows = payload[: 3 * b].view(3, b)
        cleared, runs = payload[3 * b : 3 * b + c], payload[3 * b + c : 3 * b + c + 4 * e]
        edits = TableEdits(cleared, runs.view(4, e), payload[3 * b + c + 4 * e :])
        mtp = MtpPlan.read(comm) if header[7] else None
        return DecodePlan(rows[0], rows[1], rows[2], width, edits, bool(header[6]), mtp)
    if op is Op.PREFILL:
        s, t, w, r = (int(v) for v in header[1:5])
        payload = _payload(message, 4 * s + t + r * s * w, comm)
        lens, starts, stored, after = payload[: 4 * s].view(4, s)
        tokens, tables = payload[4 * s : 4 * s + t], payload[4 * s + t :].view(r, s, w)
        every = bool(header[6])
        return PrefillPlan(lens, starts, stored, after, tokens, tables, bool(header[5]), every)
    if op is Op.COPY:
        r, p = int(header[1]), int(header[2])
        return CopyPlan(_payload(message, r * p * 2, comm).view(r, p, 2))
    if op is Op.EPOCH:
        r, n = int(header[1]), int(header[2])
        return EpochPlan(int(header[3]), _payload(message, r * n, comm).view(r, n))
    return WritePlan(int(header[4]), _payload(message, int(header[3]), comm))


def _payload(message: Tensor, words: int, comm: Comm) -> Tensor:
    """A plan's payload: inline in its message, or the broadcast after it."""
    if words <= INLINE_WORDS:
        return message[HEADER_WORDS : HEADER_WORDS + words]
    payload = torch.empty(words, dtype=torch.int64)
    comm.broadcast_plan_(payload)
    return payload


def plan_bytes(plan: DecodePlan) -> int:
    """What sending `plan` puts on the group (its MTP pass aside)."""
    words = 3 * len(plan.tokens) + plan.edits.words
    return 8 * (MESSAGE_WORDS + (words if words > INLINE_WORDS else 0))


# Token ids cross the logits gather as base-256 digits: every digit below 256 is exact in
# any float dtype the logits may have (bf16 included); three digits cover ids below 2^24.
ID_DIGITS = 3


def token_rows(tokens: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """Token ids [B] -> rows [X, width] of their digits, to append to a logits slice."""
    digits = torch.stack([(tokens >> (8 * i)) & 255 for i in range(ID_DIGITS)], dim=1)
    flat = digits.flatten().to(dtype)
    rows = -(-flat.numel() // width)
    return torch.nn.functional.pad(flat, (0, rows * width - flat.numel())).view(rows, width)


def token_row_count(count: int, width: int) -> int:
    return -(-count * ID_DIGITS // width)


def read_token_rows(rows: Tensor, count: int) -> list[int]:
    """`token_rows` back to `count` ids (host rows)."""
    digits = rows.flatten()[: count * ID_DIGITS].view(count, ID_DIGITS).to(torch.int64)
    return (digits * torch.tensor([1, 256, 65536])).sum(1).tolist()
