"""Keyed random draws: each sampled position's noise is a pure function of its key.

A key is (the request's seed, the choice, the position of the token being drawn). The
noise of key k at vocabulary column i is a counter-based hash of (k, i), computed on the
logits' device with int64 tensor ops only: no generator state, no host wait, and the same
bits on every device (32-bit values times multipliers under 2^31: no int64 product
overflows, where signed overflow could differ between devices). Two
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


def mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer hash of int64 values in [0, 2^32), in place: Wellons'
    hash-prospector xorshift-multiply [16 21f0aaad 15 735a2d97 15] (its bias 0.107 is below
    lowbias32's), whose multipliers are under 2^31, so every product fits in int64."""
    x.bitwise_xor_(x >> 16).mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(0x735A2D97).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 15)


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
    bits = mix32(columns[None] ^ rows[:, :1])
    return mix32(bits.add_(rows[:, 1:]).bitwise_and_(_MASK32))


def exponential_noise(words: Tensor, vocab: int) -> Tensor:
    """Exp(1) noise [B, V] (float32) per key and column (`exponential_from_bits`)."""
    return exponential_from_bits(uniform_bits(words, vocab))


# The largest float32 below 1.
_BELOW_ONE = 1.0 - 2.0**-24


def exponential_from_bits(bits: Tensor) -> Tensor:
    """Exp(1) noise (float32) from 32 random bits (int64 in [0, 2^32)), in place: -log(u),
    u = (k + 0.5) 2^-24 from the top 24 bits k, strictly inside (0, 1), so the noise is never
    0. At the top k, k + 0.5 rounds up to 2^24 in float32 (u = 1): it is held just below 1.
    A noise of 0 would turn a token of probability 0 (masked by a grammar, top-k, top-p) into
    0 / 0 = NaN, which the race's argmax picks."""
    u = bits.bitwise_right_shift_(8).to(torch.float32)
    return u.add_(0.5).mul_(2.0**-24).clamp_(max=_BELOW_ONE).log_().neg_()
