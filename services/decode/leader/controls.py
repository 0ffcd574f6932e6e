"""The decode leader's per-sequence sampling state beyond params: each sequence's row of
generated-token counts (penalties), its grammar matcher (structured outputs) and, for a
reasoning request, its thinking (common/sampling/thinking.py: the grammar waits for the
think-end token, and a spent thinking budget forces it).

Lifecycle: `matcher()` compiles and replays a request's grammar off the loop thread; `start`
gives the sequence its history row and its thinking; `fork` copies a sequence's row,
grammar and thinking for a choice forked from it (n > 1); every step, `context` gathers the
batch's counts and fills the grammars' and thinking budgets' bitmask (one host buffer, one
copy to the device) for `common.sampling.logits.process_logits`, and `advance` counts the
sampled tokens with one scatter and moves each sequence's thinking and grammar on; `release`
frees the row when the sequence ends. A speculative step's context has a row per fed token:
row j of a sequence is its state as if its first j drafts had been generated (counts,
min_tokens, its thinking and grammar advanced through them and rolled back after), so each
row is processed as plain decoding would process that position.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from common.runtime.transfers import to_device
from common.sampling.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    allowed_tokens,
    new_bitmask,
)
from common.sampling.grammar_limits import DEFAULT_LIMITS, GrammarLimits
from common.sampling.logits import LogitsContext, TokenHistory
from common.sampling.params import SamplingParams
from common.sampling.thinking import Thinking, answer, fill


@dataclass
class SequenceControls:
    matcher: GrammarMatcher | None = None  # a structured output's grammar state
    history_row: int = 0  # the sequence's TokenHistory row (0: no penalties)
    # Why its grammar cannot go on (its parser stopped at a limit, or rejected a token): the
    # request's own failure, which ends the choice without the token sampled for it.
    failed: str = ""
    # Whether it still thinks and which tokens end its thinking (None: sampling need not
    # follow it: no reasoning, or neither a grammar nor a budget that depends on it).
    thinking: Thinking | None = None

    @property
    def failure(self) -> str:
        return f"structured output: {self.failed}"


class StepControls:
    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        eos_token_ids: Collection[int],
        max_batch: int,
        device: torch.device,
        limits: GrammarLimits = DEFAULT_LIMITS,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.history = TokenHistory(vocab_size, device)
        self.grammars = GrammarCompiler.from_model_dir(
            model_dir, vocab_size, sorted(eos_token_ids), limits
        )
        # Every token's bit: a thinking budget masks rows without a grammar too.
        words = (vocab_size + 31) // 32
        self._bitmask = new_bitmask(max_batch, words, pin=device.type == "cuda")

    def matcher(self, params: SamplingParams, history: Sequence[int]) -> GrammarMatcher | None:
        """The request's grammar advanced past the answer in `history` (what follows its
        thinking); None without one. GrammarError if it does not compile or rejects it."""
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise GrammarError("structured outputs need the model's tokenizer.json")
        return self.grammars.matcher(params.grammar, answer(params, history))

    def start(
        self,
        params: SamplingParams,
        matcher: GrammarMatcher | None,
        prompt_ids: Sequence[int],
        history: Sequence[int],
    ) -> SequenceControls:
        row = self.history.track(prompt_ids, history) if params.penalized else 0
        thinking = Thinking.start(params, history) if params.tracks_thinking else None
        return SequenceControls(matcher, row, thinking=thinking)

    def fork(self, seq: SequenceControls) -> SequenceControls:
        """Independent controls at `seq`'s position: its counts and grammar state, copied."""
        matcher = seq.matcher.fork() if seq.matcher is not None else None
        thinking = seq.thinking.copy() if seq.thinking is not None else None
        return SequenceControls(matcher, self.history.fork(seq.history_row), seq.failed, thinking)

    def release(self, seq: SequenceControls) -> None:
        self.history.release(seq.history_row)
        seq.history_row = 0

    def context(
        self,
        seqs: Sequence[SequenceControls],
        generated: Sequence[int],
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> LogitsContext:
        """The batch's counts and allowed tokens, gathered once for the whole batch: one row
        per sequence, or with `drafts` 1 + len(drafts[s]) rows of sequence s, row j as if
        drafts[s][:j] had been generated."""
        drafts = drafts if drafts is not None else [()] * len(seqs)
        sizes = [1 + len(d) for d in drafts]
        starts = [sum(sizes[:s]) for s in range(len(seqs))]
        counts = prompt_mask = allowed = None
        if any(s.history_row for s in seqs):
            rows = [s.history_row for s, n in zip(seqs, sizes, strict=True) for _ in range(n)]
            counts, prompt_mask = self.history.gather(to_device(rows, self.device))
            extra = [
                (start + j, t)
                for s, start, d in zip(seqs, starts, drafts, strict=True)
                if s.history_row
                for j in range(1, len(d) + 1)
                for t in d[:j]
            ]
            if extra:
                counts.index_put_(
                    (
                        to_device([r for r, _ in extra], self.device),
                        to_device([t for _, t in extra], self.device),
                    ),
                    torch.ones(len(extra), dtype=counts.dtype, device=self.device),
                    accumulate=True,
                )
        if any(_masks(s) for s in seqs):
            mask = self._bitmask[: sum(sizes)]
            mask.fill_(-1)
            for s, start, d in zip(seqs, starts, drafts, strict=True):
                if _masks(s) and not s.failed:
                    try:
                        _fill_rows(s, d, mask[start : start + 1 + len(d)])
                    except GrammarError as exc:  # its rows' samples are never sent
                        s.failed = str(exc)
            allowed = allowed_tokens(mask.to(self.device, non_blocking=True), self.vocab_size)
        num_generated = [g + j for g, n in zip(generated, sizes, strict=True) for j in range(n)]
        return LogitsContext(num_generated, self.eos_token_ids, counts, prompt_mask, allowed)

    def advance(self, seqs: Sequence[SequenceControls], tokens: Sequence[int]) -> None:
        """Count the tracked sequences' sampled tokens (one scatter) and move each one's
        thinking and grammar (a grammar reads only the answer's tokens)."""
        tracked = [(s.history_row, t) for s, t in zip(seqs, tokens, strict=True) if s.history_row]
        if tracked:
            self.history.record(
                to_device([r for r, _ in tracked], self.device),
                to_device([t for _, t in tracked], self.device),
            )
        for s, t in zip(seqs, tokens, strict=True):
            answer_token = s.thinking.take(t) if s.thinking is not None else True
            if not answer_token or s.matcher is None or s.failed:
                continue
            if not s.matcher.accept(t):
                s.failed = s.matcher.error or f"token {t} is not allowed by the grammar"


def _masks(seq: SequenceControls) -> bool:
    """Whether the sequence's rows may leave tokens out: it has a grammar, or it still
    thinks under a budget (a budget-only sequence's rows are free once its thinking ended)."""
    return seq.matcher is not None or (seq.thinking is not None and not seq.thinking.ended)


def _fill_rows(seq: SequenceControls, drafts: Sequence[int], mask: Tensor) -> None:
    """Row j of `mask`: what the sequence may sample after drafts[:j] (its thinking and its
    grammar taken through them on a copy and a rollback). Past a draft that could not be
    sampled (outside the grammar, or not the think-end token a spent budget forces), rows
    stay all allowed: the sampler's pick at that draft's row differs from it, so no later
    row is used."""
    thinking = seq.thinking.copy() if seq.thinking is not None else None
    matcher = seq.matcher
    fill(mask[0], thinking, matcher)
    taken = 0
    for j, token in enumerate(drafts, start=1):
        if thinking is not None and thinking.forced and token not in thinking.end_ids:
            break
        answer_token = thinking.take(token) if thinking is not None else True
        if answer_token and matcher is not None:
            if not matcher.try_accept(token):
                break
            taken += 1
        fill(mask[j], thinking, matcher)
    if matcher is not None:
        matcher.rollback(taken)
