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
from dataclasses import dataclass

import torch
from torch import Tensor

from common.group.comm import Comm
from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.kv.slots import token_slots
from common.model.sp import merge_partials, partial_attention
from common.model.topk import candidates, threshold, topk_mask, within
from common.model.tpla import fused_slice_attention
from common.parallel import ParallelConfig, ParallelMode
from services.decode.rank.backends import DecodeBackend
from services.decode.rank.layers import RankAttention


@dataclass(frozen=True)
class Selection:
    """DSA: the tokens a step's rows attend over on this rank: their cache slots [B, k]
    (in position order) of which the first count [B] are real."""

    slots: Tensor
    count: Tensor


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

    # -- DeepSeek Sparse Attention (rank/sparse_rank.py) ---------------------------------------

    def covers(self, reads: CacheReads, block_size: int, tokens: int) -> bool:
        """Whether no row reading `reads` can hold more than `tokens` tokens of its sequence
        (the tables' width says so: shapes only)."""
        return self.parallel.most_tokens(reads.block_ids.shape[1] * block_size) <= tokens

    @abstractmethod
    def index_rows(
        self, pool: PagedLatentCache, layer: int, reads: CacheReads
    ) -> tuple[Tensor, Tensor]:
        """The index keys the rank holds of the rows' histories, [B, T, width] of layer
        `layer` of the key pool, and which are real [B, T]."""

    @abstractmethod
    def select(self, scores: Tensor, valid: Tensor, k: int, comm: Comm) -> Tensor:
        """Index scores [B, T] of the rank's tokens -> those the rows attend over [B, T]:
        the group's top k of each row (common/model/topk.py's rule) that the rank holds."""

    @abstractmethod
    def attend_selected(
        self,
        attn: RankAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        selection: Selection,
        comm: Comm,
        backend: DecodeBackend,
    ) -> Tensor:
        """`attend` over the selected tokens only -> this rank's partial hidden state."""


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

    def index_rows(
        self, pool: PagedLatentCache, layer: int, reads: CacheReads
    ) -> tuple[Tensor, Tensor]:
        rows = pool.rows(layer, reads.block_ids)
        keys = rows.read(0, rows.total)
        t = torch.arange(rows.total, device=keys.device)
        return keys, t[None] < reads.lengths[:, None]

    def select(self, scores: Tensor, valid: Tensor, k: int, comm: Comm) -> Tensor:
        """Every rank scores every token alike: each takes its own top k."""
        return topk_mask(scores, valid, k)

    def attend_selected(
        self,
        attn: RankAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        selection: Selection,
        comm: Comm,
        backend: DecodeBackend,
    ) -> Tensor:
        """The rank's heads over its latent slice of the gathered selected rows."""
        rows = cache.kv[index][selection.slots]  # [B, k, w + d_r]
        k = rows.shape[1]
        o = fused_slice_attention(
            q_nope,
            q_pe,
            lambda t0, t1: rows[:, t0:t1],
            k,
            k,
            selection.count,
            attn.w_uk,
            attn.w_uv,
            attn.scale,
            attn.shard.beta,
        )
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
        q_lat_all, q_pe_all = self._all_heads(attn, q_nope, q_pe, comm)
        u, m, l = backend.partial_attention(q_lat_all, q_pe_all, cache, index, reads, attn.scale)
        return self._merged(attn, u, m, l, comm, backend)

    def _all_heads(
        self, attn: RankAttention, q_nope: Tensor, q_pe: Tensor, comm: Comm
    ) -> tuple[Tensor, Tensor]:
        """Every head's absorbed query, q_lat [B, H, d_c] and q_pe [B, H, d_r]: every rank
        needs them for its own tokens, so the head groups are gathered."""
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, attn.w_uk)
        q_all = comm.gather_heads(torch.cat((q_lat, q_pe), dim=-1))
        q_lat_all, q_pe_all = q_all.split([attn.d_c, attn.d_r], dim=-1)
        return q_lat_all, q_pe_all

    def _merged(
        self,
        attn: RankAttention,
        u: Tensor,
        m: Tensor,
        l: Tensor,
        comm: Comm,
        backend: DecodeBackend,
    ) -> Tensor:
        """The ranks' partials merged exactly; this rank's heads' output through o_proj."""
        b = u.shape[0]
        global_max = m.clone()
        comm.max_(global_max)
        u, l = merge_partials(u, m, l, global_max)  # fp32: summed and divided unrounded
        packed = torch.cat((u, l[..., None]), dim=-1)
        comm.sum_(packed)
        heads = slice(attn.head_offset, attn.head_offset + attn.num_heads)
        u_mine = packed[:, heads, : attn.d_c] / packed[:, heads, attn.d_c :]
        o = torch.einsum("bhc,hvc->bhv", u_mine.to(attn.w_uv.dtype), attn.w_uv)
        return backend.linear(o.reshape(b, -1), attn.w_o)

    def index_rows(
        self, pool: PagedLatentCache, layer: int, reads: CacheReads
    ) -> tuple[Tensor, Tensor]:
        assert reads.slots is not None and reads.valid is not None
        keys, _ = pool.gather(layer, reads.slots)
        return keys, reads.valid

    def select(self, scores: Tensor, valid: Tensor, k: int, comm: Comm) -> Tensor:
        """Each rank offers its own k best (score, global position); every rank takes the
        k-th of all offers, the same on every rank, and keeps its tokens at or before it."""
        local = torch.arange(scores.shape[1], device=scores.device)
        positions = self.parallel.global_position(local, self.rank).expand_as(scores)
        best, at = candidates(scores, valid, positions, k)
        # One all-gather: the scores' bits ride in int64 beside the positions.
        packed = torch.cat((best.view(torch.int32).long(), at), dim=-1)
        offers = comm.all_gather(packed)  # [tp, B, 2k]
        every = offers.transpose(0, 1).reshape(scores.shape[0], -1, 2 * k)
        all_scores = every[..., :k].int().view(torch.float32).flatten(1)
        kth = threshold(all_scores, every[..., k:].flatten(1), k)
        return within(scores, positions, valid, kth)

    def attend_selected(
        self,
        attn: RankAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        selection: Selection,
        comm: Comm,
        backend: DecodeBackend,
    ) -> Tensor:
        """Every head over this rank's selected tokens, merged exactly across ranks."""
        q_lat_all, q_pe_all = self._all_heads(attn, q_nope, q_pe, comm)
        n, k_pe = cache.gather(index, selection.slots)
        k = selection.slots.shape[1]
        valid = torch.arange(k, device=n.device)[None] < selection.count[:, None]
        u, m, l = partial_attention(q_lat_all, q_pe_all, n, k_pe, valid, attn.scale)
        return self._merged(attn, u, m, l, comm, backend)


SPLITS: dict[ParallelMode, type[CacheSplit]] = {
    ParallelMode.TPLA: LatentColumns,
    ParallelMode.MLA_TP: LatentColumns,
    ParallelMode.SP: TokenChunks,
}


def cache_split(parallel: ParallelConfig, rank: int) -> CacheSplit:
    """The split rank `rank` of a group laid out as `parallel` runs."""
    return SPLITS[parallel.mode](parallel, rank)
