"""A layout's part in a decode rank's step: which tokens the rank caches, where it writes and
reads them, and how its attention output becomes the group's. One `CacheSplit` per layout,
picked once by `cache_split`; the step never asks which layout it runs.

- `LatentColumns` (TPLA, MLA-TP): the rank caches every token, its latent columns S_i, and
  reads whole blocks; its partial output is summed by the layer's all-reduce.
- `TokenChunks` (SP): the rank caches whole-width rows of its own chunks only, at their
  local positions (`ParallelConfig.local_position`), and reads per-token slots; every rank
  attends with every head over its tokens, and the partials merge exactly across ranks
  (log-sum-exp, common/model/sp.py).

A prompt the group prefills itself (rank/prefill_pass.py) attends over its cached past with
the whole latent on every rank: `past` gathers it from the ranks' pieces (TPLA's latent
slices, SP's chunks), and the prompt's rows are written where `write_slots` says.
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
        goes on this rank (`write_slots`) and what the rows read."""

    @abstractmethod
    def write_slots(
        self, positions: Tensor, tables: Tensor, block_size: int, trash_slot: int
    ) -> Tensor:
        """Where the latents of rows at `positions` [B] with block tables [B, W] go on this
        rank: `trash_slot` where they must not be stored (a padding row, whose table is all
        -1, or a token the rank does not cache)."""

    @abstractmethod
    def past(
        self, cache: PagedLatentCache, table: Tensor, length: int, comm: Comm
    ) -> tuple[Tensor, Tensor]:
        """A sequence's first `length` tokens as every rank needs them to prefill after them:
        the whole latent n [L, length, d_c] and k_pe [L, length, d_r] of every cache layer,
        from this rank's block table [W] of the sequence. A collective where the rank holds
        only a piece of them: every rank calls it for the same sequence."""

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
        reads = CacheReads.blocks(tables, positions + 1, block_size)
        return self.write_slots(positions, tables, block_size, trash_slot), reads

    def write_slots(
        self, positions: Tensor, tables: Tensor, block_size: int, trash_slot: int
    ) -> Tensor:
        slots = token_slots(tables, positions[:, None], block_size)[:, 0]
        return torch.where(slots >= 0, slots, trash_slot)

    def past(
        self, cache: PagedLatentCache, table: Tensor, length: int, comm: Comm
    ) -> tuple[Tensor, Tensor]:
        """Every token's slice from each latent group: gathered when r > 1 (the ranks of
        head group 0 hold the r slices in order); k_pe is replicated."""
        positions = torch.arange(length, device=table.device)
        rows = cache.kv[:, token_slots(table, positions, cache.layout.block_size)]
        w = cache.layout.latent_width
        par = self.parallel
        if par.latent_groups == 1:
            return rows[..., :w], rows[..., w:]
        every = comm.all_gather(rows.contiguous())
        slices = [every[i * par.head_groups, ..., :w] for i in range(par.latent_groups)]
        return torch.cat(slices, dim=-1), rows[..., w:]

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
        lengths = self.parallel.local_length(positions + 1, self.rank)
        reads = CacheReads.tokens(tables, lengths, block_size)
        return self.write_slots(positions, tables, block_size, trash_slot), reads

    def write_slots(
        self, positions: Tensor, tables: Tensor, block_size: int, trash_slot: int
    ) -> Tensor:
        par = self.parallel
        local = par.local_position(positions)
        # Rows this rank does not own may index past its table (token_slots clamps).
        keep = par.token_owner(positions) == self.rank
        slots = token_slots(tables, local[:, None], block_size)[:, 0]
        return torch.where(keep & (slots >= 0), slots, trash_slot)

    def past(
        self, cache: PagedLatentCache, table: Tensor, length: int, comm: Comm
    ) -> tuple[Tensor, Tensor]:
        """Every rank's own chunks, gathered and put back in position order. Each sends as
        many rows as rank 0 holds (the most: it owns the first chunk); rows past its own
        are padding, never read."""
        par = self.parallel
        device = table.device
        most = par.local_length(length, 0)
        local = torch.arange(most, device=device)
        slots = token_slots(table, local, cache.layout.block_size).clamp(min=0)
        every = comm.all_gather(cache.kv[:, slots].contiguous())  # [tp, L, most, W]
        positions = torch.arange(length, device=device)
        rows = every[par.token_owner(positions), :, par.local_position(positions)]
        w = cache.layout.latent_width
        rows = rows.transpose(0, 1)  # [L, length, W]
        return rows[..., :w], rows[..., w:]

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
