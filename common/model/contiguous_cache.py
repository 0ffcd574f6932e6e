"""A preallocated, unpaged latent cache: the simplest `LatentKV` (common/model/causal_lm.py),
for the single-process reference and the tests that hold the engines to it."""

from __future__ import annotations

import torch
from torch import Tensor

from common.model.args import ModelConfig
from common.model.causal_lm import PrefillOutput


class ContiguousLatentCache:
    """A preallocated [B, max_len] latent cache per layer: the simple, unpaged `LatentKV`."""

    def __init__(
        self,
        config: ModelConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        layers = config.num_hidden_layers
        self.n = torch.zeros(
            layers, batch, max_len, config.kv_lora_rank, dtype=dtype, device=device
        )
        self.k_pe = torch.zeros(
            layers, batch, max_len, config.qk_rope_head_dim, dtype=dtype, device=device
        )
        # DSA: every layer's indexer keys (a shared layer's stay unused).
        dsa = config.dsa
        shape = (layers, batch, max_len, dsa.index_head_dim) if dsa is not None else (0,)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.full = [dsa.is_full(n) for n in range(layers)] if dsa is not None else []
        self.max_len = max_len

    def load_prefill(self, row: int, out: PrefillOutput, start: int, end: int) -> None:
        """Copy one prompt's packed prefill latents [start:end) into cache row `row`."""
        for layer, (n, k_pe) in enumerate(zip(out.n, out.k_pe, strict=True)):
            self.n[layer, row, : end - start] = n[start:end]
            self.k_pe[layer, row, : end - start] = k_pe[start:end]
        full = [layer for layer, is_full in enumerate(self.full) if is_full]
        for layer, keys in zip(full, out.index_keys, strict=True):
            self.keys[layer, row, : end - start] = keys[start:end]

    def write(self, layer: int, positions: Tensor, n: Tensor, k_pe: Tensor) -> None:
        if int(positions.max()) >= self.max_len:
            raise IndexError(f"position {int(positions.max())} exceeds cache length {self.max_len}")
        rows = torch.arange(positions.shape[0], device=positions.device)
        self.n[layer, rows, positions] = n
        self.k_pe[layer, rows, positions] = k_pe

    def read(self, layer: int, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        length = int(positions.max()) + 1
        batch = positions.shape[0]
        valid = torch.arange(length, device=positions.device)[None] <= positions[:, None]
        return self.n[layer, :batch, :length], self.k_pe[layer, :batch, :length], valid

    def write_keys(self, layer: int, positions: Tensor, keys: Tensor) -> None:
        rows = torch.arange(positions.shape[0], device=positions.device)
        self.keys[layer, rows, positions] = keys

    def read_keys(self, layer: int, positions: Tensor) -> Tensor:
        length = int(positions.max()) + 1
        return self.keys[layer, : positions.shape[0], :length]
