"""A layout's part in a decode rank's step: which tokens the rank caches, where it writes and
reads them, and how its attention output becomes the group's. One `CacheSplit` per layout,
picked once by `cache_split`; the step never asks which layout it runs.

- `LatentColumns` (TPLA, MLA-TP): the rank caches every token, its latent columns S_i, and
  reads whole blocks; its partial output is summed by the layer's all-reduce.
- `TokenChunks` (SP): the rank caches whole-width rows of its own chunks only, at their
  local positions (`ParallelConfig.local_position`), and reads per-token slots; every rank
  attends with every head over its tokens, and the partials merge exactly across ranks
  (log-sum-exp, common/model/sp.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from common.group.comm import Comm
from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.kv.slots import token_slots
from common.model.sp import merge_partials
from common.parallel import ParallelConfig, ParallelMode
from services.decode.rank.backends import DecodeBackend
from services.decode.rank.layers import RankAttention


class CacheSplit(ABC):
    """How rank `rank` of a group laid out as `parallel` holds and attends its cache."""

    def __init__(self, parallel: ParallelConfig, rank: int) -> None:
        self.parallel, self.rank = parallel, rank

    @abstractmethod
    def address(
        self, positions: Tensor, tables: Tensor, block_size: int, trash_slot: int
    ) -> tuple[Tensor, CacheReads]:
        """Rows at `positions` [B] with block tables [B, W] -> where each row's new latent
        goes on this rank (`trash_slot` where it must not be stored: a padding row, whose
        table is all -1, or a token the rank does not cache) and what the rows read."""

    @abstractmethod
    def check(self, reads: CacheReads) -> None:
        """Raise ValueError where `reads` cannot feed this split's attention."""

    @abstractmethod
    def attend(
        self,
        attn: RankAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
        comm: Comm,
        backend: DecodeBackend,
    ) -> Tensor:
        """[B, h, *] queries of the rank's heads over cache layer `index` -> this rank's
        partial hidden state [B, D], which the layer's all-reduce sums."""


class LatentColumns(CacheSplit):
    """TPLA / MLA-TP: every token, this rank's latent columns."""

    def address(
        self, positions: Tensor, tables: Tensor, block_size: int, trash_slot: int
    ) -> tuple[Tensor, CacheReads]:
        slots = token_slots(tables, positions[:, None], block_size)[:, 0]
        reads = CacheReads.blocks(tables, positions + 1, block_size)
        return torch.where(slots >= 0, slots, trash_slot), reads

    def check(self, reads: CacheReads) -> None:
        """Block reads and per-token reads both serve it."""

    def attend(
        self,
        attn: RankAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
        comm: Comm,
        backend: DecodeBackend,
    ) -> Tensor:
        """The rank's heads over its latent slice; `RankAttention.attend_reference` is the
        same math unfused."""
        o = backend.attention(attn, q_nope, q_pe, cache, index, reads)
        return backend.linear(o.reshape(o.shape[0], -1), attn.w_o)


class TokenChunks(CacheSplit):
    """SP: this rank's round-robin chunks of every sequence, at full width."""

    def address(
        self, positions: Tensor, tables: Tensor, block_size: int, trash_slot: int
    ) -> tuple[Tensor, CacheReads]:
        par, rank = self.parallel, self.rank
        lengths = par.local_length(positions + 1, rank)
        local = par.local_position(positions)
        # Rows this rank does not own may index past its table (token_slots clamps).
        keep = par.token_owner(positions) == rank
        slots = token_slots(tables, local[:, None], block_size)[:, 0]
        reads = CacheReads.tokens(tables, lengths, block_size)
        return torch.where(keep & (slots >= 0), slots, trash_slot), reads

    def check(self, reads: CacheReads) -> None:
        if reads.slots is None or reads.valid is None:
            raise ValueError("an SP decode step reads per-token slots: use CacheReads.tokens")

    def attend(
        self,
        attn: RankAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
        comm: Comm,
        backend: DecodeBackend,
    ) -> Tensor:
        """Every head over this rank's chunks, merged exactly across ranks."""
        b = q_nope.shape[0]
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, attn.w_uk)
        # Every rank needs every head's query for its own tokens: gather the head groups.
        q_all = comm.gather_heads(torch.cat((q_lat, q_pe), dim=-1))
        q_lat_all, q_pe_all = q_all.split([attn.d_c, attn.d_r], dim=-1)
        u, m, l = backend.partial_attention(q_lat_all, q_pe_all, cache, index, reads, attn.scale)
        global_max = m.clone()
        comm.max_(global_max)
        u, l = merge_partials(u, m, l, global_max)  # fp32: summed and divided unrounded
        packed = torch.cat((u, l[..., None]), dim=-1)
        comm.sum_(packed)
        heads = slice(attn.head_offset, attn.head_offset + attn.num_heads)
        u_mine = packed[:, heads, : attn.d_c] / packed[:, heads, attn.d_c :]
        o = torch.einsum("bhc,hvc->bhv", u_mine.to(attn.w_uv.dtype), attn.w_uv)
        return backend.linear(o.reshape(b, -1), attn.w_o)


SPLITS: dict[ParallelMode, type[CacheSplit]] = {
    ParallelMode.TPLA: LatentColumns,
    ParallelMode.MLA_TP: LatentColumns,
    ParallelMode.SP: TokenChunks,
}


def cache_split(parallel: ParallelConfig, rank: int) -> CacheSplit:
    """The split rank `rank` of a group laid out as `parallel` runs."""
    return SPLITS[parallel.mode](parallel, rank)
