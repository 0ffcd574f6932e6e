"""One rank's paged latent storage: `n[S_i]` (its latent slice) + `k_pe` per token per layer.

Preallocated once from a memory budget, so the decode step never allocates cache memory.
Slot `b * block_size + o` is offset `o` of block `b`; the leader's `BlockPool` decides which
blocks a request owns and sends slot indices in each step plan. The last block is the trash
block, never handed out (`usable_blocks`): a step writes the rows it must not store there (a
padding row, an SP rank's tokens another rank owns), so every row is written and no write
needs a mask whose size the host would have to read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from common.kv.slots import token_slots
from common.native.copy_rows import copy_words, scatter_rows


@dataclass(frozen=True)
class CacheLayout:
    num_layers: int
    latent_width: int  # d_c / r on a TPLA rank, d_c on an MLA-TP rank
    rope_width: int  # d_r, replicated on every rank
    block_size: int
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_token_per_layer(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return (self.latent_width + self.rope_width) * itemsize

    def blocks_for_budget(self, budget_bytes: int) -> int:
        per_block = self.bytes_per_token_per_layer * self.num_layers * self.block_size
        return max(budget_bytes // per_block, 0)


class PagedLatentCache:
    def __init__(
        self, layout: CacheLayout, num_blocks: int, device: torch.device | str = "cpu"
    ) -> None:
        if num_blocks < 2:
            raise ValueError("the KV budget is too small for a block and the trash block")
        self.layout = layout
        self.num_blocks = num_blocks
        self.usable_blocks = num_blocks - 1  # what the leader's pool hands out
        self.trash_slot = self.usable_blocks * layout.block_size
        slots = num_blocks * layout.block_size
        w = layout.latent_width
        # One buffer with n and k_pe adjacent per token: a block of tokens is one contiguous
        # [block_size, w + d_r] tile, so the decode kernel copies whole blocks and computes
        # q~.n + q_pe.k_pe as a single matmul. `n` / `k_pe` are views of it.
        self.kv = torch.zeros(
            layout.num_layers, slots, w + layout.rope_width, dtype=layout.dtype, device=device
        )
        self.n = self.kv[..., :w]
        self.k_pe = self.kv[..., w:]
        # Reused destination of `gather_blocks`: a fresh multi-MB tensor per layer would be
        # page-faulted in on every step, which costs more than the copy itself.
        self._workspace = torch.empty(0, dtype=layout.dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def write(self, layer: int, slots: Tensor, n: Tensor, k_pe: Tensor) -> None:
        """Store tokens' latents at flat slot indices [N]."""
        self.n[layer, slots] = n
        self.k_pe[layer, slots] = k_pe

    def write_all_layers(self, slots: Tensor, n: Tensor, k_pe: Tensor) -> None:
        """Store a transferred shard: n [L, N, w], k_pe [L, N, d_r] (layer-major)."""
        for dest, src in ((self.n, n), (self.k_pe, k_pe)):
            copy_words(dest, slots, src.contiguous(), dim=1)

    def copy_blocks(self, src: Tensor, dst: Tensor) -> None:
        """Copy whole blocks, every layer: block src[i] -> block dst[i] (int64 [P])."""
        blocks = self.kv.view(self.layout.num_layers, self.num_blocks, -1)
        blocks[:, dst] = blocks[:, src]

    def write_row_groups(self, groups: Tensor, rows: Tensor, group: int) -> None:
        """Store packed cache rows (n and k_pe adjacent per token, as `kv` holds them).

        rows [G * group, w + d_r]; groups [G] indexes `kv` viewed as
        [num_layers * slots / group, group * (w + d_r)]: group g is slots [g * group, (g + 1)
        * group) of the layer-major flattening. With group = block_size a group is a whole
        block of one layer, so the write is one contiguous tile per block.
        """
        width = self.kv.shape[-1]
        rows = rows.to(self.kv.dtype).reshape(-1, group * width)
        scatter_rows(self.kv.view(-1, group * width), groups, rows)

    def rows_at(self, layer: int, start: int, stop: int) -> Tensor:
        """The cache rows of slots [start, stop) of one layer: a contiguous view to write into."""
        return self.kv[layer, start:stop]

    def gather(self, layer: int, slot_table: Tensor) -> tuple[Tensor, Tensor]:
        """Padded per-sequence views: slot_table [B, T] (pad with any valid slot) ->
        n [B, T, w], k_pe [B, T, d_r]. The per-token reference of `gather_blocks`."""
        return self.n[layer][slot_table], self.k_pe[layer][slot_table]

    def gather_blocks(self, layer: int, block_ids: Tensor) -> Tensor:
        """Whole blocks, n and k_pe adjacent: block_ids [B, nb] -> [B, nb * block_size, w + d_r].

        Token t of sequence b sits at row t; rows past the sequence's length hold whatever the
        padding block holds and must be masked by the caller. Copying [block_size, w + d_r]
        tiles is a plain memcpy per block, where a per-token gather indexes every row. The
        result is a view of a workspace that the next gather overwrites.
        """
        return self.rows(layer, block_ids).read(0, block_ids.shape[1] * self.layout.block_size)

    def rows(self, layer: int, block_ids: Tensor) -> BlockRows:
        """A chunked reader of a batch's cache rows (see `BlockRows`)."""
        return BlockRows(self, layer, block_ids)

    def chunk_tokens(self, batch: int) -> int:
        """Tokens per sequence per chunk so one chunk of the batch stays cache-resident.

        The decode kernel reads each chunk twice (scores, then values); a chunk of about
        CHUNK_BYTES (a few MB, well inside a server L3) is read from DRAM once.
        """
        per_token = batch * self.kv.shape[-1] * self.kv.element_size()
        blocks = max(CHUNK_BYTES // (per_token * self.layout.block_size), 1)
        return blocks * self.layout.block_size

    def _gather_into(self, layer: int, block_ids: Tensor) -> Tensor:
        bs, width = self.layout.block_size, self.kv.shape[-1]
        blocks = self.kv[layer].view(self.num_blocks, bs * width)
        b, nb = block_ids.shape
        size = b * nb * bs * width
        if self._workspace.numel() < size:
            self._workspace = torch.empty(size, dtype=self.kv.dtype, device=self.kv.device)
        out = self._workspace[:size].view(b * nb, bs * width)
        torch.index_select(blocks, 0, block_ids.reshape(-1), out=out)
        return out.view(b, nb * bs, width)


CHUNK_BYTES = 4 * 2**20


class BlockRows:
    """Rows [t0, t1) of every sequence of a batch, copied out of the pool chunk by chunk.

    `total` is the padded length (a whole number of blocks); chunk edges must be multiples of
    the block size. Each `read` overwrites the previous one's workspace.
    """

    def __init__(self, cache: PagedLatentCache, layer: int, block_ids: Tensor) -> None:
        self.cache, self.layer, self.block_ids = cache, layer, block_ids
        self.total = block_ids.shape[1] * cache.layout.block_size

    def read(self, t0: int, t1: int) -> Tensor:
        bs = self.cache.layout.block_size
        assert t0 % bs == 0 and (t1 % bs == 0 or t1 == self.total)
        return self.cache._gather_into(self.layer, self.block_ids[:, t0 // bs : -(-t1 // bs)])


def slot_table(
    block_tables: Tensor, lengths: Tensor, block_size: int, t_max: int | None = None
) -> tuple[Tensor, Tensor]:
    """Flat slot indices [B, T] for tokens 0..lengths[b]-1 and the matching valid mask.

    block_tables [B, max_blocks] (padded with -1), lengths [B]. T is the tables' whole width
    in tokens, or `t_max` (>= max(lengths)) when given: either is known on the host, where
    max(lengths) would be read from the device. Padding positions point at slot 0 so the
    gather stays in bounds; the mask hides them.
    """
    if t_max is None:
        t_max = block_tables.shape[-1] * block_size
    pos = torch.arange(t_max, device=lengths.device)
    valid = pos[None] < lengths[:, None]
    slots = token_slots(block_tables, pos[None].expand(len(lengths), -1), block_size)
    return slots.masked_fill(~valid | (slots < 0), 0), valid  # slot < 0: a padding block


def block_ids_from_slots(slots: Tensor, block_size: int) -> Tensor:
    """Block table [B, ceil(T / block_size)] back from a `slot_table` [B, T].

    `slot_table` puts token t at offset t % block_size of block t // block_size, so the first
    token of each block names the block; blocks past a sequence's end come out as block 0
    (their tokens are masked).
    """
    return torch.div(slots[:, ::block_size], block_size, rounding_mode="floor")


@dataclass(frozen=True)
class CacheReads:
    """Where one decode step reads each sequence's cached history.

    `block_ids` [B, nb] (past a sequence's end: some valid block, hidden by `lengths`) and
    `lengths` [B] serve the layouts that read whole blocks (TPLA, MLA-TP); `slots` / `valid`
    [B, nb * block_size], the per-token addresses, only the modes that gather tokens (SP). nb
    is the width of the step's block tables, which the leader pads to a bucket (never read
    from the lengths: that would wait for the device).
    """

    block_ids: Tensor
    lengths: Tensor
    slots: Tensor | None = None
    valid: Tensor | None = None

    @classmethod
    def blocks(
        cls, block_tables: Tensor, lengths: Tensor, block_size: int, longest: int | None = None
    ) -> CacheReads:
        """Straight from the tables [B, nb] (padded with -1): the same blocks under every
        token a sequence holds and the same `lengths` as `tokens`, without the [B, T] tables
        that the block readers never look at (with a step's write slots, 0.16-0.33 ms -> 0.03-
        0.04 ms a step at 1,536 tokens, batch 1-16). The tables' whole width is read, or only
        the blocks under `longest` tokens (>= max(lengths), known on the host) when given."""
        blocks = block_tables.shape[-1] if longest is None else -(-longest // block_size)
        return cls(block_tables[:, :blocks].clamp(min=0), lengths)

    @classmethod
    def tokens(cls, block_tables: Tensor, lengths: Tensor, block_size: int) -> CacheReads:
        """Per-token slots too, over the tables' whole width; a length of 0 (an SP rank that
        holds none of a sequence) is a row with no valid token."""
        slots, valid = slot_table(block_tables, lengths.clamp(min=1), block_size)
        valid &= lengths[:, None] > 0
        return cls(block_ids_from_slots(slots, block_size), valid.sum(dim=1), slots, valid)
