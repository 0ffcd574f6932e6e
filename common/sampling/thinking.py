"""A reasoning request's thinking as sampling sees it: the sequence thinks from its first token
until it samples a think-end token (`SamplingParams.think_end_ids`); its grammar, if it has
one, constrains only the answer after that token, and a thinking budget, once spent, lets
nothing but a think-end token come next.

One rule for every place that samples or counts: the prefill worker's first token, the decode
leader's steps (services/decode/leader/controls.py owns each sequence's state there) and the
router's count of reasoning tokens. Lifecycle: `Thinking.start` (the state after the tokens a
request generated before, e.g. on the group it migrated from), then `take` each generated
token; `fill` writes a step's allowed tokens from it. The state is host-side: a step's mask
is built on the host as the grammar's is, with no wait on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from common.sampling.grammar import GrammarMatcher, allowed_tokens, new_bitmask
from common.sampling.params import SamplingParams


@dataclass
class Thinking:
    end_ids: frozenset[int]
    budget: int | None = None  # thinking tokens allowed (None: no limit)
    spent: int = 0  # thinking tokens so far (the think-end token is not one)
    ended: bool = False

    @classmethod
    def start(cls, params: SamplingParams, history: Sequence[int] = ()) -> Thinking | None:
        """The state after `history`, the tokens generated before; None for a request that
        does not think."""
        if not params.think_end_ids:
            return None
        thinking = cls(frozenset(params.think_end_ids), params.thinking_budget)
        for token in history:
            thinking.take(token)
        return thinking

    def take(self, token: int) -> bool:
        """Advance by one generated token; True when it belongs to the answer (a grammar
        reads it), False for a thinking token or the think-end token itself."""
        if self.ended:
            return True
        if token in self.end_ids:
            self.ended = True
        else:
            self.spent += 1
        return False

    @property
    def forced(self) -> bool:
        """The budget is spent: only a think-end token may come next."""
        return not self.ended and self.budget is not None and self.spent >= self.budget

    def copy(self) -> Thinking:
        return dataclasses.replace(self)


def answer(params: SamplingParams, history: Sequence[int]) -> Sequence[int]:
    """What of `history` a grammar reads: the tokens after thinking ended (the whole history
    of a request that does not think, none while it still thinks)."""
    if not params.think_end_ids:
        return history
    for i, token in enumerate(history):
        if token in params.think_end_ids:
            return history[i + 1 :]
    return ()


def fill(row: Tensor, thinking: Thinking | None, matcher: GrammarMatcher | None) -> None:
    """Write the tokens that may come next into `row` (an int32 bitmask row, CPU, every token
    allowed on entry): only a think-end token once the budget is spent, any token while
    thinking, the grammar's after it. GrammarError as `GrammarMatcher.fill`."""
    if thinking is not None and not thinking.ended:
        if thinking.forced:
            row.zero_()
            for token in thinking.end_ids:
                word, bit = divmod(token, 32)
                row[word] |= _bit(bit)
        return
    if matcher is not None:
        matcher.fill(row)


def constrains(thinking: Thinking | None, matcher: GrammarMatcher | None) -> bool:
    """Whether `fill` would leave some token out."""
    if thinking is not None and not thinking.ended:
        return thinking.forced
    return matcher is not None


def allowed_first(
    thinking: Thinking | None, matcher: GrammarMatcher | None, vocab: int, device: torch.device
) -> Tensor | None:
    """[1, vocab] bool: the tokens one sequence may sample next (a prefill's first token), or
    None when nothing constrains it."""
    if not constrains(thinking, matcher):
        return None
    mask = new_bitmask(1, (vocab + 31) // 32)
    fill(mask[0], thinking, matcher)
    return allowed_tokens(mask.to(device), vocab)


def _bit(bit: int) -> int:
    """Bit `bit` of an int32 word as a Python int that fits it (bit 31 is the sign)."""
    return (1 << bit) - (1 << 32) if bit == 31 else 1 << bit
