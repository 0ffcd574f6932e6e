"""A speculative step's rows and what each sequence keeps of them.

A sequence with drafts d_1..d_k is fed k + 1 tokens in one step: its last token at position
p and the drafts at p + 1..p + k, each row attending over the sequence's cache up to its own
position (the rows' latents are written before any row reads: causal among the new tokens).
Row j's logits are the distribution of the token at p + j + 1 had the first j drafts been
generated, and its draw is keyed by that position (common/sampling/keyed.py). Draft j is
accepted exactly when it equals what row j - 1 sampled; the sequence keeps the sampled
tokens up to and including the first mismatch (the sampler's own pick there), or all k + 1
when every draft matched. Every kept token is therefore the token plain decoding would have
drawn at its position. Pure bookkeeping, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from common.sampling.sampler import SampledToken

T = TypeVar("T")


@dataclass(frozen=True)
class StepRows:
    """Where each sequence's rows sit in a step: sequence s feeds 1 + len(drafts[s]) rows
    from starts[s] on."""

    drafts: list[list[int]]

    @property
    def sizes(self) -> list[int]:
        return [1 + len(d) for d in self.drafts]

    @property
    def starts(self) -> list[int]:
        out, at = [], 0
        for n in self.sizes:
            out.append(at)
            at += n
        return out

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def speculative(self) -> bool:
        return any(self.drafts)

    def per_row(self, values: Sequence[T]) -> list[T]:
        """Each sequence's value, once per its row."""
        return [v for v, n in zip(values, self.sizes, strict=True) for _ in range(n)]

    def split(self, rows: Sequence[T]) -> list[list[T]]:
        """Per-row values, one list per sequence."""
        return [list(rows[a : a + n]) for a, n in zip(self.starts, self.sizes, strict=True)]


def kept_tokens(drafts: Sequence[int], sampled: Sequence[SampledToken]) -> list[SampledToken]:
    """A sequence's tokens from one step: its rows' samples while each equals the draft fed
    after it, through the first that does not (or all of them)."""
    assert len(sampled) == len(drafts) + 1
    kept = []
    for j, token in enumerate(sampled):
        kept.append(token)
        if j == len(drafts) or token.token_id != drafts[j]:
            break
    return kept


def draft_room(max_tokens: int, generated: int) -> int:
    """Drafts a sequence may be fed: a step keeps at most 1 + drafts tokens, and never more
    than max_tokens in all. So the last draft's position is at most prompt + max_tokens - 2,
    inside the blocks reserved with the sequence: drafts need no blocks of their own."""
    return max(max_tokens - generated - 1, 0)
