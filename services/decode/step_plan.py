"""The leader -> ranks step plan, as int64 tensors over the group's broadcast (no pickle).

Every plan is a fixed 8-word header, then an op-specific int64 payload:
    DECODE    tokens [B], positions [B], block_tables [R, B, W] (-1 padded; R = 1 when
              every rank shares the tables, R = tp in SP mode). B and W are the step's
              bucket (services/decode/group/buckets.py): the leader pads the batch with
              rows whose table is all -1 (their write goes to the trash slot, their logits
              are dropped), so every rank runs the same static shapes. Header word 6 set:
              each rank counts its step's host waits (`tpla bench decode-step`). Header
              word 7 set: an MTP draft pass follows (`MtpPlan`): 4 words (M, S, E, D),
              then rows [4, M], drafts [3, S] and seeds [E, D] as fp32 bits
    WRITE_KV  slots [N]; then the leader sends n [L, N, w] and k_pe [L, N, d_r] to `target`
    COPY      block pairs [R, P, 2] (source, destination; -1 padded; R = 1 or tp as above):
              every rank copies its pairs' slots, all layers (a forked sequence's own copy
              of the prompt's partly filled last block)
    PING      nothing: an idle leader's keep-alive (see `PingPlan`)
    SHUTDOWN  nothing
    PREFILL   lens [S], starts [S], stored_from [S], after [S], tokens [T], block_tables
              [R, S, W] (as DECODE's R): a piece of S prompts the group prefills itself
              (`PrefillPlan`)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from common.group.comm import Comm

HEADER_WORDS = 8


class Op(enum.IntEnum):
    DECODE = 1
    WRITE_KV = 2
    SHUTDOWN = 3
    PING = 4
    COPY = 5
    PREFILL = 6


@dataclass(frozen=True)
class MtpPlan:
    """A step's MTP draft pass (services/decode/rank/draft_pass.py), before its rows run.

    Pass row m runs the MTP module at position t = rows[2, m] on token t + 1 = rows[1, m]
    and the main model's hidden state at t: row rows[0, m] of the previous step's (>= 0) or
    seed -1 - rows[0, m] (< 0: a prefill's last hidden state); its latents go where the step
    row rows[3, m] (the same sequence's) says. Drafting sequence s takes its first draft from
    pass row drafts[0, s] into step row drafts[1, s] and chains drafts[2, s] drafts in all,
    into the rows after it."""

    rows: Tensor  # [4, M] int64
    drafts: Tensor  # [3, S] int64
    seeds: Tensor  # [E, D] float32

    def words(self) -> Tensor:
        e, d = self.seeds.shape
        bits = self.seeds.contiguous().flatten()
        if bits.numel() % 2:
            bits = torch.cat((bits, bits.new_zeros(1)))
        sizes = torch.tensor([self.rows.shape[1], self.drafts.shape[1], e, d])
        return torch.cat(
            (sizes, self.rows.flatten(), self.drafts.flatten(), bits.view(torch.int64))
        )

    @staticmethod
    def read(comm: Comm) -> MtpPlan:
        sizes = torch.zeros(4, dtype=torch.int64)
        comm.broadcast_plan_(sizes)
        m, s, e, d = (int(v) for v in sizes)
        payload = torch.empty(4 * m + 3 * s + -(-e * d // 2), dtype=torch.int64)
        comm.broadcast_plan_(payload)
        seeds = payload[4 * m + 3 * s :].view(torch.float32)[: e * d].view(e, d)
        return MtpPlan(
            payload[: 4 * m].view(4, m), payload[4 * m : 4 * m + 3 * s].view(3, s), seeds
        )


@dataclass(frozen=True)
class DecodePlan:
    tokens: Tensor  # [B] int64
    positions: Tensor  # [B] int64
    block_tables: Tensor  # [R, B, W] int64
    # Each rank counts its step's host waits and returns the count as one extra logits row
    # (services/decode/rank/runtime.py).
    count_syncs: bool = False
    # The MTP draft pass that fills the draft rows' tokens first; the ranks then return the
    # step's tokens after its logits (`token_rows`).
    mtp: MtpPlan | None = None

    @property
    def bucket(self) -> tuple[int, int]:
        """(batch, table width): the step's static shape."""
        _, b, w = self.block_tables.shape
        return b, w


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


Plan = DecodePlan | WritePlan | CopyPlan | PrefillPlan | PingPlan | None  # None = shutdown


def send_plan(plan: Plan, comm: Comm) -> None:
    """Leader side: broadcast a plan from rank 0."""
    header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    if plan is None or isinstance(plan, PingPlan):
        header[0] = Op.SHUTDOWN if plan is None else Op.PING
        comm.broadcast_plan_(header)
        return
    if isinstance(plan, DecodePlan):
        r, b, m = plan.block_tables.shape
        header[:4] = torch.tensor([Op.DECODE, b, m, 0])
        header[5] = r
        header[6] = int(plan.count_syncs)
        header[7] = int(plan.mtp is not None)
        payload = torch.cat([plan.tokens, plan.positions, plan.block_tables.flatten()])
    elif isinstance(plan, CopyPlan):
        r, p, _ = plan.pairs.shape
        header[:3] = torch.tensor([Op.COPY, r, p])
        payload = plan.pairs.flatten()
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
    comm.broadcast_plan_(header)
    comm.broadcast_plan_(payload.to(torch.int64).contiguous())
    if isinstance(plan, DecodePlan) and plan.mtp is not None:
        words = plan.mtp.words()
        comm.broadcast_plan_(words[:4].clone())
        comm.broadcast_plan_(words[4:].clone())


def recv_plan(comm: Comm) -> Plan:
    """Rank side: receive the next plan from rank 0."""
    header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    comm.broadcast_plan_(header)
    op = Op(int(header[0]))
    if op is Op.SHUTDOWN:
        return None
    if op is Op.PING:
        return PingPlan()
    if op is Op.DECODE:
        b, m, r, count = int(header[1]), int(header[2]), int(header[5]), bool(header[6])
        payload = torch.empty(b * (2 + r * m), dtype=torch.int64)
        comm.broadcast_plan_(payload)
        tables = payload[2 * b :].view(r, b, m)
        mtp = MtpPlan.read(comm) if header[7] else None
        return DecodePlan(payload[:b], payload[b : 2 * b], tables, count, mtp)
    if op is Op.PREFILL:
        s, t, w, r = (int(v) for v in header[1:5])
        payload = torch.empty(4 * s + t + r * s * w, dtype=torch.int64)
        comm.broadcast_plan_(payload)
        lens, starts, stored, after = payload[: 4 * s].view(4, s)
        tokens, tables = payload[4 * s : 4 * s + t], payload[4 * s + t :].view(r, s, w)
        every = bool(header[6])
        return PrefillPlan(lens, starts, stored, after, tokens, tables, bool(header[5]), every)
    if op is Op.COPY:
        r, p = int(header[1]), int(header[2])
        payload = torch.empty(r * p * 2, dtype=torch.int64)
        comm.broadcast_plan_(payload)
        return CopyPlan(payload.view(r, p, 2))
    n = int(header[3])
    payload = torch.empty(n, dtype=torch.int64)
    comm.broadcast_plan_(payload)
    return WritePlan(int(header[4]), payload)


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
