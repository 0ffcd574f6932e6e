"""Token sampling: greedy, temperature, min-p, top-k, top-p, keyed draws, top-k logprobs,
after the logits processing of `common.sampling.logits` (penalties, logit_bias, min_tokens,
grammars).

Pure tensor math shared by `tpla generate`, the prefill worker's first token and the decode
engine's leader. Each row's random draw is keyed by (seed, choice, position)
(`common.sampling.keyed`), so a token is a function of its position's distribution and its
key alone: a seeded request reproduces its tokens whatever shares its batch, on whichever
group, and a speculative step's verification picks exactly the token plain decoding would.
Logprobs are those of the model's raw logits (vLLM's default), before any processing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from common.runtime.host_syncs import host_side
from common.runtime.transfers import to_device, to_host
from common.sampling.keyed import DrawKey, draw_seed, exponential_noise, key_words
from common.sampling.logits import LogitsContext, process_logits
from common.sampling.params import SamplingParams


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


def request_seed(params: SamplingParams) -> int:
    """The seed a request's draws are keyed by: its own, else one drawn now (once per
    request and stage: its choices and positions still draw apart)."""
    return params.seed if params.seed is not None else draw_seed()


def first_tokens(
    logits: Tensor,
    params: SamplingParams,
    n: int = 1,
    context: LogitsContext | None = None,
    *,
    position: int,
) -> tuple[SampledToken, ...]:
    """Each of n choices' first token from the last prompt position's logits [V]: choice i's
    draw keyed by (seed, i, `position`: the prompt's length), so every choice is seeded
    apart and reproducible. `context` holds the n rows' processing (the same for every
    choice: they share the prompt, and their grammars stand at the same place)."""
    seed = request_seed(params)
    keys = [DrawKey(seed, i, position) for i in range(n)]
    return tuple(sample_batch(logits[None].expand(n, -1), [params] * n, keys, context))


def filtered_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Apply temperature, top-k and top-p to one row of logits [V] (float32)."""
    return filtered_logits_batch(logits[None], [params])[0]


def filtered_logits_batch(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Temperature, min-p, top-k and top-p of each row of logits [B, V] (float32), with row
    b's parameters: one sort of the batch instead of one per row."""
    device = logits.device
    temperature = to_device([p.temperature for p in params], device)
    logits = logits.float() / temperature[:, None]
    if any(p.min_p for p in params):
        # min-p keeps the tokens at least min_p times as likely as the most likely one.
        min_p = to_device([p.min_p for p in params], device)[:, None]
        probs = logits.softmax(-1)
        keep = probs >= min_p * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    if not any(p.top_k or p.top_p < 1.0 for p in params):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    # Top-k keeps every token at least as likely as the k-th (ties included); 0 keeps all.
    k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Top-p over what top-k kept: drop a token once the mass before it already reaches
    # top_p; the top token always stays.
    top_p = to_device([p.top_p for p in params], device)
    probs = sorted_logits.softmax(-1)
    drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(
    logits: Tensor, params: SamplingParams, key: DrawKey, context: LogitsContext | None = None
) -> SampledToken:
    """Pick the next token from one row of logits [V]."""
    return sample_batch(logits[None], [params], [key], context)[0]


def sample_batch(
    logits: Tensor,
    params: Sequence[SamplingParams],
    keys: Sequence[DrawKey],
    context: LogitsContext | None = None,
) -> list[SampledToken]:
    """Pick every row's next token from logits [B, V] at once, on the logits' device, with
    one transfer of the results to the host. `context` carries what the logits processing
    needs (common.sampling.logits); None when no row has anything to process.

    Row b's noise is keyed by keys[b] alone (computed on the logits' device), so a seeded
    request samples the same tokens whichever requests share its batch. A draw is an
    exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks token i with probability
    p_i (the Gumbel-max trick without logarithms), so each row needs only its own noise,
    not its own kernel.
    """
    logits = logits.float()
    device = logits.device
    logprobs = torch.log_softmax(logits, dim=-1)
    scores = logits if context is None else process_logits(logits, params, context)
    tokens = scores.argmax(dim=-1)
    drawn = [b for b, p in enumerate(params) if not p.greedy]
    if drawn:
        every = len(drawn) == len(params)
        rows = None if every else to_device(drawn, device)
        picked = filtered_logits_batch(
            scores if rows is None else scores[rows], [params[b] for b in drawn]
        )
        # Unnormalized probabilities, in place (a fresh tensor): scaling a row does not
        # change its argmax_i p_i / E_i, so the softmax's division is not needed.
        weights = picked.sub_(picked.amax(dim=-1, keepdim=True)).exp_()
        # Every row's noise in one batch of integer kernels: launches, not host waits.
        noise = exponential_noise(key_words([keys[b] for b in drawn], device), weights.shape[-1])
        chosen_ids = weights.div_(noise).argmax(dim=-1)
        tokens = chosen_ids if rows is None else tokens.index_copy(0, rows, chosen_ids)
    chosen = logprobs.gather(1, tokens[:, None])
    top_k = max(p.logprobs for p in params)
    packed = [tokens[:, None].double(), chosen.double()]
    if top_k:
        top_values, top_ids = logprobs.topk(top_k, dim=-1)
        packed += [top_ids.double(), top_values.double()]
    # One transfer of every row's results (fp64 holds the ids and the fp32 logprobs exactly).
    results = to_host(torch.cat(packed, dim=1))
    with host_side():
        rows_out = results.tolist()
    return [
        SampledToken(
            int(row[0]),
            row[1],
            tuple(
                (int(i), v)
                for i, v in zip(
                    row[2 : 2 + p.logprobs], row[2 + top_k :][: p.logprobs], strict=True
                )
            ),
        )
        for row, p in zip(rows_out, params, strict=True)
    ]
