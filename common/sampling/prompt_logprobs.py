"""A prompt scored by its own prefill: the logprob of each prompt token after the first, as the
echo of a completion with logprobs returns it, wherever the prompt was prefilled."""

from __future__ import annotations

import torch
from torch import Tensor

from common.sampling.sampler import SampledToken


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
