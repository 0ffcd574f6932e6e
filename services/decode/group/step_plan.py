"""The leader -> ranks step plan, as int64 tensors over the group's broadcast (no pickle).

Every plan is a fixed 8-word header, then an op-specific int64 payload:
    DECODE    tokens [B], positions [B], block_tables [R, B, W] (-1 padded; R = 1 when
              every rank shares the tables, R = tp in SP mode). B and W are the step's
              bucket (services/decode/group/buckets.py): the leader pads the batch with
              rows whose table is all -1 (their write goes to the trash slot, their logits
              are dropped), so every rank runs the same static shapes. Header word 6 set:
              each rank counts its step's host waits (`tpla bench decode-step`)
    WRITE_KV  slots [N]; then the leader sends n [L, N, w] and k_pe [L, N, d_r] to `target`
    COPY      block pairs [R, P, 2] (source, destination; -1 padded; R = 1 or tp as above):
              every rank copies its pairs' slots, all layers (a forked sequence's own copy
              of the prompt's partly filled last block)
    PING      nothing: an idle leader's keep-alive (see `PingPlan`)
    SHUTDOWN  nothing
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


@dataclass(frozen=True)
class DecodePlan:
    tokens: Tensor  # [B] int64
    positions: Tensor  # [B] int64
    block_tables: Tensor  # [R, B, W] int64
    # Each rank counts its step's host waits and returns the count as one extra logits row
    # (services/decode/rank/runtime.py).
    count_syncs: bool = False

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


Plan = DecodePlan | WritePlan | CopyPlan | PingPlan | None  # None = shutdown


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
        payload = torch.cat([plan.tokens, plan.positions, plan.block_tables.flatten()])
    elif isinstance(plan, CopyPlan):
        r, p, _ = plan.pairs.shape
        header[:3] = torch.tensor([Op.COPY, r, p])
        payload = plan.pairs.flatten()
    else:
        header[:4] = torch.tensor([Op.WRITE_KV, 0, 0, len(plan.slots)])
        header[4] = plan.target
        payload = plan.slots
    comm.broadcast_plan_(header)
    comm.broadcast_plan_(payload.to(torch.int64).contiguous())


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
        return DecodePlan(payload[:b], payload[b : 2 * b], tables, count)
    if op is Op.COPY:
        r, p = int(header[1]), int(header[2])
        payload = torch.empty(r * p * 2, dtype=torch.int64)
        comm.broadcast_plan_(payload)
        return CopyPlan(payload.view(r, p, 2))
    n = int(header[3])
    payload = torch.empty(n, dtype=torch.int64)
    comm.broadcast_plan_(payload)
    return WritePlan(int(header[4]), payload)
