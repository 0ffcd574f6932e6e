"""What a prefill job samples from its prompt's logits (`FirstTokens`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from common.sampling.sampler import SampledToken


@dataclass(frozen=True)
class FirstTokens:
    """What a job samples from its prefill: each choice's first token, and the logprobs of
    prompt tokens 1..N-1 when asked for (the first has nothing to be predicted from)."""

    tokens: tuple[SampledToken, ...]
    prompt_logprobs: tuple[SampledToken, ...] = ()


def prompt_logprobs(logits: Tensor, prompt_ids: list[int], top: int) -> tuple[SampledToken, ...]:
    """Logprobs of prompt tokens 1..N-1 from the prefill's logits at positions 0..N-2 [N-1, V],
    with the `top` most likely alternatives of each position."""
    if len(prompt_ids) < 2:
        return ()
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(prompt_ids[1:], device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    alt_lps, alt_ids = (
        logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], targets[:, None][:, :0])
    )
    alt_ids_l, alt_lps_l = alt_ids.tolist(), alt_lps.tolist()
    return tuple(
        SampledToken(tok, lp, tuple(zip(alt_ids_l[i], alt_lps_l[i], strict=True)))
        for i, (tok, lp) in enumerate(zip(prompt_ids[1:], chosen, strict=True))
    )
