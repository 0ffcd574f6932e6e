"""Single-process generation: the reference every distributed engine's tokens are held to.

`absorbed` runs expanded prefill then absorbed decode over a latent cache (the serving
path); `expanded` recomputes the whole sequence with expanded MLA at every step (slow, no
cache, the reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.model.causal_lm import DeepseekForCausalLM
from common.model.contiguous_cache import ContiguousLatentCache
from common.sampling.keyed import DrawKey
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken, request_seed, sample

PATHS = ("absorbed", "expanded")


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    tokens: list[SampledToken]
    finish_reason: str  # "stop" (eos / stop id) or "length"


def generate(
    model: DeepseekForCausalLM,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    eos_ids: Sequence[int] = (),
    path: str = "absorbed",
) -> Generation:
    """Generate up to `params.max_tokens` tokens after `prompt_ids`."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; choose one of {PATHS}")
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    vocab = model.config.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    total = len(prompt_ids) + params.max_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
            f"model's context of {model.config.max_position_embeddings} tokens"
        )
    device = model.lm_head.weight.device
    eos = frozenset(eos_ids)
    seed = request_seed(params)
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    out = model.prefill(ids, [len(prompt_ids)])
    cache = None
    if path == "absorbed":
        cache = ContiguousLatentCache(model.config, 1, total, model.lm_head.weight.dtype, device)
        cache.load_prefill(0, out, 0, len(prompt_ids))
    logits = out.logits[0]
    tokens: list[SampledToken] = []
    seq = list(prompt_ids)
    while True:
        tok = sample(logits, params, DrawKey(seed, 0, len(seq)))
        tokens.append(tok)
        seq.append(tok.token_id)
        if (reason := params.finish_reason(tok.token_id, len(tokens), eos)) is not None:
            break
        if cache is not None:
            pos = torch.tensor([len(seq) - 1], device=device)
            logits = model.decode(torch.tensor([tok.token_id], device=device), pos, cache)[0]
        else:
            full = torch.tensor(seq, dtype=torch.long, device=device)
            logits = model.prefill(full, [len(seq)]).logits[0]
    return Generation([t.token_id for t in tokens], tokens, reason)
