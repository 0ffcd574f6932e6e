"""Keyed random draws: each sampled position's noise is a pure function of its key.

A key is (the request's seed, the choice, the position of the token being drawn). The
noise of key k at vocabulary column i is a counter-based hash of (k, i), computed on the
logits' device with int64 tensor ops only: no generator state, no host wait, and the same
bits on every device (the 32-bit products are split so no int64 product overflows). Two
draws at the same key are the same draw, so a token is a function of its position's
distribution and its key alone: whatever else shares the batch, whichever group runs it
(a migrated choice), and whether the step verified drafts or fed one token.

The noise is Exp(1), for the sampler's exponential race (Gumbel-max without logarithms).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from common.runtime.transfers import to_device

_MASK32 = 0xFFFFFFFF
# Separate the key words and the column counter, so that no two inputs share a hash chain.
_SEED_SALT, _COLUMN_SALT = 0x9E3779B9, 0x85EBCA6B


@dataclass(frozen=True)
class DrawKey:
    """What one sampled position's noise is keyed by."""

    seed: int  # the request's seed, or one drawn when it was admitted (`draw_seed`)
    choice: int  # the choice's index in its request (n > 1)
    position: int  # the token's index in its sequence (prompt tokens first)


def draw_seed() -> int:
    """A seed for a request that named none: its draws are then as random as any."""
    return random.SystemRandom().getrandbits(63)


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32): in 16-bit halves of c, so no product leaves
    int64's range (signed overflow would not be the same on every device)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer hash (Wellons' lowbias32) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def key_words(keys: Sequence[DrawKey], device: torch.device) -> Tensor:
    """The keys as int64 words [B, 4] (seed low, seed high, choice, position) on `device`,
    moved in one non-blocking copy."""
    words = []
    for k in keys:
        seed = k.seed % 2**64
        words += [seed & _MASK32, seed >> 32, k.choice & _MASK32, k.position & _MASK32]
    return to_device(words, device, torch.int64).view(len(keys), 4)


def row_hashes(words: Tensor) -> Tensor:
    """Each key's two 32-bit row hashes [B, 2] from its words [B, 4]."""
    h = mix32(words[:, 0] ^ _SEED_SALT)
    for j in (1, 2, 3):
        h = mix32(h ^ words[:, j])
    return torch.stack((h, mix32(h ^ _COLUMN_SALT)), dim=1)


def uniform_bits(words: Tensor, vocab: int) -> Tensor:
    """32 random bits [B, V] (int64 in [0, 2^32)) per key and column."""
    rows = row_hashes(words)
    columns = torch.arange(vocab, dtype=torch.int64, device=words.device)
    # The second row hash is added after a mix, so two keys whose first hashes differ by
    # an xor of two columns still draw different values at those columns.
    return mix32((mix32(columns[None] ^ rows[:, :1]) + rows[:, 1:]) & _MASK32)


def exponential_noise(words: Tensor, vocab: int) -> Tensor:
    """Exp(1) noise [B, V] (float32) per key and column: -log(u) with u from the top 24 bits,
    exact in float32 and strictly inside (0, 1)."""
    u = ((uniform_bits(words, vocab) >> 8).to(torch.float32) + 0.5) * 2.0**-24
    return u.log_().neg_()
