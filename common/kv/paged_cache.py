"""One rank's paged latent storage: `n[S_i]` (its latent slice) + `k_pe` per token per layer.

Preallocated once from a memory budget, so the decode step never allocates cache memory.
Slot `b * block_size + o` is offset `o` of block `b`; the leader's `BlockPool` decides which
blocks a request owns and sends slot indices in each step plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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
        if num_blocks < 1:
            raise ValueError("the KV budget is too small for a single block")
        self.layout = layout
        self.num_blocks = num_blocks
        slots = num_blocks * layout.block_size
        self.n = torch.zeros(
            layout.num_layers, slots, layout.latent_width, dtype=layout.dtype, device=device
        )
        self.k_pe = torch.zeros(
            layout.num_layers, slots, layout.rope_width, dtype=layout.dtype, device=device
        )

    @property
    def nbytes(self) -> int:
        return self.n.nbytes + self.k_pe.nbytes

    def write(self, layer: int, slots: Tensor, n: Tensor, k_pe: Tensor) -> None:
        """Store tokens' latents at flat slot indices [N]."""
        self.n[layer, slots] = n
        self.k_pe[layer, slots] = k_pe

    def write_all_layers(self, slots: Tensor, n: Tensor, k_pe: Tensor) -> None:
        """Store a transferred shard: n [L, N, w], k_pe [L, N, d_r] (layer-major)."""
        self.n[:, slots] = n
        self.k_pe[:, slots] = k_pe

    def gather(self, layer: int, slot_table: Tensor) -> tuple[Tensor, Tensor]:
        """Padded per-sequence views: slot_table [B, T] (pad with any valid slot) ->
        n [B, T, w], k_pe [B, T, d_r]."""
        return self.n[layer][slot_table], self.k_pe[layer][slot_table]


def slot_table(block_tables: Tensor, lengths: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Flat slot indices [B, T_max] for tokens 0..lengths[b]-1 and the matching valid mask.

    block_tables [B, max_blocks] (padded with -1), lengths [B]. Padding positions point at
    slot 0 so the gather stays in bounds; the mask hides them.
    """
    t_max = int(lengths.max())
    pos = torch.arange(t_max, device=lengths.device)
    valid = pos[None] < lengths[:, None]
    blocks = block_tables.gather(
        1, (pos // block_size)[None].expand(len(lengths), -1).clamp(max=block_tables.shape[1] - 1)
    )
    slots = blocks * block_size + pos % block_size
    return slots.masked_fill(~valid | (blocks < 0), 0), valid
