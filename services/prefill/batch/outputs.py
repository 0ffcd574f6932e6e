"""What a prefill job answers with besides its KV (`FirstTokens`): from its prompt's logits,
and the last hidden state a decode group's MTP drafts start from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from common.model.causal_lm import PrefillOutput
from common.sampling.sampler import SampledToken


@dataclass(frozen=True)
class FirstTokens:
    """What a job samples from its prefill: each choice's first token, and the logprobs of
    prompt tokens 1..N-1 when asked for (the first has nothing to be predicted from)."""

    tokens: tuple[SampledToken, ...]
    prompt_logprobs: tuple[SampledToken, ...] = ()
    hidden: tuple[float, ...] = ()  # the last position's hidden state, for MTP drafts


def last_hidden(out: PrefillOutput, end: int) -> tuple[float, ...]:
    """Row end - 1's hidden state before the final norm: a prompt's last position."""
    assert out.hidden is not None
    return tuple(out.hidden[end - 1].float().tolist())


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
