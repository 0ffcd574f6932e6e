"""The prefill worker's latent prefix cache: recent prompts' latents by block, within a budget.

A prompt's full blocks are named by the hash chain of `common.kv.prefix_cache` (rooted in the
model and its side file); each cached block holds that block's latents for every layer,
[L, block_size, d_c + d_r], in the prefill's dtype and on its device. A new prompt that shares
a cached prefix prefills only its remaining tokens over those latents (`PastLatents`), and its
shards can still include any of the prefix the decode group lacks.

Lifecycle of a block: stored after the prefill that computed it -> reused (and moved to the
recent end) by every prompt that shares it -> evicted, least recently used first, when the
budget needs room. The batcher thread reads and writes it; the heartbeat reads which
blocks it holds (`recent`), under the lock that guards its index.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from common.kv.prefix_cache import block_hashes
from common.model.causal_lm import PastLatents


class LatentPrefixCache:
    def __init__(self, root: int, budget_bytes: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.root = root
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        # Oldest use first: each block's latents [L, block_size, d_c + d_r] and, for a DSA
        # model, its indexer keys [L_I, block_size, d_I] (else None).
        self._blocks: OrderedDict[int, tuple[Tensor, Tensor | None]] = OrderedDict()
        self.bytes = 0
        self.d_c = 0  # the latent width, learned from the first stored block
        self._lock = threading.Lock()  # the index, against `recent` on another thread

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self, prompt: Sequence[int]) -> list[int]:
        return block_hashes(self.root, prompt, self.block_size)

    def lookup(self, hashes: Sequence[int], prompt_len: int) -> PastLatents | None:
        """The latents of the longest cached prefix, leaving at least the prompt's last token
        to compute (its logits give the first token); None on a miss."""
        usable = min(len(hashes), (prompt_len - 1) // self.block_size)
        found: list[tuple[Tensor, Tensor | None]] = []
        with self._lock:
            for h in hashes[:usable]:
                block = self._blocks.get(h)
                if block is None:
                    break
                found.append(block)
            for h in reversed(hashes[: len(found)]):  # parents end up more recent
                self._blocks.move_to_end(h)
        if not found:
            return None
        kv = torch.cat([latents for latents, _ in found], dim=1)  # [L, P, d_c + d_r]
        layers = range(kv.shape[0])
        keys = [k for _, k in found if k is not None]
        index_keys = list(torch.cat(keys, dim=1)) if keys else []  # per full layer [P, d_I]
        return PastLatents(
            [kv[i, :, : self.d_c] for i in layers],
            [kv[i, :, self.d_c :] for i in layers],
            index_keys,
        )

    def store(
        self,
        hashes: Sequence[int],
        n: list[Tensor],
        k_pe: list[Tensor],
        first: int,
        rows: int,
        keys: Sequence[Tensor] = (),
    ) -> None:
        """Keep the full blocks whose latents `n` / `k_pe` (per layer; a DSA model's indexer
        keys `keys` per full layer) hold, row `rows` + j being prompt position `first` + j;
        blocks cached already are only touched."""
        if self.budget_bytes <= 0:
            return
        bs = self.block_size
        self.d_c = n[0].shape[1]
        for b, h in enumerate(hashes):
            if b * bs < first:
                continue  # part of the cached prefix this prompt reused
            if h in self._blocks:
                with self._lock:
                    self._blocks.move_to_end(h)
                continue
            lo = rows + b * bs - first
            block = torch.stack(
                [
                    torch.cat([nl[lo : lo + bs], kl[lo : lo + bs]], dim=-1)
                    for nl, kl in zip(n, k_pe, strict=True)
                ]
            )
            key_block = torch.stack([k[lo : lo + bs] for k in keys]) if keys else None
            size = _nbytes(block, key_block)
            if size > self.budget_bytes:
                return
            with self._lock:
                while self.bytes + size > self.budget_bytes:
                    _, old = self._blocks.popitem(last=False)
                    self.bytes -= _nbytes(*old)
                self._blocks[h] = (block, key_block)
                self.bytes += size
        with self._lock:
            for h in reversed(hashes):  # parents end up more recent than children
                if h in self._blocks:
                    self._blocks.move_to_end(h)

    def recent(self, limit: int) -> list[int]:
        """Up to `limit` cached block hashes, most recently used first (what the worker
        publishes for KV-aware routing)."""
        with self._lock:
            return list(itertools.islice(reversed(self._blocks), limit))


def _nbytes(block: Tensor, keys: Tensor | None) -> int:
    held = block.numel() * block.element_size()
    return held + (keys.numel() * keys.element_size() if keys is not None else 0)
