"""Logits processing before sampling, for a whole batch [B, V] at once: min_tokens,
logit_bias, the grammar's allowed tokens, and the repetition / frequency / presence penalties.

The prefill worker's first token and the decode leader's steps both go through
`process_logits` (via `common.sampling.sampler.sample_batch`), so a request is treated the same at
every token. Definitions and order follow vLLM:
    min_tokens   stop tokens (stop_token_ids, and EOS unless ignore_eos) get -inf while the
                 request has generated fewer than min_tokens tokens
    logit_bias   added to the logits (OpenAI: values in [-100, 100])
    grammar      tokens the request's grammar does not allow get -inf
    repetition   tokens seen in the prompt or the output: logit / p if positive, * p if not
    frequency    logit -= frequency_penalty * (times the token was generated)
    presence     logit -= presence_penalty * (1 if the token was generated)
Temperature, min_p, top-k and top-p come after, in `common.sampling.sampler`.

Per-sequence history lives in `TokenHistory`: one row of output-token counts (and of prompt
presence, for the repetition penalty) per tracked sequence, on the logits' device, updated
with one scatter per step; rows of sequences without penalties are never touched.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from common.runtime.transfers import to_device
from common.sampling.params import SamplingParams


@dataclass
class LogitsContext:
    """What the processing needs besides each row's params; tensors on the logits' device.

    output_counts: [B, V] int32, times each row's sequence generated each token (None: no
        row has a frequency / presence / repetition penalty).
    prompt_mask: [B, V] bool, tokens in each row's prompt (None: no repetition penalty).
    num_generated: tokens each row generated before the one being sampled (min_tokens).
    allowed: [B, V] bool, the tokens each row's grammar allows (all True for rows without
        one; None: no row has a grammar).
    """

    num_generated: Sequence[int]
    eos_token_ids: Collection[int] = ()
    output_counts: Tensor | None = None
    prompt_mask: Tensor | None = None
    allowed: Tensor | None = None


def process_logits(logits: Tensor, params: Sequence[SamplingParams], ctx: LogitsContext) -> Tensor:
    """The logits [B, V] (float32) with each row's controls applied; a new tensor."""
    out = logits.float().clone()
    batch, vocab = out.shape
    device = out.device
    # min_tokens: the stop tokens of the rows still below their minimum, in one index_put.
    early = [
        (b, p.stop_ids(ctx.eos_token_ids))
        for b, p in enumerate(params)
        if p.min_tokens and ctx.num_generated[b] < p.min_tokens
    ]
    rows = [b for b, stops in early for t in stops if 0 <= t < vocab]
    cols = [t for _, stops in early for t in stops if 0 <= t < vocab]
    if rows:
        out.index_put_(
            (to_device(rows, device), to_device(cols, device)),
            out.new_full((), float("-inf")),
        )
    bias = [(b, t, v) for b, p in enumerate(params) for t, v in p.logit_bias if 0 <= t < vocab]
    if bias:
        bias_rows, ids, values = (list(x) for x in zip(*bias, strict=True))
        out.index_put_(
            (to_device(bias_rows, device), to_device(ids, device)),
            to_device(values, device),
            accumulate=True,
        )
    if ctx.allowed is not None:
        out.masked_fill_(~ctx.allowed, float("-inf"))
    if ctx.output_counts is not None:
        counts = ctx.output_counts
        rep = to_device([p.repetition_penalty for p in params], device)[:, None]
        seen = counts > 0
        if ctx.prompt_mask is not None:
            seen = seen | ctx.prompt_mask
        scaled = torch.where(out > 0, out / rep, out * rep)
        out = torch.where(seen, scaled, out)
        freq = to_device([p.frequency_penalty for p in params], device)[:, None]
        pres = to_device([p.presence_penalty for p in params], device)[:, None]
        out = out - freq * counts - pres * (counts > 0).to(out.dtype)
    if rows or ctx.allowed is not None:
        # A row left with no token at all (a grammar that may only end while min_tokens
        # forbids ending) falls back to what its grammar allows: ending beats no token.
        dead = ~torch.isfinite(out).any(-1, keepdim=True)
        fallback = logits.float()
        if ctx.allowed is not None:
            fallback = fallback.masked_fill(~ctx.allowed, float("-inf"))
        out = torch.where(dead, fallback, out)
    assert out.shape == (batch, vocab)
    return out


def token_rows(rows: Sequence[Sequence[int]], vocab: int, device: torch.device | str) -> Tensor:
    """[len(rows), vocab] int32 counts of each row's token ids (ids outside [0, vocab) are
    ignored: a padded vocabulary's ids never reach the model's real columns)."""
    out = torch.zeros(len(rows), vocab, dtype=torch.int32, device=device)
    r = [i for i, ids in enumerate(rows) for t in ids if 0 <= t < vocab]
    c = [t for ids in rows for t in ids if 0 <= t < vocab]
    if r:
        out.index_put_(
            (to_device(r, torch.device(device)), to_device(c, torch.device(device))),
            torch.ones(len(r), dtype=torch.int32, device=device),
            accumulate=True,
        )
    return out


class TokenHistory:
    """Output-token counts and prompt-token masks of the tracked sequences, one row each, on
    one device: what the penalties need, kept across steps so a step adds one scatter.

    Row 0 stays empty: untracked sequences read it. Rows are handed out on `track` and
    reused after `release`; the table doubles when full (between steps, never in one).
    """

    def __init__(self, vocab: int, device: torch.device | str, rows: int = 8) -> None:
        self.vocab = vocab
        self.device = torch.device(device)
        self.counts = torch.zeros(rows, vocab, dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=self.device)
        self._free = list(range(rows - 1, 0, -1))

    def track(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> int:
        """A row for a new sequence holding its prompt and what it generated so far."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.counts[row] = token_rows([output_ids], self.vocab, self.device)[0]
        self.prompt[row] = token_rows([prompt_ids], self.vocab, self.device)[0] > 0
        return row

    def fork(self, row: int) -> int:
        """A new row holding a copy of `row` (a sequence forked from it: n > 1 choices)."""
        if not row:
            return 0
        if not self._free:
            self._grow()
        new = self._free.pop()
        self.counts[new] = self.counts[row]
        self.prompt[new] = self.prompt[row]
        return new

    def release(self, row: int) -> None:
        if row:
            self._free.append(row)

    def record(self, rows: Tensor, tokens: Tensor) -> None:
        """Count one more generated token per row (rows [N], tokens [N], on the device)."""
        self.counts.index_put_(
            (rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True
        )

    def gather(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The counts [B, V] and prompt masks [B, V] of the given rows (0 = an empty row)."""
        return self.counts.index_select(0, rows), self.prompt.index_select(0, rows)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
        self._free.extend(range(2 * old - 1, old - 1, -1))


def context_for(
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    eos_token_ids: Collection[int],
    vocab: int,
    device: torch.device | str,
    allowed: Tensor | None = None,
) -> LogitsContext | None:
    """The context of rows given as token lists (the prefill worker's first tokens, tests):
    prompts[b] and outputs[b] are row b's prompt and what it generated so far. None when no
    row needs processing."""
    if not any(p.processed for p in params):
        return None
    counts = prompt_mask = None
    if any(p.penalized for p in params):
        counts = token_rows(outputs, vocab, device)
        if any(p.repetition_penalty != 1.0 for p in params):
            prompt_mask = token_rows(prompts, vocab, device) > 0
    return LogitsContext([len(o) for o in outputs], eos_token_ids, counts, prompt_mask, allowed)
